#!/usr/bin/env bash
# One SFT rank on a SLURM node: `srun --het-group=0 sbatch/sft.sh [hpcrl sft args]` (hpcrl submit of
# an SFT config, hpcrl/launch/sft_submit.py). One srun task = one torch.distributed rank over every
# node of the job. The output directory was prepared at submission (HPCRL_SFT_CHILD: ranks do not
# prepare it again). A requeued job resumes from the newest complete checkpoint when there is one.
# `exec`: the Python process receives the pre-timeout USR2 (it checkpoints and exits 0; the batch
# script then requeues the job).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export RANK=${SLURM_PROCID:?run me under srun}
export WORLD_SIZE=${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}
export LOCAL_RANK=${SLURM_LOCALID:-0}
tasks_per_node=${SLURM_STEP_TASKS_PER_NODE:-1}
export LOCAL_WORLD_SIZE=${tasks_per_node%%[(,]*}  # "2(x3)" or "2,1" -> 2
export HPCRL_SFT_CHILD=1
resume=()
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]] && compgen -G "$HPCRL_RUN_DIR/checkpoints/step_*/COMPLETE" >/dev/null; then
  resume=(--ckpt.resume-step -1)
fi
config=$(role_config sft)
redirect_to_role_log sft "$RANK"
exec "$HPCRL_PYTHON" -m hpcrl.cli sft @ "$config" "${resume[@]}" "$@"
