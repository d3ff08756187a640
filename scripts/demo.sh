#!/usr/bin/env bash
# The CPU demo that learns: SFT warm-up of the tiny Qwen3-style model on reverse-text-demo (reverse
# 3-5 lowercase letters), then asynchronous RL from the SFT weights, with eval before and after RL,
# plots, and a summary (eval before -> after, train reward first -> last steps, wall time).
#
#   bash scripts/demo.sh                      # ~3 min on 2 idle cores (see docs/demo.md)
#
# RL from random init learns almost nothing here, and SFT run to convergence leaves RL nothing to do:
# the SFT step count is calibrated so the policy has just started reversing (greedy output is often
# right, sampled output at temperature 1 is not), and RL then climbs by sharpening and refining it.
# Re-runnable: every output directory is cleaned first. Knobs (environment variables), mainly for the
# shortened test: DEMO_OUT (default outputs), DEMO_SFT_STEPS / DEMO_RL_STEPS (override the configs'
# max_steps), DEMO_RL_ARGS (extra `hpcrl run` flags, word-split).
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
start=$(date +%s)

# A fresh clone after scripts/setup.sh has .venv but nothing on PATH; an active venv also works.
if [ -x .venv/bin/hpcrl ]; then
  bin=.venv/bin
else
  bin=$(dirname "$(command -v hpcrl || echo /usr/bin/hpcrl)")
fi
[ -x "$bin/hpcrl" ] || { echo "demo: hpcrl not found; run: bash scripts/setup.sh" >&2; exit 2; }

out=${DEMO_OUT:-outputs}
data=$out/demo-sft-data/train.jsonl
# Step counts live in the configs; these overrides exist for the shortened test.
sft_steps=(${DEMO_SFT_STEPS:+--max-steps "$DEMO_SFT_STEPS"})
rl_steps=(${DEMO_RL_STEPS:+--max-steps "$DEMO_RL_STEPS"})

echo "== 1/3 SFT data: $data"
"$bin/python" -m hpcrl.trainer.sft_data make-demo "$data" --task reverse-text-demo --n 2000 --seed 0

echo "== 2/3 SFT warm-up (configs/demo/sft.toml) -> $out/demo-sft"
"$bin/hpcrl" sft configs/demo/sft.toml --clean-output-dir true --output-dir "$out/demo-sft" \
  --data.name "$data" "${sft_steps[@]}"
# The final weights are the newest weights/step_N (the dir was cleaned, so no stale one).
weights=$(ls -d "$out"/demo-sft/weights/step_* 2>/dev/null | sort -V | tail -n 1)
[ -f "$weights/config.json" ] || { echo "demo: SFT wrote no weights under $out/demo-sft/weights" >&2; exit 1; }

echo "== 3/3 RL (configs/demo/rl.toml) from $weights -> $out/demo-rl; eval of policy 0 = the SFT policy"
# shellcheck disable=SC2086  # DEMO_RL_ARGS is a list of flags on purpose
"$bin/hpcrl" run configs/demo/rl.toml --clean-output-dir --output-dir "$out/demo-rl" \
  --model.name "$weights" "${rl_steps[@]}" ${DEMO_RL_ARGS:-}

"$bin/python" -m hpcrl.monitor.summary "$out/demo-rl" --sft-dir "$out/demo-sft" \
  --wall-s "$(($(date +%s) - start))"
