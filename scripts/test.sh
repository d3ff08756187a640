#!/usr/bin/env bash
# The test command of README.md: set up the venv, bring up the local SLURM cluster when we can
# (root + apt), and run the whole suite (slow and SLURM tests included). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$(id -u)" = 0 ] && [ -x scripts/slurm/up.sh ] && [ -z "${HPCRL_NO_SLURM:-}" ]; then
  bash scripts/slurm/up.sh --gpus 4 || echo "warning: local SLURM bring-up failed; SLURM tests will be skipped"
fi
# Style gate: formatting and lint (cheap, and a failure says exactly what to run).
.venv/bin/ruff format --check hpcrl tests scripts
.venv/bin/ruff check hpcrl tests scripts
export HPCRL_CACHE="${HPCRL_CACHE:-$PWD/.cache/hpcrl}"
exec .venv/bin/python -m pytest -q "$@"
