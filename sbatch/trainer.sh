#!/usr/bin/env bash
# One trainer rank on a SLURM node: `srun --het-group=0 sbatch/trainer.sh [hpcrl trainer args]`.
# One srun task = one torch.distributed rank; the ranks of the trainer step form the world.
# MASTER_ADDR / MASTER_PORT: left to hpcrl.trainer.parallel.dist_env (first host of the step's
# node list, port 20000 + job id % 10000) unless the caller exports them.
# The pre-timeout USR2 arrives here from the batch script via srun; `exec` makes the Python process
# the one that receives it (it checkpoints and exits 0; the batch script then requeues the job).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export_rank_env
config=$(role_config trainer)
redirect_to_role_log trainer "$RANK"
exec "$HPCRL_PYTHON" -m hpcrl.cli trainer @ "$config" "$@"
