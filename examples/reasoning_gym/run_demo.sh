#!/usr/bin/env bash
# reasoning-gym on CPU: SFT of the tiny model on spell_backward tasks (seed 0), then GRPO on the
# same generator's tasks from another seed (2,000,000), scored before and after on held-out tasks
# (seed 1,000,000) with `lit-rl evaluate`.
#   bash examples/reasoning_gym/run_demo.sh [extra lit-rl fit flags for the GRPO run]
# e.g. --seed_everything 1 (and ROOT=runs/reasoning_gym_grpo_seed1); the task order follows the seed
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SFT_ROOT=${SFT_ROOT:-runs/reasoning_gym_sft}
ROOT=${ROOT:-runs/reasoning_gym_grpo}
START="$SFT_ROOT/weights/step_300"
HELD_OUT='"dataset": "spell_backward", "size": 200, "task_seed": 1000000, "config": {"max_word_len": 6},
  "system_prompt": null, "answer_tag": null, "max_tokens": 16'
score() {  # every stable checkpoint under $1: greedy, and 4 samples per task at T=1
  .venv/bin/lit-rl evaluate --weights-dir "$1" \
    --env lit_rl.rollouts.ReasoningGymEnv --env-args "{$HELD_OUT, \"name\": \"greedy\"}" \
    --env lit_rl.rollouts.ReasoningGymEnv --env-args "{$HELD_OUT, \"name\": \"sampled\", \"temperature\": 1.0,
      \"samples_per_prompt\": 4, \"seed\": null}" \
    --server '{"max_model_len": 512, "dtype": "float32", "enforce_eager": true}' 2>&1 | grep "evaluator: step" || true
}
if [ ! -f "$START/STABLE" ]; then
  .venv/bin/python examples/reasoning_gym/make_data.py --out examples/reasoning_gym/data
  echo "== SFT: lit-rl fit --config examples/reasoning_gym/sft.yaml"
  .venv/bin/lit-rl fit --config examples/reasoning_gym/sft.yaml --trainer.default_root_dir "$SFT_ROOT"
  echo "== held-out reward of the SFT model (every export; GRPO starts from step 300)"
  score "$SFT_ROOT/weights"
fi
echo "== GRPO: lit-rl fit --config examples/reasoning_gym/grpo.yaml"
.venv/bin/lit-rl fit --config examples/reasoning_gym/grpo.yaml --model.init_args.model "$START" \
  --trainer.default_root_dir "$ROOT" "$@"
echo "== held-out reward of the GRPO exports (steps 10, 20, 30, 40)"
score "$ROOT/weights"
