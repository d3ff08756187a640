#!/usr/bin/env bash
# One inference server on a SLURM node: `srun --het-group=1 sbatch/inference.sh [hpcrl inference args]`.
# Server index = the task's rank within the inference step. It binds every interface on a free
# port by default (HPCRL_SERVER_HOST / HPCRL_SERVER_PORT override) and advertises its address in
# the run directory (bus/servers/), where the orchestrator finds it.
# hpcrl.launch.keepalive restarts a server that dies, in place (deployment.max_server_restarts
# times, with backoff), so one dead server does not end the job; the orchestrator loads the current
# policy into the restarted one. The task (and so the job) ends only when the restarts are used up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

index=${SLURM_PROCID:?run me under srun}
config=$(role_config inference)
redirect_to_role_log inference "$index"
exec "$HPCRL_PYTHON" -m hpcrl.launch.keepalive --config "$config" --run-dir "$HPCRL_RUN_DIR" --server-index "$index" -- \
  "$HPCRL_PYTHON" -m hpcrl.cli inference @ "$config" --run-dir "$HPCRL_RUN_DIR" --server-index "$index" \
  --server.host "${HPCRL_SERVER_HOST:-0.0.0.0}" --server.port "${HPCRL_SERVER_PORT:-0}" "$@"
