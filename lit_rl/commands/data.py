"""`lit-rl data preview`: shows what will be trained, row by row.

    lit-rl data preview --config sft.yaml --rows 5          # text, trained spans marked
    lit-rl data preview --config sft.yaml --rows 5 --json   # one JSON object per row

The datamodule and model are built from the same config `lit-rl fit` reads (dotted
overrides after the config work too), so the preview is exactly what training sees.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from lit_rl.cli import refuse_missing_config_file, unknown_command
from lit_rl.data.steps import BadRowError
from lit_rl.errors import UserError

START, END = "[[", "]]"  # plain-text markers around trained spans
GREEN, RESET = "\x1b[32;1m", "\x1b[0m"


def marked_text(tokenizer, input_ids: list[int], loss_mask: list[bool], *, color: bool) -> str:
    """The row's text with each run of trained tokens wrapped in markers (or green)."""
    open_, close = (GREEN, RESET) if color else (START, END)
    out, i = [], 0
    while i < len(input_ids):
        j = i
        while j < len(input_ids) and loss_mask[j] == loss_mask[i]:
            j += 1
        text = tokenizer.decode(input_ids[i:j], skip_special_tokens=False)
        out.append(f"{open_}{text}{close}" if loss_mask[i] else text)
        i = j
    return "".join(out)


TOP_LEVEL_OPTIONS = ("--seed_everything",)  # a fit config's undotted keys that can change its rows


def build_datamodule(configs: list[str], overrides: list[str]):
    import warnings

    from lit_rl.lightning_cli import LitRLCLI

    with warnings.catch_warnings():  # args come from our own parser, not a second sys.argv
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = LitRLCLI(args=[*(a for c in configs for a in ("--config", c)), *overrides], run=False,
                       save_config_callback=None)
    dm, model = cli.datamodule, cli.model
    if not getattr(dm, "tokenizer_name", None):
        dm.tokenizer_name = model.tokenizer_name
    return dm


def refuse_generated_data(dm) -> None:
    """A preview renders the rows of a dataset (StaticDataModule); an RL config's rows are generated
    while it trains, and its data module's own checks (a batch of whole groups) would refuse the
    preview's one-row batches with a message about a batch size the user never set."""
    from lit_rl.data.datamodules import StaticDataModule

    if not isinstance(dm, StaticDataModule):
        kind = f"{type(dm).__module__}.{type(dm).__qualname__}"
        raise UserError(f"lit-rl data preview shows the rows of a lit_rl.data.datamodules.StaticDataModule (a dataset "
                        f"trained as it is); this config's data is {kind}, whose samples are generated during training "
                        "(a run writes what it trained to <default_root_dir>/rollouts/trained.jsonl)")


def preview(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-rl data preview",
        description="Show rows of a fit config's training data as they will be trained: the text the model "
        "sees, with the trained (assistant) tokens between [[ and ]] (green on a terminal).",
        epilog="Any other option is a dotted override of the config, as with lit-rl fit, e.g. "
        "--data.init_args.path my_chats.jsonl. Example: lit-rl data preview --config examples/reverse_text/sft.yaml --rows 2",
    )
    parser.add_argument("--config", required=True, action="append",
                        help="the fit config (YAML); several are merged in order, as by lit-rl fit")
    parser.add_argument("--rows", type=int, default=5, help="how many rows to show")
    parser.add_argument("--start", type=int, default=0, help="first row index")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row (input_ids, loss_mask)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [a for a in overrides if re.match(r"--?[A-Za-z_]", a) and "." not in a.split("=")[0]
               and a.split("=")[0] not in TOP_LEVEL_OPTIONS]  # a value such as -5 is not a flag
    if unknown:  # not a dotted config override either: say so here, not with fit's 200-line usage
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are dotted, e.g. --data.init_args.path)")
    refuse_missing_config_file([a for c in args.config for a in ("--config", c)])
    if args.rows < 1:
        raise UserError(f"--rows must be >= 1, got {args.rows}")
    dm = build_datamodule(args.config, overrides)
    refuse_generated_data(dm)
    dm.batch_size = 1  # a preview renders rows one by one; a small file need not fill a batch
    dm.val_path = dm.val_split = None  # it shows the training rows only
    dm.setup("fit")
    renderer = dm._train.renderer
    if not 0 <= args.start < len(renderer.rows):
        raise UserError(f"--start {args.start} is not a row of the training data: it has {len(renderer.rows)} rows "
                        f"(--start 0 to {len(renderer.rows) - 1})")
    color = sys.stdout.isatty() and not args.json
    stop = min(len(renderer.rows), args.start + args.rows)
    for index in range(args.start, stop):
        try:
            sample = renderer.sample(index)
        except BadRowError as e:
            print(json.dumps({"row": index, "error": str(e)}) if args.json else f"--- row {index}: ERROR {e}")
            continue
        if args.json:
            print(json.dumps({"row": index, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask}))
        else:
            print(f"--- row {index}: {len(sample)} tokens, {sample.num_targets} trained" + (" (truncated)" if sample.truncated else ""))
            print(marked_text(renderer.tokenizer, sample.input_ids, sample.loss_mask, color=color))
    return 0


COMMANDS = {"preview": (preview, "show rows as they will be trained, trained tokens marked")}


def main(argv: list[str]) -> None:
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):  # as `lit-rl`'s own unknown command
        raise unknown_command(argv[0], COMMANDS, "lit-rl data")
    if not argv or argv[0] not in COMMANDS:
        lines = ["usage: lit-rl data COMMAND [options]   (lit-rl data COMMAND --help for its options)", "", "commands:"]
        lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
        asked = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not asked:
            lines.insert(0, f"lit-rl data: unknown command {argv[0]!r}")
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        raise SystemExit(0 if asked else 2)
    raise SystemExit(COMMANDS[argv[0]][0](argv[1:]))
