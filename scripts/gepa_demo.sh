#!/usr/bin/env bash
# CPU demo of the two commands that need no training: baseline evaluation and GEPA prompt optimisation.
#
#   bash scripts/gepa_demo.sh                         # ~2 min on 2 cores
#   MODEL=outputs/demo-rl/weights/step_40 bash scripts/gepa_demo.sh   # a trained policy instead
#
# 1. `hpcrl eval` scores MODEL on reverse-text (8 examples x 3 rollouts): results.jsonl, summary.json.
# 2. `hpcrl gepa run` searches a better system prompt with a budget of BUDGET scored rollouts; the
#    reflection model is MODEL itself, served by the same `hpcrl inference` process.
# 3. `hpcrl eval` again with the best prompt plugged in through system_prompt_file.
# Every step starts and stops its own inference server. With the default tiny random-init model the
# reflection model writes noise, so expect best = base: the demo shows the machinery, not a gain.
# Knobs: MODEL (default: a tiny model built locally), OUT (default outputs/gepa-demo), BUDGET (60).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
[ -x "$bin/hpcrl" ] || bin=$(dirname "$(command -v hpcrl)")
out=${OUT:-outputs/gepa-demo}
budget=${BUDGET:-60}
rm -rf "$out"
if [ -z "${MODEL:-}" ]; then
  MODEL=$out/tiny-model
  "$bin/hpcrl" make-tiny-model "$MODEL" >/dev/null
fi
sampling=(-t 16 -T 0.7)

"$bin/hpcrl" eval reverse-text -m "$MODEL" -n 8 -r 3 "${sampling[@]}" --output-dir "$out/eval-base"
"$bin/hpcrl" gepa run reverse-text -m "$MODEL" -B "$budget" -n 16 -N 8 --minibatch-size 3 \
  --state-columns text "${sampling[@]}" --output-dir "$out/gepa"
"$bin/hpcrl" eval reverse-text -m "$MODEL" -n 8 -r 3 "${sampling[@]}" --output-dir "$out/eval-best" \
  -a "{\"system_prompt_file\": \"$out/gepa/best_prompt.txt\"}"

"$bin/python" - "$out" <<'PY'
import json, sys
out = sys.argv[1]
meta = json.load(open(f"{out}/gepa/metadata.json"))
base = json.load(open(f"{out}/eval-base/summary.json"))["envs"]["reverse-text"]["avg@3"]
best = json.load(open(f"{out}/eval-best/summary.json"))["envs"]["reverse-text"]["avg@3"]
print(f"gepa: {meta['num_candidates']} candidates, {meta['total_metric_calls']}/{meta['max_calls']} metric calls; "
      f"validation score base {meta['base_score']:.3f} -> best {meta['best_score']:.3f}")
print(f"eval avg@3 (8 examples x 3): base prompt {base:.3f}, best prompt {best:.3f}")
PY
