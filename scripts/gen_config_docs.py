"""Write docs/config.md from the config schema (hpcrl.config.reference). Run after changing a field:
python scripts/gen_config_docs.py"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.config.reference import render  # noqa: E402

if __name__ == "__main__":
    (ROOT / "docs" / "config.md").write_text(render())
    print(f"wrote {ROOT / 'docs' / 'config.md'}")
