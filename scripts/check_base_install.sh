#!/usr/bin/env bash
# Packaging check: the base package alone (no extras) in a fresh venv must run every subcommand's
# --help and the demo dry runs. Catches a dependency only an extra happens to pull in (tomli_w was one).
#   bash scripts/check_base_install.sh          # ~1-2 min; leaves nothing behind
set -euo pipefail
# Python writes the .pyc of what it imports (PYTHONDONTWRITEBYTECODE=1 on some machines): venvs are
# installed without them (scripts/pip.sh).
unset PYTHONDONTWRITEBYTECODE
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
. "$REPO/scripts/pip.sh"  # make_venv, pip_into: uv when it can be had, else pip
make_venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# CPU torch first: an unpinned torch would pull a multi-GB CUDA build (ENVIRONMENT.md).
pip_into "$VPY" "torch==${HPCRL_TORCH_VERSION:-2.13.0}"
# A copy of the source, installed non-editable: only what the wheel really ships is importable.
mkdir "$WORK/src"
# Only the source: the venvs (.venv-vllm is 3.5 GB), caches and outputs stay behind.
tar -C "$REPO" --exclude='./.venv*' --exclude=./.cache --exclude=./outputs --exclude=./.git -cf - . | tar -C "$WORK/src" -xf -
pip_into "$VPY" "$WORK/src"
cd "$WORK"  # not the repo: `import hpcrl` must find the installed package
HPCRL="$WORK/venv/bin/hpcrl"
"$VPY" -c "import hpcrl, sys; assert '$WORK/venv' in hpcrl.__file__, hpcrl.__file__"
"$HPCRL" --help >/dev/null
for cmd in run submit resume sft inference trainer orchestrator status logs cancel plot make-tiny-model \
           prepare-resume; do
  "$HPCRL" "$cmd" --help >/dev/null || { echo "check_base_install: '$cmd --help' failed" >&2; exit 1; }
done
export HPCRL_CACHE="$WORK/cache"
"$HPCRL" run "$REPO/configs/demo/rl.toml" --dry-run --output-dir "$WORK/out/rl" >/dev/null
"$HPCRL" sft "$REPO/configs/demo/sft.toml" --dry-run --output-dir "$WORK/out/sft" >/dev/null
"$HPCRL" run "$REPO/configs/hosted/hosted_reference.toml" --dry-run --output-dir "$WORK/out/hosted" >/dev/null
# `submit --dry-run` would ask a real sbatch where one exists; the SLURM path's imports are checked instead.
"$VPY" -c "import hpcrl.launch.submit, hpcrl.launch.slurm, hpcrl.launch.hetjob, submitit"
echo "check_base_install: OK (base package alone: every --help and the dry runs)"
