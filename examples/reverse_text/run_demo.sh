#!/usr/bin/env bash
# The offline demo: SFT of the built-in tiny Qwen3 (random init) on reverse-text, on CPU.
# Writes the dataset, scores the untrained model, trains, scores the trained one.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
ROOT=${ROOT:-runs/reverse_text_sft}
$PY examples/reverse_text/make_data.py --out examples/reverse_text/data
echo "== held-out exact match before training (random init)"
$PY examples/reverse_text/exact_match.py --model lit_rl/assets/tiny_qwen3 --random-init
echo "== training: lit-rl fit --config examples/reverse_text/sft.yaml"
.venv/bin/lit-rl fit --config examples/reverse_text/sft.yaml --trainer.default_root_dir "$ROOT" "$@"
LAST=$(ls -d "$ROOT"/weights/step_* | sort -t_ -k2 -n | tail -1)
echo "== held-out exact match after training ($LAST)"
$PY examples/reverse_text/exact_match.py --model "$LAST"
