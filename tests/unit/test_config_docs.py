"""docs/config.md is generated from the schema (scripts/gen_config_docs.py) and stays so."""

from __future__ import annotations

from pathlib import Path

from hpcrl.config.reference import render

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_matches_the_schema():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == render(), "docs/config.md is out of date: run `python scripts/gen_config_docs.py`"


def test_config_reference_has_every_field_with_its_default():
    page = render()
    for row in (
        "| `orchestrator.batch_size` | int | `128` |",
        '| `data.batch_unit` | samples\\|tokens | `"samples"` |',
        "| `[[orchestrator.train.env]]` | array of tables | `[]` |",
        "| `orchestrator.train.env.id` | str | `required` |",
        "| `[ckpt]` | section | `unset (off)` |",
    ):
        assert row in page, row
