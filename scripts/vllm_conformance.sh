#!/usr/bin/env bash
# vLLM conformance: import vLLM's REAL modules on CPU and check hpcrl's vLLM backend against them
# (symbols, argv parsed by vLLM's own parser, worker extension run by vLLM's own worker wrapper,
# LoRA request type). vLLM cannot serve here (it needs CUDA and pins torch 2.14), so it lives in its
# own venv, .venv-vllm, built the way ENVIRONMENT.md says: CPU torch first, vllm without its deps,
# then its pure-Python requirements (minus the CUDA ones) and hpcrl (editable, without deps) with
# the deps of hpcrl that vllm's set lacks. Idempotent: a second run only checks the stamp and runs
# the tests. Extra args go to pytest. Exit code: pytest's (non-zero on any failure).
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
VENV=${HPCRL_VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${HPCRL_VLLM_VERSION:-0.33.0}
TORCH_VERSION=${HPCRL_TORCH_VERSION:-2.13.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# vLLM picks its platform at import time; without this it looks for CUDA and degrades to "unspecified".
export VLLM_TARGET_DEVICE=cpu
start=$(date +%s)

# The stamp changes when anything that decides the venv's contents changes.
stamp=$(cat scripts/vllm_conformance.sh pyproject.toml | sha256sum | cut -d' ' -f1)
vpy="$VENV/bin/python"

venv_complete() {
  "$vpy" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1], md.version("vllm")
assert md.version("torch").split("+")[0] == sys.argv[2], md.version("torch")
import hpcrl, pytest  # noqa: F401  (hpcrl must be the editable checkout of this worktree)
assert hpcrl.__file__.startswith(__import__("os").getcwd()), hpcrl.__file__
PY
}

if [ -x "$vpy" ] && [ "$(cat "$VENV/.hpcrl-stamp" 2>/dev/null)" = "$stamp" ] && venv_complete; then
  echo "vllm conformance venv $VENV: up to date (vllm $VLLM_VERSION, torch $TORCH_VERSION)"
else
  echo "vllm conformance venv $VENV: installing (vllm $VLLM_VERSION without deps, CPU torch $TORCH_VERSION)"
  . scripts/pip.sh
  [ -x "$vpy" ] || make_venv "$VENV"
  rm -f "$VENV/.hpcrl-stamp"
  # The package mirror's find-links entries make pip warn once per package: noise, filtered out.
  # pip's closing "dependency conflicts" list (the CUDA packages left out, torch 2.13 vs 2.14) is expected.
  pip_() { pip_into "$vpy" "$@"; }
  # torch first and pinned: anything below that names torch must not pull a multi-GB CUDA build.
  pinned=$(mktemp)
  trap 'rm -f "$pinned" "${reqs:-}"' EXIT
  echo "torch==$TORCH_VERSION" >"$pinned"
  pip_ "torch==$TORCH_VERSION" packaging
  pip_ --no-deps "vllm==$VLLM_VERSION"
  pip_ --no-deps -e .
  reqs=$(mktemp)
  # vllm's own requirements minus the CUDA/GPU-only ones, plus the modules its entrypoints import
  # lazily, plus hpcrl's deps (the resolver then picks versions both accept, e.g. transformers).
  "$vpy" - >"$reqs" <<'PY'
import importlib.metadata as md
import re

from packaging.requirements import Requirement

GPU_ONLY = re.compile(r"^(torch.*|triton.*|xformers|flashinfer.*|nvidia-.*|cuda.*|numba|tilelang|tvm.*|apache-tvm.*|"
                      r"quack.*|humming.*|tokenspeed.*|pynvvideocodec|fastsafetensors|instanttensor|torchcodec)$")
RELAX = {"certifi", "requests"}  # pins the package mirror may lack: any version does for imports
EXTRAS = ["xgrammar", "llguidance", "outlines_core", "lm-format-enforcer", "compressed-tensors",
          "mistral_common[image]", "opencv-python-headless", "depyf", "pytest>=8", "pytest-timeout>=2.3"]


def wanted(spec: str) -> str | None:
    req = Requirement(spec)
    name = req.name.lower()
    if GPU_ONLY.match(name) or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        return None
    if name in RELAX:
        return req.name
    req.marker = None
    return str(req)


lines = [w for dist in ("vllm", "hpcrl") for s in md.requires(dist) or [] if (w := wanted(s))]
print("\n".join(sorted(set(lines + EXTRAS))))
PY
  echo "  $(wc -l <"$reqs") requirements (vllm's pure-Python set + extras + hpcrl's)"
  pip_ -c "$pinned" -r "$reqs"
  venv_complete || { echo "error: $VENV is still incomplete after installing (see pip output above)" >&2; exit 1; }
  echo "$stamp" >"$VENV/.hpcrl-stamp"
fi
echo "vllm conformance venv ready in $(( $(date +%s) - start )) s"
[ -z "${HPCRL_SETUP_ONLY:-}" ] || exit 0  # .ci/run builds the venv while the main suite runs
HPCRL_REQUIRE_VLLM=1 exec "$vpy" -m pytest -q -p no:cacheprovider tests/vllm_conformance "$@"
