#!/usr/bin/env bash
# The fault matrix of issue 40 (tests/integration/test_fault_matrix.py), and its table in
# docs/fault_matrix.md: component x fault -> time to name it, what named it and what it said,
# outcome, data check. About 8-10 minutes on 2 CPU cores (as root: tmpfs, remount and chattr cases).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}  # the project's venv (scripts/setup.sh) when there is one
table=$(mktemp)
HPCRL_FAULT_TABLE="$table" "$PY" -m pytest -q -m slow tests/integration/test_fault_matrix.py -p no:cacheprovider "$@"
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
