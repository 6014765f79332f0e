#!/usr/bin/env bash
# The GPU check of the distributed work (issue 13), in one go, under 8 minutes on one machine:
#   1. tests/test_gpu.py: FSDP1 train + sharded resume, FSDP2 bf16 mixed precision, FSDP2 CPU
#      offload, all over NCCL on every GPU of the machine;
#   2. bench/gpu_sft.py: SFT throughput (tokens/s) and model FLOPs utilisation of a
#      Qwen3-0.6B-shaped model (random init, vocabulary 151,936) under FSDP2 + bf16.
# NOT RUN YET: no GPU machine has been available. Record its output in docs/benchmarks.md.
#   bash bench/gpu_check.sh                 # from the repository root, with .venv built
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=index,name,memory.total --format=csv
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA: this script is for a GPU machine"; print("torch", torch.__version__, "GPUs:", torch.cuda.device_count())'
status=0
start=$SECONDS
timeout 300 "$PY" -m pytest tests/test_gpu.py -q -p no:cacheprovider || status=$?
echo "GPU tests: exit $status, $((SECONDS - start)) s"
start=$SECONDS
timeout 150 "$PY" bench/gpu_sft.py --steps 10 --warmup 3 || status=$?
echo "throughput: $((SECONDS - start)) s"
exit $status
