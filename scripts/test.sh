#!/usr/bin/env bash
# The test command of README.md: set up the venv, bring up the local SLURM cluster when we can
# (root + apt), and run the whole suite (slow and SLURM tests included). Extra args go to pytest.
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
bash scripts/setup.sh
slurm=""
if [ "$(id -u)" = 0 ] && [ -x scripts/slurm/up.sh ] && [ -z "${HPCRL_NO_SLURM:-}" ]; then
  if bash scripts/slurm/up.sh --gpus 4; then slurm=1; else
    echo "warning: local SLURM bring-up failed; SLURM tests will be skipped"; fi
fi
# Style gate: formatting and lint (cheap, and a failure says exactly what to run).
.venv/bin/ruff format --check hpcrl tests scripts
.venv/bin/ruff check hpcrl tests scripts
export HPCRL_CACHE="${HPCRL_CACHE:-$PWD/.cache/hpcrl}"
status=0
# Two workers (pytest-xdist): most integration tests wait on the processes they start, so two
# share the 2 cores well; tests that submit to the local SLURM run on one worker, in turn
# (tests/conftest.py). HPCRL_TEST_WORKERS=0 runs them in this process. The 25 slowest tests close
# every run's output: where the suite's time goes.
# The whole suite (no args) runs the tests that mostly wait - SLURM scheduling and requeues, freezes
# past their bounds, timeouts (marker `waits`) - in a lane of their own beside the two workers: on
# the workers, two of them at once left the cores idle for minutes.
workers=${HPCRL_TEST_WORKERS:-2}
lane="slurm or waits"
if [ -z "$*" ] && [ "$workers" != 0 ]; then
  lane_log=$(mktemp)
  .venv/bin/python -m pytest -q --durations=10 -m "$lane" >"$lane_log" 2>&1 &
  lane_pid=$!
  .venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadgroup -m "not ($lane)" || status=$?
  lane_status=0
  wait "$lane_pid" || lane_status=$?
  echo "--- the waiting lane (-m \"$lane\"), exit $lane_status:"
  cat "$lane_log"
  rm -f "$lane_log"
  [ "$lane_status" = 0 ] || status=$lane_status
else
  .venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadgroup "$@" || status=$?
fi
# Seed 000's multi-node layout (2 + 2 nodes x 8 GPUs) needs a cluster of that shape: the whole run
# reshapes the fake one for its dry-run test (required to pass then), and puts it back.
# It holds the cluster's test lock meanwhile (tests/integration/test_slurm_cluster.py: .ci/run runs
# verifiers 0.3's SLURM test beside the suite, from another venv).
seed000() {
  # 1 TiB nodes (--mem, MB): the host-memory plan checks a trainer node's sync copies against it
  if bash scripts/slurm/up.sh --gpus 8 --cpus 16 --mem 1048576; then
    HPCRL_SLURM_LOCK_HELD=1 HPCRL_SEED000_CLUSTER=1 .venv/bin/python -m pytest -q \
      tests/integration/test_seed000_dry_run.py || return $?
  else
    echo "warning: could not reshape the local SLURM to 8 GPUs x 16 CPUs x 1 TiB; seed 000's dry run did not run"
  fi
}
if [ -z "$*" ] && [ -n "$slurm" ]; then
  exec {lock}>>"${TMPDIR:-/tmp}/hpcrl-slurm-tests.lock"
  flock "$lock"
  seed000 || status=$?
  bash scripts/slurm/up.sh --gpus 4 || true
  flock -u "$lock"
fi
exit "$status"
