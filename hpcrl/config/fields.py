"""Schema introspection: find the field at a dotted path, list fields for --help.

Built on msgspec.inspect so constraints and descriptions come from the Struct definitions themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
import msgspec.inspect as mi

from hpcrl.errors import ConfigError, nearest


@dataclass(frozen=True)
class Leaf:
    """What a dotted path names: a scalar/list leaf, or a (possibly optional) section."""

    path: str
    kind: str  # "bool" | "section" | "value"
    optional_section: bool
    description: str
    type_repr: str


@cache
def _type_info(cls: type) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def _unwrap(t: mi.Type) -> tuple[mi.Type, str, bool]:
    """Strip Metadata and Optional: (inner type, description, nullable)."""
    desc = ""
    nullable = False
    while True:
        if isinstance(t, mi.Metadata):
            extra = t.extra_json_schema or {}
            desc = desc or extra.get("description", "")
            t = t.type
        elif isinstance(t, mi.UnionType):
            non_null = [u for u in t.types if not isinstance(u, mi.NoneType)]
            nullable = nullable or len(non_null) < len(t.types)
            if len(non_null) == 1:
                t = non_null[0]
            else:
                return t, desc, nullable
        else:
            return t, desc, nullable


def _struct_fields(t: mi.StructType) -> dict[str, mi.Field]:
    return {f.name: f for f in t.fields}


def type_repr(t: mi.Type) -> str:
    inner, _, nullable = _unwrap(t)
    if isinstance(inner, mi.BoolType):
        r = "bool"
    elif isinstance(inner, mi.IntType):
        r = "int"
    elif isinstance(inner, mi.FloatType):
        r = "float"
    elif isinstance(inner, mi.StrType):
        r = "str"
    elif isinstance(inner, mi.LiteralType):
        r = "|".join(map(str, inner.values))
    elif isinstance(inner, mi.ListType):
        r = f"list[{type_repr(inner.item_type)}]"
    elif isinstance(inner, mi.DictType):
        r = "table"
    elif isinstance(inner, mi.StructType):
        r = "section"
    elif isinstance(inner, mi.UnionType):
        r = " | ".join(type_repr(u) for u in inner.types)
    else:
        r = "any"
    return r + (" (optional)" if nullable and r != "section" else "")


def resolve(root: type[msgspec.Struct], parts: list[str]) -> Leaf:
    """Look up a dotted path (snake_case parts) in the schema; unknown names raise ConfigError."""
    t: mi.Type = _type_info(root)
    desc = ""
    nullable = False
    for i, part in enumerate(parts):
        inner, _, _ = _unwrap(t)
        if isinstance(inner, mi.DictType) and i == len(parts) - 1:  # one entry of a free-form table
            value = inner.value_type  # (--env-vars.NAME v, --inference.vllm.max-num-seqs 256)
            return Leaf(".".join(parts), "value", False, desc, type_repr(value))
        if not isinstance(inner, mi.StructType):
            raise ConfigError(".".join(parts[:i]), f"is a {type_repr(t)}, it has no field '{part}'")
        fields = _struct_fields(inner)
        if part not in fields:
            from hpcrl.config.sections.model import owner_hint

            where = ".".join(parts[:i]) or "top level"
            hint = owner_hint(where, part) or f"unknown field in {where}{nearest(part, fields)}"
            raise ConfigError(".".join(parts[: i + 1]), hint)
        t = fields[part].type
        _, desc, nullable = _unwrap(t)
    inner, _, _ = _unwrap(t)
    if isinstance(inner, mi.BoolType):
        kind = "bool"
    elif isinstance(inner, mi.StructType):
        kind = "section"
    else:
        kind = "value"
    return Leaf(".".join(parts), kind, nullable and kind == "section", desc, type_repr(t))


def is_section_list(root: type[msgspec.Struct], parts: list[str]) -> bool:
    """Is the field at `parts` a list of sections (`[[orchestrator.train.env]]`)?"""
    t: mi.Type = _type_info(root)
    for part in parts:
        inner, _, _ = _unwrap(t)
        f = _struct_fields(inner).get(part) if isinstance(inner, mi.StructType) else None
        if f is None:
            return False
        t = f.type
    inner, _, _ = _unwrap(t)
    return isinstance(inner, mi.ListType) and isinstance(_unwrap(inner.item_type)[0], mi.StructType)


def field_names(root: type[msgspec.Struct], parts: list[str]) -> list[str]:
    """Field names of the section at `parts` (for suggestions)."""
    t: mi.Type = _type_info(root)
    for part in parts:
        inner, _, _ = _unwrap(t)
        if not isinstance(inner, mi.StructType):
            return []
        f = _struct_fields(inner).get(part)
        if f is None:
            return []
        t = f.type
    inner, _, _ = _unwrap(t)
    if isinstance(inner, mi.ListType):  # `env[0]` in an error path: the fields of a list item
        inner, _, _ = _unwrap(inner.item_type)
    return list(_struct_fields(inner)) if isinstance(inner, mi.StructType) else []


def iter_leaves(root: type[msgspec.Struct], prefix: str = "") -> Iterator[tuple[str, str, str, Any]]:
    """(dotted path, type, description, default) for every field, depth first (for --help)."""

    def walk(t: mi.StructType, pre: str) -> Iterator[tuple[str, str, str, Any]]:
        for f in t.fields:
            path = f"{pre}{f.name}"
            inner, desc, _ = _unwrap(f.type)
            if isinstance(inner, mi.StructType):
                yield path, "section", desc, None
                yield from walk(inner, path + ".")
            else:
                default = f.default if f.default is not msgspec.NODEFAULT else None
                if f.default_factory is not msgspec.NODEFAULT:
                    default = f.default_factory()
                yield path, type_repr(f.type), desc, default

    yield from walk(_type_info(root), prefix)
