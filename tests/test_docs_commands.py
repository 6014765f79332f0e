"""Every command in a ```bash block of docs/cli.md and the README runs, so the docs cannot rot.

The commands run in order, as written, from a scratch directory holding copies of the repo's
`examples/` and `configs/`, with this venv's `lit-rl` and `python` first on PATH and the hub
offline. Later commands use what earlier ones wrote (the data, the run directory), so run the
whole file, not one case. Skipped, each with its reason:
- a command marked in the docs with a trailing `# needs internet ...` or `# needs a GPU ...`;
- the README's two opening commands, which build the environment from nothing (CI runs them,
  .ci/run);
- a command already run from an earlier block (the README repeats docs/cli.md).
A command marked `# runs until Ctrl-C` (a server) is started and must print that it is ready;
it stays up for the next command (which may use it, as a user would from another terminal)
and is then stopped with Ctrl-C (SIGINT), which must end it with code 130.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from helpers import REPO

# The commands run in order, each using what the earlier ones wrote: one worker runs the whole
# file (conftest.ONE_WORKER_FILES).
DOCS = ("docs/cli.md", "README.md")
NEEDS = re.compile(r"#\s*(needs (?:internet|a GPU).*)$")
UNTIL_CTRL_C = "# runs until Ctrl-C"
BUILDS_ENV = ("bash scripts/setup.sh", "builds .venv from nothing (minutes); CI runs the README's test command (.ci/run)")
READY = re.compile(r"\bready\b")


def bash_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks, continuation lines joined, comment-only lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return commands


def documented_commands() -> list[tuple[str, str]]:
    return [(doc, cmd) for doc in DOCS for cmd in bash_commands((REPO / doc).read_text())]


def skip_reason(doc: str, command: str, earlier: list[str]) -> str | None:
    if match := NEEDS.search(command):
        return match.group(1)
    if command.startswith(BUILDS_ENV[0]):
        return BUILDS_ENV[1]
    if command in earlier:
        return "already run from an earlier block"
    return None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("docs")
    ignore = shutil.ignore_patterns("data", "__pycache__")
    shutil.copytree(REPO / "examples", root / "examples", ignore=ignore)
    shutil.copytree(REPO / "configs", root / "configs", ignore=ignore)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return root, env


def start_until_ready(command: str, cwd: Path, env: dict, timeout: float = 300
                      ) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """Start a server command and wait for its 'ready' line; the process, its output (growing) and
    the thread that reads it on."""
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.time() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if READY.search(line) or time.time() > deadline:
                break
        assert any(READY.search(line) for line in lines), "".join(lines)[-3000:]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    # read on while it serves, so that a full pipe never blocks it
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, lines, reader


def stop_with_ctrl_c(proc: subprocess.Popen, lines: list[str], reader: threading.Thread) -> str:
    """Ctrl-C a server started by `start_until_ready`: it must exit with 130. Its whole output."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        reader.join(timeout=30)  # its last lines, up to the end of its output
        assert proc.returncode == 130, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    for log in map(Path, re.findall(r"\(log: (/\S+?\.log)\)", output)):
        if log.parent == Path(tempfile.gettempdir()):  # a temporary log the command made for its user
            log.unlink(missing_ok=True)
    return output


_run_so_far: list[str] = []
_serving: list[tuple[subprocess.Popen, list[str], threading.Thread]] = []  # a server command kept up for the next command


@pytest.fixture(scope="module", autouse=True)
def _no_server_outlives_the_file():
    yield
    while _serving:
        stop_with_ctrl_c(*_serving.pop())


@pytest.mark.slow
@pytest.mark.parametrize("doc, command", documented_commands(), ids=[f"{d}: {c[:70]}" for d, c in documented_commands()])
def test_documented_command_runs(doc, command, workspace):
    cwd, env = workspace
    reason = skip_reason(doc, command, _run_so_far)
    if reason:
        pytest.skip(reason)
    _run_so_far.append(command)
    if command.endswith(UNTIL_CTRL_C):
        _serving.append(start_until_ready(command, cwd, env))
        return
    try:
        out = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        while _serving:  # the server the command may have used: stopped as a user would
            stop_with_ctrl_c(*_serving.pop())
    assert out.returncode == 0, f"{doc}: {command}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_docs_have_commands_and_the_markers_are_recognised():
    """Guards the parser itself: a block that silently yields nothing would test nothing."""
    cli = bash_commands((REPO / "docs/cli.md").read_text())
    for name in ("fit", "validate", "data preview", "serve", "evaluate", "report"):
        assert any(c.startswith(f"lit-rl {name} ") for c in cli), name
    readme = bash_commands((REPO / "README.md").read_text())
    assert readme[:2] == ["bash scripts/setup.sh && bash examples/reverse_text/run_demo.sh",
                          "bash scripts/setup.sh && .venv/bin/python -m pytest -q"]
    for name in ("fit", "validate", "data preview", "serve", "evaluate", "report"):  # "What works today"
        assert any(c.startswith(f"lit-rl {name} ") for c in readme), name
    gpu = [c for c in cli if NEEDS.search(c)]
    assert gpu and all("configs/sft.yaml" in c for c in gpu)
