#!/usr/bin/env bash
# verifiers 0.3 (the classic API: load_environment() -> vf.Environment) in its own venv, .venv-vf03:
# the main venv's `verifiers` extra is 0.4 (verifiers.v1), and the two cannot share a venv. Built the
# way ENVIRONMENT.md says (CPU torch first, then hpcrl editable with its dev + verifiers03 extras);
# runs every test that needs the classic API (they skip under 0.4) plus the version refusals.
# Idempotent (a stamp); extra args go to pytest; exit code is pytest's.
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
VENV=${HPCRL_VF03_VENV:-.venv-vf03}
TORCH_VERSION=${HPCRL_TORCH_VERSION:-2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
start=$(date +%s)
stamp=$(cat scripts/verifiers03_check.sh pyproject.toml | sha256sum | cut -d' ' -f1)
vpy="$VENV/bin/python"

venv_complete() {
  "$vpy" - "$TORCH_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, os, sys
v = md.version("verifiers")
assert v.startswith("0.3."), v
assert md.version("torch").split("+")[0] == sys.argv[1], md.version("torch")
import hpcrl, pytest  # noqa: F401  (hpcrl must be this checkout, editable)
assert hpcrl.__file__.startswith(os.getcwd()), hpcrl.__file__
PY
}

if [ -x "$vpy" ] && [ "$(cat "$VENV/.hpcrl-stamp" 2>/dev/null)" = "$stamp" ] && venv_complete; then
  echo "verifiers 0.3 venv $VENV: up to date"
else
  echo "verifiers 0.3 venv $VENV: installing (CPU torch $TORCH_VERSION, hpcrl[dev,verifiers03])"
  . scripts/pip.sh
  [ -x "$vpy" ] || make_venv "$VENV"
  rm -f "$VENV/.hpcrl-stamp"
  pip_() { pip_into "$vpy" "$@"; }
  pip_ "torch==$TORCH_VERSION"  # first: nothing below may pull a CUDA build
  pip_ -e '.[dev,verifiers03]'
  venv_complete || { echo "error: $VENV is still incomplete after installing (see pip output above)" >&2; exit 1; }
  echo "$stamp" >"$VENV/.hpcrl-stamp"
fi
echo "verifiers 0.3 venv ready in $(( $(date +%s) - start )) s"
[ -z "${HPCRL_SETUP_ONLY:-}" ] || exit 0  # .ci/run builds the venv while the main suite runs
export HPCRL_CACHE="${HPCRL_CACHE:-$PWD/.cache/hpcrl}"
# The tests that need the classic API (each skips under 0.4), the version refusals, and the SLURM
# secrets tests whose env is a classic one (they skip without the local cluster scripts/test.sh starts).
exec "$vpy" -m pytest -q -p no:cacheprovider \
  tests/unit/test_envs_verifiers.py tests/unit/test_eval_summary.py tests/integration/test_vf_versions.py \
  tests/integration/test_eval_gepa.py tests/integration/test_orchestrator.py::test_verifiers_env_runs_against_our_server \
  tests/integration/test_secrets_run.py tests/integration/test_slurm_secrets.py "$@"
