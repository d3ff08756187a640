"""docs/config.md: every config field of every command root, its type, default and meaning, made from
the schema (the Structs' docstrings are the meanings). `python scripts/gen_config_docs.py` writes it;
tests/unit/test_config_docs.py fails when the checked-in page and the schema drift apart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi

from hpcrl.config import fields

# (command, root Struct name, what the root configures)
ROOTS = (
    ("hpcrl run / submit / resume / trainer / orchestrator / inference", "Config", "RL runs"),
    ("hpcrl sft", "SFTConfig", "supervised fine-tuning"),
    ("hpcrl eval", "EvalRunConfig", "evaluation of a model on environments"),
    ("hpcrl gepa", "GepaRunConfig", "GEPA prompt optimisation"),
)

HEADER = """# Config reference

Every field of every command's config: its TOML path (a flag is the same path with dashes,
`--orchestrator.batch-size 64`), type, default and meaning. Generated from the schema
(`hpcrl/config/sections/`) by `python scripts/gen_config_docs.py`; do not edit by hand: a test fails
when this page and the schema differ. `hpcrl <command> --help` prints the same fields.
Sections marked `[[...]]` are arrays of tables. Other spellings accepted for some of these fields
(prime-rl's names, the hosted and self-hosted shapes) are listed in docs/observability.md and
tests/seed_names.toml.
"""


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, msgspec.Struct):
        return "-"
    return json.dumps(msgspec.to_builtins(value)) if not isinstance(value, str) else f'"{value}"'


def _rows(t: mi.StructType, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    for f in t.fields:
        path = f"{prefix}{f.name}"
        inner, desc, _ = fields._unwrap(f.type)
        if isinstance(inner, mi.StructType):
            off = not f.required and f.default is None  # an optional section: absent unless given
            yield f"[{path}]", "section", "unset (off)" if off else "-", desc
            yield from _rows(inner, path + ".")
            continue
        item = fields._unwrap(inner.item_type)[0] if isinstance(inner, mi.ListType) else None
        if isinstance(item, mi.StructType):
            yield f"[[{path}]]", "array of tables", "[]", desc
            yield from _rows(item, path + ".")
            continue
        default: Any = None if f.required else f.default
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        shown = "required" if f.required else _default(default)
        yield path, fields.type_repr(f.type), shown, desc


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from hpcrl.config import schema

    out = [HEADER]
    for command, root, what in ROOTS:
        out.append(f"\n## `{command}` ({what}: `{root}`)\n")
        out.append("| field | type | default | meaning |\n| --- | --- | --- | --- |")
        info = mi.type_info(getattr(schema, root))
        assert isinstance(info, mi.StructType)
        for path, typ, default, desc in _rows(info, ""):
            out.append(f"| `{path}` | {_cell(typ)} | `{_cell(default)}` | {_cell(desc)} |")
    out.extend(_prime_names())
    return "\n".join(out) + "\n"


def _prime_names() -> list[str]:
    """prime-rl's names (docs/prime-rl.md): field aliases, then the tables translated on load."""
    from hpcrl.config.loader import _ALIASES
    from hpcrl.config.prime_names import SECTION_ALIASES
    from hpcrl.config.prime_shapes import TABLES

    out = [
        "\n## prime-rl's names\n",
        "Accepted as written in prime-rl's configs (docs/prime-rl.md): each is the hpcrl field or table "
        "on its right, one implementation.\n",
        "| prime-rl | here |\n| --- | --- |",
    ]
    rows = [(".".join(a), ".".join(f)) for a, f in _ALIASES]
    rows += [(f"[{'.'.join(a)}]", f"[{'.'.join(c)}]") for a, c in SECTION_ALIASES]
    rows += list(TABLES)
    out += [f"| `{_cell(a)}` | {_cell(b)} |" for a, b in rows]
    return out
