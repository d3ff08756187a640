#!/usr/bin/env bash
# verifiers 0.4 (only `verifiers.v1`) in a venv of its own, .venv-vf04, with nothing else in it: the
# main venv's `verifiers` extra is 0.4 too, so scripts/test.sh already runs these tests; this script
# reruns the v1 and version tests alone (a quick check while working on them). Built the way
# ENVIRONMENT.md says (CPU torch first, then hpcrl editable with its dev extra, verifiers 0.4.0 and
# renderers 0.1.12). Runs the one-line refusals of an env written for the other API, env servers, the
# /inference/v1/generate route verifiers 0.4's training client calls, and a v1 env outside hpcrl
# trained through `hpcrl run` and `hpcrl eval` (tests/integration/test_vf1_train.py). Idempotent
# (a stamp); extra args go to pytest; exit code is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCRL_VF04_VENV:-.venv-vf04}
TORCH_VERSION=${HPCRL_TORCH_VERSION:-2.13.0}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
start=$(date +%s)
stamp=$(cat scripts/verifiers04_check.sh pyproject.toml | sha256sum | cut -d' ' -f1)
vpy="$VENV/bin/python"

venv_complete() {
  "$vpy" - "$TORCH_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, os, sys
assert md.version("verifiers") == "0.4.0", md.version("verifiers")
assert md.version("renderers") == "0.1.12", md.version("renderers")
assert md.version("torch").split("+")[0] == sys.argv[1], md.version("torch")
import hpcrl, pytest  # noqa: F401  (hpcrl must be this checkout, editable)
assert hpcrl.__file__.startswith(os.getcwd()), hpcrl.__file__
PY
}

if [ -x "$vpy" ] && [ "$(cat "$VENV/.hpcrl-stamp" 2>/dev/null)" = "$stamp" ] && venv_complete; then
  echo "verifiers 0.4 venv $VENV: up to date"
else
  echo "verifiers 0.4 venv $VENV: installing (CPU torch $TORCH_VERSION, verifiers 0.4.0, renderers 0.1.12)"
  [ -x "$vpy" ] || "$PY" -m venv "$VENV"
  rm -f "$VENV/.hpcrl-stamp"
  pip_() { "$vpy" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }; }
  pip_ "torch==$TORCH_VERSION"  # first: nothing below may pull a CUDA build
  pip_ -e '.[dev]' 'verifiers==0.4.0' 'renderers==0.1.12'
  venv_complete || { echo "error: $VENV is still incomplete after installing (see pip output above)" >&2; exit 1; }
  echo "$stamp" >"$VENV/.hpcrl-stamp"
fi
echo "verifiers 0.4 venv ready in $(( $(date +%s) - start )) s"
exec "$vpy" -m pytest -q -p no:cacheprovider \
  tests/integration/test_vf_versions.py tests/unit/test_env_servers_pure.py \
  tests/integration/test_env_servers.py tests/integration/test_generate_route.py \
  tests/integration/test_vf1_train.py tests/unit/test_v1_runtime.py "$@"
