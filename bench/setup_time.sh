#!/usr/bin/env bash
# Time scripts/setup.sh from nothing, installing with uv and with pip, alternately, each in a fresh
# clone of this repo's HEAD with an empty uv cache (pip here keeps no HTTP cache of its own: check
# with `.venv/bin/python -m pip cache info`). Prints one line per run; nothing else should run meanwhile.
#
#   bash bench/setup_time.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq "$rounds"); do
  for with in uv pip; do
    rm -rf "$work/clone" "$work/uv-cache"
    git clone -q . "$work/clone"
    start=$(date +%s.%N)
    (cd "$work/clone" && LIT_RL_SETUP_WITH=$with UV_CACHE_DIR="$work/uv-cache" bash scripts/setup.sh >/dev/null 2>&1)
    printf 'round %d  %-3s  %6.1f s\n' "$round" "$with" "$(echo "$(date +%s.%N) - $start" | bc)"
  done
done
