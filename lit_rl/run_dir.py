"""The run directory contract (DESIGN.md): where exported weights live and how readers find them.

`weights/step_<N>/` is a complete HF checkpoint, written under a temporary name,
flushed, renamed, and only then marked by an empty `STABLE` file. Readers ignore
step directories without `STABLE`.
"""

from __future__ import annotations

import re
from pathlib import Path

STABLE = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


def weights_dir(root: str | Path) -> Path:
    return Path(root) / "weights"


def step_dir(root: str | Path, step: int) -> Path:
    return weights_dir(root) / f"step_{step}"


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
