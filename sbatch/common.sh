# Sourced by sbatch/{trainer,sft,inference,orchestrator,envs}.sh: the contract every role script shares.
#
# Environment (set by the rendered hetjob script, see hpcrl/launch/hetjob.py):
#   HPCRL_RUN_DIR   (required) the run's output directory on the shared filesystem
#   HPCRL_CONFIG    (optional) this role's resolved config; default $HPCRL_RUN_DIR/configs/<role>.toml
#   HPCRL_PYTHON    (optional) python with hpcrl installed; default: python3 on PATH
#   HPCRL_BUS_HOST  (optional) address the bus doorbells bind; default "auto" (this node's route IP)
#   SLURM_*         set by srun: SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_JOB_ID, ...
# Extra arguments to a role script are passed through to `hpcrl <role>` (e.g. resume flags).
# Output goes to the run's own log files (logs/<role>.log for rank 0, logs/<role>/rank_R.log for
# the others), the files `hpcrl logs` and tmux.sh follow; srun's per-step log keeps only what is
# printed before that redirect.

: "${HPCRL_RUN_DIR:?HPCRL_RUN_DIR must name the run directory}"
HPCRL_PYTHON=${HPCRL_PYTHON:-python3}
export HPCRL_BUS_HOST=${HPCRL_BUS_HOST:-auto}
export PYTHONUNBUFFERED=1

export_rank_env() {  # the torchrun-style variables of this srun task (trainer and SFT ranks)
  export RANK=${SLURM_PROCID:?run me under srun}
  export WORLD_SIZE=${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}
  export LOCAL_RANK=${SLURM_LOCALID:-0}
  local tasks_per_node=${SLURM_STEP_TASKS_PER_NODE:-1}
  export LOCAL_WORLD_SIZE=${tasks_per_node%%[(,]*}  # "2(x3)" or "2,1" -> 2
}

role_config() {  # role_config ROLE -> the config file that role reads
  echo "${HPCRL_CONFIG:-$HPCRL_RUN_DIR/configs/$1.toml}"
}

redirect_to_role_log() {  # redirect_to_role_log ROLE RANK: append stdout+stderr to the run's log
  local log
  if [[ $2 -eq 0 ]]; then
    log=$HPCRL_RUN_DIR/logs/$1.log
  else
    log=$HPCRL_RUN_DIR/logs/$1/rank_$2.log
  fi
  mkdir -p "$(dirname "$log")"
  echo "[sbatch/$1.sh] rank $2 on ${SLURMD_NODENAME:-$(hostname -s)} (job ${SLURM_JOB_ID:-?}) -> $log"
  exec >>"$log" 2>&1
}
