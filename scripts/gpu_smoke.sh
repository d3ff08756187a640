#!/usr/bin/env bash
# The first thing to run on a real GPU box (>= 2 CUDA GPUs): reverse-text RL with the trainer on one
# GPU (FSDP2/NCCL) and a vLLM server on another, weights moved by NCCL broadcast, every sync verified
# by checksum. It cannot run on the CPU development machines (no CUDA kernel there); everything around
# it is tested there (placement on a fake-GPU SLURM, vLLM 0.33 conformance, the weight group on gloo).
#
#   bash scripts/gpu_smoke.sh [OUTPUT_DIR]        # default outputs/gpu-smoke; HPCRL_SMOKE_STEPS=20
#
# It sets up .venv-gpu (vLLM 0.33 with its CUDA torch, then hpcrl), runs
# `hpcrl run configs/reverse_text/rl.toml` with backend vllm + collective transport, then checks:
#   1. placement: the trainer rank and the server saw disjoint, non-empty GPU sets;
#   2. weight syncs: the servers loaded and verified every policy 1..N (no PolicyMismatch);
#   3. learning: mean train reward of the last 5 steps exceeds the first 5 steps' by >= 0.05.
# Exit code 0 only when the run and all three checks pass.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu-smoke}
STEPS=${HPCRL_SMOKE_STEPS:-20}
VENV=${HPCRL_GPU_VENV:-.venv-gpu}

command -v nvidia-smi >/dev/null || { echo "gpu_smoke: no nvidia-smi: this needs a CUDA machine" >&2; exit 2; }
gpus=$(nvidia-smi -L | wc -l)
(( gpus >= 2 )) || { echo "gpu_smoke: needs 2 GPUs, nvidia-smi lists $gpus" >&2; exit 2; }

if [[ ! -x $VENV/bin/python ]]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm, hpcrl" 2>/dev/null; then
  "$VENV/bin/pip" install -q "vllm==0.33.0"      # brings its own CUDA torch
  "$VENV/bin/pip" install -q -e .
fi

"$VENV/bin/python" -m hpcrl.cli run configs/reverse_text/rl.toml --output-dir "$OUT" --clean-output-dir \
  --max-steps "$STEPS" --inference.backend vllm --trainer.broadcast.transport collective --no-wandb

"$VENV/bin/python" - "$OUT" "$STEPS" <<'PY'
import json, re, sys
from pathlib import Path

out, steps = Path(sys.argv[1]), int(sys.argv[2])
recs = [json.loads(l) for l in (out / "logs/placement.jsonl").read_text().splitlines()]
trainer = {tuple(r["gpus"]) for r in recs if r["role"] == "trainer"}
servers = {tuple(r["gpus"]) for r in recs if r["role"] == "inference"}
used = [g for s in trainer | servers for g in s]
assert all(trainer) and all(servers) and len(used) == len(set(used)), f"GPU sets overlap: {trainer} {servers}"
log = (out / "logs/orchestrator.log").read_text()
loaded = {int(m) for m in re.findall(r"policy (\d+) loaded on \d+ server\(s\) \(checksum verified", log)}
missing = set(range(1, steps)) - loaded
assert not missing and "PolicyMismatch" not in log, f"unverified weight syncs: {sorted(missing)}"
metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
reward = [m["reward/all/mean"] for m in sorted(metrics, key=lambda m: m["step"]) if "reward/all/mean" in m]
first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
assert last >= first + 0.05, f"reward did not climb: first 5 steps {first:.3f}, last 5 {last:.3f}"
print(f"gpu_smoke OK: GPUs trainer {sorted(trainer)} / inference {sorted(servers)}, "
      f"{len(loaded)} verified syncs, reward {first:.3f} -> {last:.3f}")
PY
