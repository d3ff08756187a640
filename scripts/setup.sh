#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv in .venv on a fresh machine: CPU torch first (an
# unpinned torch would pull a multi-GB CUDA build), then hpcrl with its dev + verifiers extras.
# The verifiers extra is 0.4 (verifiers.v1); the classic 0.3 API gets its own venv in CI
# (scripts/verifiers03_check.sh). An older venv with 0.3 is upgraded when pyproject.toml changes.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
. scripts/pip.sh  # pip_into: uv when it can be had, else pip
if ! python -c "import torch" 2>/dev/null; then
  pip_into .venv/bin/python "torch==${HPCRL_TORCH_VERSION:-2.13.0}"
fi
if ! python -c "import hpcrl, pytest, xdist, verifiers, openai, peft, gepa, playwright" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.hpcrl-installed ]; then
  pip_into .venv/bin/python -e '.[dev,verifiers]'
  warm_bytecode .venv/bin/python
  touch .venv/.hpcrl-installed
fi
# The dashboard's browser tests drive Debian's chromium through Playwright (its own browser download
# cannot work here): installed where we are root with apt (CI), else those tests skip and say why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && [ -z "${HPCRL_NO_CHROMIUM:-}" ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "warning: apt-get install chromium failed; the dashboard's browser tests will be skipped"
fi
python - <<'PY'
import torch
assert not torch.version.cuda or torch.cuda.is_available() or True
print(f"hpcrl venv ready: torch {torch.__version__}")
PY
