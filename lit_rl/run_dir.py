"""The run directory contract (DESIGN.md): where exported weights live and how readers find them.

`weights/step_<N>/` is a complete HF checkpoint, written under a temporary name,
flushed, renamed, and only then marked by an empty `STABLE` file. Readers ignore
step directories without `STABLE`. `sync/step_<N>/` has the same layout for the
weights RL training sends to its inference server after each step (see `sync_dir`). A LoRA run
writes adapters there (PEFT's two files) and its frozen base once to `weights/base/` (`base_dir`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lit_rl.child_process import pid_alive

STABLE = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


def fsync_written(path: str | Path) -> None:
    """Flush a written file, or every file under a written directory, to the disk before it is
    renamed into place: the rename is atomic, but a machine that loses power after it can leave the
    new name on data that never reached the disk (an empty `last.ckpt`, a step without weights)."""
    path = Path(path)
    files = [path] if path.is_file() else [Path(r) / name for r, _, names in os.walk(path) for name in names]
    for file in files:
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def ends_mid_line(fd: int) -> bool:
    """Whether the file open as `fd` ends without a line end: its last line was cut short (a full
    disk, a kill while it was appended), and what is appended next must start a line of its own."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def weights_dir(root: str | Path) -> Path:
    return Path(root) / "weights"


def step_dir(root: str | Path, step: int) -> Path:
    return weights_dir(root) / f"step_{step}"


def base_dir(root: str | Path) -> Path:
    """A LoRA run's frozen base model (`weights/base`), written once per run with a STABLE marker:
    what the policy's server serves the adapters of `weights/step_<N>` and `sync/step_<N>` on."""
    return weights_dir(root) / "base"


def sync_dir(root: str | Path) -> Path:
    """Weight-sync exports (`sync/step_<N>`): written for the policy's inference server after
    every optimizer step, not flushed to disk, a few kept; not checkpoints for evals or users."""
    return Path(root) / "sync"


def stable_steps(root: str | Path) -> dict[int, Path]:
    """Exported steps that are complete, by step number."""
    found = {}
    wdir = weights_dir(root)
    if not wdir.is_dir():
        return found
    for child in wdir.iterdir():
        m = _STEP.match(child.name)
        if m and (child / STABLE).is_file():
            found[int(m.group(1))] = child
    return dict(sorted(found.items()))


LEASE_PREFIX = "LEASE."


def step_of(path: Path) -> int | None:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def in_use(step_path: str | Path) -> bool:
    """A live consumer (e.g. the evaluator) holds a lease on this step directory. A lease whose
    holder died without letting go (SIGKILL) is stale: it is removed, or retention would keep
    that directory for ever."""
    held = False
    for path in Path(step_path).glob(LEASE_PREFIX + "*"):
        if _holder_alive(path):
            held = True
        else:
            path.unlink(missing_ok=True)
    return held


def _holder_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return path.exists()  # a lease without a pid (or being written): held
    return pid_alive(pid)


class lease:
    """Context manager a consumer holds while it reads a step directory, so that
    retention (`HFExport.keep_last`) does not delete it underneath. The lease file holds the
    holder's pid (`in_use` discards it once that process is gone)."""

    def __init__(self, step_path: str | Path, owner: str):
        self.path = Path(step_path) / f"{LEASE_PREFIX}{owner}"

    def __enter__(self) -> Path:
        self.path.write_text(str(os.getpid()))
        return self.path.parent

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)


def unfinished(root: str | Path) -> list[Path]:
    """Leftovers of interrupted exports: temporary directories and step directories without STABLE."""
    wdir = weights_dir(root)
    if not wdir.is_dir():
        return []
    return [p for p in wdir.iterdir() if p.is_dir() and (p.name.endswith(".tmp") or (step_of(p) is not None and not (p / STABLE).is_file()))]


def earlier_run(root: str | Path) -> list[str]:
    """What a run left in `root` that a fresh start would replace: exported steps, files under
    `checkpoints/`, the logs of launches that logged metrics. Empty for a directory with none of
    them, including that of a launch killed before it logged or saved anything."""
    root = Path(root)
    found = []
    steps = stable_steps(root)
    if steps:
        found.append(f"{len(steps)} exported step(s): {', '.join(p.name for p in steps.values())}")
    saved = sorted(p.name for p in (root / "checkpoints").iterdir()) if (root / "checkpoints").is_dir() else []
    if saved:
        found.append(f"checkpoints/: {', '.join(saved)}")
    logged = sorted(p.parent.name for p in root.glob("logs/*/metrics.csv"))
    if logged:
        found.append(f"the logs of {len(logged)} launch(es) in logs/")
    return found
