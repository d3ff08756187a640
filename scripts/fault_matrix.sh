#!/usr/bin/env bash
# The fault matrix of issues 40 and 52 (tests/integration/test_fault_matrix.py and the fault tests
# beside it), and its table in docs/fault_matrix.md: component x fault -> time to name it, what named
# it and what it said, outcome, data check. About 12-15 minutes on 2 CPU cores (as root: tmpfs,
# bind mount, remount, chattr and quota cases; the quota and the logs' read-only cases need gcc for
# the LD_PRELOAD shim: tests/integration/quota.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}  # the project's venv (scripts/setup.sh) when there is one
table=$(mktemp)
# The shared RL run and its resumes first, then the fault tests beside it that add rows of their own:
# SFT (storage, kill -9 + bitwise resume, freezes), two trainer ranks, a LoRA adapter's files.
lora=tests/unit/test_refused_writes_roles.py
HPCRL_FAULT_TABLE="$table" "$PY" -m pytest -q -p no:cacheprovider \
  tests/integration/test_fault_matrix.py tests/integration/test_sft_storage.py \
  tests/integration/test_sft_faults.py tests/integration/test_refused_writes_ranks.py \
  "$lora::test_a_lora_adapter_publish_waits_out_an_unwritable_broadcasts_dir" \
  "$lora::test_a_lora_adapter_refused_mid_file_is_never_left_as_complete" \
  "$lora::test_the_checkpointers_lora_adapter_waits_out_an_unwritable_dir" "$@"
"$PY" - "$table" <<'PY'
import re, sys
from pathlib import Path
doc = Path("docs/fault_matrix.md")
text = doc.read_text()
table = Path(sys.argv[1]).read_text()
start, end = "<!-- table -->\n", "<!-- /table -->\n"
doc.write_text(text[: text.index(start) + len(start)] + table + text[text.index(end):])
PY
echo "docs/fault_matrix.md updated"
