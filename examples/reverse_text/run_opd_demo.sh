#!/usr/bin/env bash
# On-policy distillation demo on CPU: a short SFT run (the student, clearly imperfect) learns from
# the full SFT demo's model (the teacher), which scores every token the student samples.
#   bash examples/reverse_text/run_opd_demo.sh [extra lit-rl fit flags for the OPD run]
# e.g. --data.init_args.max_staleness 0 --seed_everything 1
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
STUDENT_ROOT=${STUDENT_ROOT:-runs/reverse_text_sft_short}
STUDENT_STEPS=${STUDENT_STEPS:-40}
TEACHER_ROOT=${TEACHER_ROOT:-runs/reverse_text_sft}
TEACHER_STEPS=${TEACHER_STEPS:-300}
ROOT=${ROOT:-runs/reverse_text_opd}
$PY examples/reverse_text/make_data.py --out examples/reverse_text/data
sft() {  # sft ROOT STEPS: the SFT demo's config, stopped after STEPS steps, unless already there
  if [ ! -f "$1/weights/step_$2/STABLE" ]; then
    echo "== SFT for $2 steps -> $1"
    .venv/bin/lit-rl fit --config examples/reverse_text/sft.yaml --trainer.max_steps "$2" \
      --trainer.default_root_dir "$1" --trainer.limit_val_batches 0 --trainer.enable_checkpointing false
  fi
}
sft "$STUDENT_ROOT" "$STUDENT_STEPS"
sft "$TEACHER_ROOT" "$TEACHER_STEPS"
STUDENT="$STUDENT_ROOT/weights/step_$STUDENT_STEPS"
TEACHER="$TEACHER_ROOT/weights/step_$TEACHER_STEPS"
echo "== held-out reward of the teacher ($TEACHER)"
$PY examples/reverse_text/exact_match.py --model "$TEACHER" --samples 4
echo "== held-out reward of the student before OPD ($STUDENT)"
$PY examples/reverse_text/exact_match.py --model "$STUDENT" --samples 4
echo "== OPD: lit-rl fit --config examples/reverse_text/opd.yaml"
.venv/bin/lit-rl fit --config examples/reverse_text/opd.yaml --model.init_args.model "$STUDENT" \
  --inference.teacher_model "$TEACHER" --trainer.default_root_dir "$ROOT" "$@"
LAST="$ROOT/weights/step_$(ls "$ROOT/weights" | sed -n 's/^step_\([0-9]*\)$/\1/p' | sort -n | tail -1)"
echo "== held-out reward of the student after OPD ($LAST)"
$PY examples/reverse_text/exact_match.py --model "$LAST" --samples 4
