#!/usr/bin/env bash
# The test command of README.md: set up the venv, bring up the local SLURM cluster when we can
# (root + apt), and run the whole suite (slow and SLURM tests included). Extra args go to pytest.
set -euo pipefail
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
workers=${HPCRL_TEST_WORKERS:-2}
.venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadgroup "$@" || status=$?
# Seed 000's multi-node layout (2 + 2 nodes x 8 GPUs) needs a cluster of that shape: the whole run
# reshapes the fake one for its dry-run test (required to pass then), and puts it back.
if [ -z "$*" ] && [ -n "$slurm" ]; then
  # 1 TiB nodes (--mem, MB): the host-memory plan checks a trainer node's sync copies against it
  if bash scripts/slurm/up.sh --gpus 8 --cpus 16 --mem 1048576; then
    HPCRL_SEED000_CLUSTER=1 .venv/bin/python -m pytest -q tests/integration/test_seed000_dry_run.py || status=$?
  else
    echo "warning: could not reshape the local SLURM to 8 GPUs x 16 CPUs x 1 TiB; seed 000's dry run did not run"
  fi
  bash scripts/slurm/up.sh --gpus 4 || true
fi
exit "$status"
