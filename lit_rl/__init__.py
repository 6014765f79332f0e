"""lit-rl: LLM post-training (SFT, GRPO, OPD) as PyTorch Lightning modules, datamodules and callbacks."""

__version__ = "0.1.0"
