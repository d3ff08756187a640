#!/usr/bin/env bash
# One installer for every venv the scripts build (sourced, not run):
#   . scripts/pip.sh; make_venv VENV; pip_into VENV/bin/python ARGS...   # ARGS as for `pip install`
# uv (installed from PyPI into the main venv, .venv) resolves, downloads and unpacks in parallel: the
# main venv's install took 170 s with pip and 12 s with uv on this 2-core machine (plus the .pyc). It reads none of
# pip's configuration, so the machine's pip find-links and constraint files are handed to it. Falls
# back to pip when uv cannot be had (HPCRL_NO_UV=1 forces pip). Both drop the package mirror's
# one-warning-per-package noise.

_hpcrl_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# uv from the main venv, installed there on first use; empty when it cannot be had.
hpcrl_uv() {
  [ -z "${HPCRL_NO_UV:-}" ] || return 0
  local uv="$_hpcrl_root/.venv/bin/uv"
  if [ ! -x "$uv" ] && [ -x "$_hpcrl_root/.venv/bin/python" ]; then
    "$_hpcrl_root/.venv/bin/python" -m pip install -q uv 2>&1 | { grep -v "^WARNING: Location 'file://" || true; } >&2
  fi
  [ -x "$uv" ] && echo "$uv"
  return 0
}

# A new venv at $1 (uv's takes 0.1 s; `python -m venv` 5-12 s, most of it installing pip).
make_venv() {
  local uv
  uv=$(hpcrl_uv)
  if [ -n "$uv" ]; then
    "$uv" venv -q --python "${PYTHON:-python3}" "$1"
  else
    "${PYTHON:-python3}" -m venv "$1"
  fi
}

# pip's find-links and constraint settings (config files and PIP_* variables), as uv arguments.
_pip_settings_for_uv() {
  local py=$_hpcrl_root/.venv/bin/python  # pip's settings are the machine's, any venv reads them
  "$py" -m pip config list 2>/dev/null | "$py" -c '
import os, shlex, sys
out = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    option = key.rsplit(".", 1)[-1]
    if option not in ("find-links", "constraint"):
        continue
    for v in shlex.split(value.strip("\x27\"")):
        if os.path.exists(v):
            out += ["--" + option, v]
print(" ".join(shlex.quote(a) for a in out))'
}

pip_into() {
  local py=$1
  shift
  local uv
  uv=$(hpcrl_uv)
  if [ -n "$uv" ]; then
    local settings
    settings=$(_pip_settings_for_uv)
    # No .pyc at install time: compiling every installed module (anthropic, openai, pandas, all of
    # transformers' 2,600 model files...) cost 40-60 CPU-s per venv, and a run imports a small part of
    # it. Python writes the .pyc of what is imported, once, where PYTHONDONTWRITEBYTECODE is unset:
    # the scripts unset it (warm_bytecode below; scripts/test.sh).
    eval "\"\$uv\" pip install -q --python \"\$py\" $settings \"\$@\""
  else
    "$py" -m pip --version >/dev/null 2>&1 || "$py" -m ensurepip >/dev/null  # a venv uv made has no pip
    "$py" -m pip install -q --no-compile "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  fi
}

# The .pyc of every module that hpcrl's own modules import, and of the lazily imported heavy ones its
# processes need (the model code of the inference engine, the trainer's distributed stack): where
# PYTHONDONTWRITEBYTECODE=1 a process writes none, and without a .pyc it compiles torch from source.
warm_bytecode() {
  env -u PYTHONDONTWRITEBYTECODE "$1" - <<'PY'
import importlib, pkgutil, warnings

import hpcrl

warnings.simplefilter("ignore")
names = [m.name for m in pkgutil.walk_packages(hpcrl.__path__, "hpcrl.") if not m.name.endswith(".__main__")]
names += ["torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.optim",
          "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
          "safetensors.torch", "matplotlib.figure", "matplotlib.backends.backend_agg", "renderers",
          "openai", "uvicorn", "httpx", "zmq"]
for name in names:
    try:
        importlib.import_module(name)
    except Exception:  # an optional backend's module (vLLM...) whose extra is not installed
        pass
PY
}
