#!/usr/bin/env bash
# One env host per env node (deployment.env_nodes > 0): `srun --het-group=2 sbatch/envs.sh`.
# Env host index = the task's rank within the envs step. It starts the env servers the orchestrator
# orders for this node through the run directory (bus/envs/), reports each one's exit there, and
# starts it again when the orchestrator orders a restart (orchestrator.env_server_max_restarts
# counts them; past the limit the orchestrator ends the run naming the env). See hpcrl/envs/runtime/host.py.
# Its log: logs/envs/host_<index>.log (tmux.sh's env pane and `hpcrl logs` follow logs/envs/).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

index=${SLURM_PROCID:?run me under srun}
log=$HPCRL_RUN_DIR/logs/envs/host_$index.log
mkdir -p "$(dirname "$log")"
echo "[sbatch/envs.sh] env host $index on ${SLURMD_NODENAME:-$(hostname -s)} (job ${SLURM_JOB_ID:-?}) -> $log"
exec >>"$log" 2>&1
exec "$HPCRL_PYTHON" -m hpcrl.envs.runtime.host --run-dir "$HPCRL_RUN_DIR" --node-index "$index" "$@"
