"""lit-rl subcommands that are not Lightning trainer entry points."""
