#!/usr/bin/env bash
# GRPO demo on CPU: a short SFT run leaves the reverse-text model clearly imperfect, then GRPO
# with a real vLLM server (started by lit-rl) raises its held-out reward.
#   bash examples/reverse_text/run_grpo_demo.sh [extra lit-rl fit flags for the GRPO run]
# e.g. --data.init_args.max_staleness 1 --seed_everything 1
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
SFT_ROOT=${SFT_ROOT:-runs/reverse_text_sft_short}
SFT_STEPS=${SFT_STEPS:-40}
ROOT=${ROOT:-runs/reverse_text_grpo}
$PY examples/reverse_text/make_data.py --out examples/reverse_text/data
START="$SFT_ROOT/weights/step_$SFT_STEPS"
if [ ! -f "$START/STABLE" ]; then
  echo "== SFT for $SFT_STEPS steps only: the starting point GRPO improves on"
  .venv/bin/lit-rl fit --config examples/reverse_text/sft.yaml --trainer.max_steps "$SFT_STEPS" \
    --trainer.default_root_dir "$SFT_ROOT" --trainer.limit_val_batches 0 --trainer.enable_checkpointing false
fi
echo "== held-out reward before GRPO ($START)"
$PY examples/reverse_text/exact_match.py --model "$START" --samples 4
echo "== GRPO: lit-rl fit --config examples/reverse_text/grpo.yaml"
.venv/bin/lit-rl fit --config examples/reverse_text/grpo.yaml --model.init_args.model "$START" \
  --trainer.default_root_dir "$ROOT" "$@"
LAST="$ROOT/weights/step_$(ls "$ROOT/weights" | sed -n 's/^step_\([0-9]*\)$/\1/p' | sort -n | tail -1)"
echo "== held-out reward after GRPO ($LAST)"
$PY examples/reverse_text/exact_match.py --model "$LAST" --samples 4
