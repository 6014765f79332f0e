"""Test helpers: the built-in tiny model's path and datasets written to real local files."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = str(REPO / "lit_rl" / "assets" / "tiny_qwen3")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def reverse_rows(n: int, offset: int = 0) -> list[dict]:
    words = ["apple", "river", "stone", "light", "music", "green", "table", "water", "cloud", "bread", "tiger", "ocean"]
    rows = []
    for i in range(offset, offset + n):
        text = " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(1 + i % 3))
        rows.append({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]})
    return rows


def lit_rl_here(args: list[str], env: dict[str, str] | None = None):
    """`lit-rl ARGS` in this process, as `subprocess.run` would report it (returncode, stdout,
    stderr), without the ~8 s a new process spends importing torch, transformers and Lightning:
    the repo as working directory, sys.argv without pytest's arguments, `env` added to the
    environment (children the run starts, such as the evaluator, inherit it), all restored after.
    For runs whose process matters (signals, several ranks, exit as a user sees it) use a subprocess."""
    import contextlib
    import io
    import signal
    import subprocess
    import sys

    from lit_rl import cli  # here: collecting the test files stays light

    devices = [b for a, b in zip(args, args[1:]) if a == "--trainer.devices" and b != "1"]
    if devices:  # Lightning would start the other ranks by running this process's command line again: pytest's
        raise ValueError(f"lit_rl_here runs one process; --trainer.devices {devices[0]} asks for more: use a subprocess")
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv, saved_cwd, saved_sigint = dict(os.environ), sys.argv, os.getcwd(), signal.getsignal(signal.SIGINT)
    os.environ.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    sys.argv = ["lit-rl"]
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        signal.signal(signal.SIGINT, saved_sigint)
    return subprocess.CompletedProcess(["lit-rl", *args], code, out.getvalue(), err.getvalue())
