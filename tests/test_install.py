"""A non-editable install ships everything a config needs: run from a directory outside the repo.

The repo is built and installed with pip (no dependencies: they are this venv's) into a
temporary target directory, and `lit-rl` runs from another temporary directory with only
that target on PYTHONPATH: the repo's own `lit_rl` (which the venv has as an editable
install) must not be what is imported, and relative paths such as `lit_rl/assets/...`
point nowhere. The example config names the built-in model as `lit-rl:tiny_qwen3`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, reverse_rows, write_jsonl


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """lit-rl as `pip install .` makes it, in a target directory (built from a copy: no build/ in the repo)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(REPO / "lit_rl", src / "lit_rl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    target = tmp / "target"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return target


def lit_rl(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed), "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    return subprocess.run([str(installed / "bin" / "lit-rl"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_installed_package_is_the_one_imported(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run([sys.executable, "-c", "import lit_rl; print(lit_rl.__file__)"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert Path(out.stdout.strip()).is_relative_to(installed), out.stdout + out.stderr
    assert (installed / "lit_rl" / "assets" / "tiny_qwen3" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_preview_and_fit_from_outside_the_repo(installed, tmp_path):
    shutil.copy(REPO / "examples" / "reverse_text" / "sft.yaml", tmp_path / "sft.yaml")
    write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    data = ["--data.init_args.path", "train.jsonl", "--data.init_args.val_path", "", "--data.init_args.num_workers", "0"]

    preview = lit_rl(installed, tmp_path, "data", "preview", "--config", "sft.yaml", "--rows", "1", *data)
    assert preview.returncode == 0, preview.stderr[-3000:]
    assert "<|im_end|>]]" in preview.stdout, preview.stdout

    fit = lit_rl(installed, tmp_path, "fit", "--config", "sft.yaml", "--trainer.max_steps", "2",
                 "--data.init_args.batch_size", "8", "--trainer.default_root_dir", "run", *data)
    assert fit.returncode == 0, fit.stderr[-3000:]
    step = tmp_path / "run" / "weights" / "step_2"
    assert (step / "STABLE").is_file() and (step / "tokenizer.json").is_file()
