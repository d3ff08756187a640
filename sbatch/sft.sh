#!/usr/bin/env bash
# One SFT rank on a SLURM node: `srun --het-group=0 sbatch/sft.sh [hpcrl sft args]` (hpcrl submit of
# an SFT config, hpcrl/launch/sft_submit.py). One srun task = one torch.distributed rank over every
# node of the job. The output directory was prepared at submission (HPCRL_SFT_CHILD: ranks do not
# prepare it again). A requeued job resumes from the newest complete checkpoint when there is one.
# `exec`: the Python process receives the pre-timeout USR2 (it checkpoints and exits 0; the batch
# script then requeues the job).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export_rank_env
export HPCRL_SFT_CHILD=1
resume=()
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]] && compgen -G "$HPCRL_RUN_DIR/checkpoints/step_*/COMPLETE" >/dev/null; then
  resume=(--ckpt.resume-step -1)
fi
config=$(role_config sft)
redirect_to_role_log sft "$RANK"
exec "$HPCRL_PYTHON" -m hpcrl.cli sft @ "$config" "${resume[@]}" "$@"
