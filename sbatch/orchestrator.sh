#!/usr/bin/env bash
# The orchestrator, one task beside trainer rank 0:
#   srun --het-group=0 --nodes=1 --ntasks=1 --relative=0 --overlap sbatch/orchestrator.sh [args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

config=$(role_config orchestrator)
redirect_to_role_log orchestrator 0
exec "$HPCRL_PYTHON" -m hpcrl.cli orchestrator @ "$config" "$@"
