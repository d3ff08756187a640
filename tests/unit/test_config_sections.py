"""Every section of every config-taking command, given the wrong shape, is one line naming it.

Generated from the schema: for each command's root (run, submit, trainer, orchestrator, inference,
sft, eval, gepa) every section (a Struct-typed field at any depth) and every list of sections is
written as an int, a string, a list, a boolean and an inline table of the wrong shape, next to a
`seq_len` long enough that the loader derives defaults from the sections (the class of bug where a
default was derived from `trainer` before its type was checked). Each must exit 2 with one line
naming the field - never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import tomli_w

from hpcrl.cli import COMMANDS, main
from hpcrl.config import schema
from tests.unit.test_config_fuzz import _unwrap

RL_BASE: dict[str, Any] = {
    "max_steps": 2,
    "seq_len": 8192,  # > trainer.micro_batch_tokens' default: the loader derives a default from [trainer]
    "model": {"name": "hpcrl/tiny-qwen3"},
    "orchestrator": {"batch_size": 8, "rollouts_per_example": 4, "train": {"env": [{"id": "reverse-text"}]}},
}
BASES: dict[str, dict[str, Any]] = {
    "Config": RL_BASE,
    "SFTConfig": {"model": {"name": "hpcrl/tiny-qwen3"}, "seq_len": 8192, "data": {"name": "x.jsonl"}},
    "EvalRunConfig": {"model": "hpcrl/tiny-qwen3", "env": [{"id": "reverse-text"}]},
    "GepaRunConfig": {"model": "hpcrl/tiny-qwen3", "env": [{"id": "reverse-text"}]},
}
CONFIG_COMMANDS = sorted(name for name, (_, root) in COMMANDS.items() if root and name != "resume")


def _sections(t: mi.StructType, path: tuple[str, ...] = ()):
    """(path, 'section' | 'list', struct type) of every section and list of sections."""
    for f in t.fields:
        ft = _unwrap(f.type)
        if isinstance(ft, mi.StructType):
            yield path + (f.name,), "section", ft
            yield from _sections(ft, path + (f.name,))
        elif isinstance(ft, mi.ListType) and isinstance(_unwrap(ft.item_type), mi.StructType):
            yield path + (f.name,), "list", _unwrap(ft.item_type)


def _wrong_table(st: mi.StructType) -> tuple[dict[str, Any], str]:
    """An inline table of the wrong shape and the field its error must name: a sub-section given as
    a scalar where there is one, else a field of the wrong type, else an unknown key."""
    for f in st.fields:
        ft = _unwrap(f.type)
        if isinstance(ft, mi.StructType):
            return {f.name: 5}, f.name
    for f in st.fields:
        ft = _unwrap(f.type)
        if isinstance(ft, (mi.IntType, mi.FloatType)):
            return {f.name: "not-a-number"}, f.name
    return {"zzz_not_a_field": 1}, "zzz_not_a_field"


def _cases() -> list[Any]:
    cases = []
    for command in CONFIG_COMMANDS:
        root_name = COMMANDS[command][1]
        for path, kind, st in _sections(mi.type_info(getattr(schema, root_name))):
            table, inner = _wrong_table(st)
            shapes: list[tuple[str, Any, str]] = [
                ("int", 5, path[-1]),
                ("str", "abc", path[-1]),
                ("list", [1], path[-1]),
                ("bool", True, path[-1]),
            ]
            if kind == "section":
                shapes.append(("table", table, inner))
            else:
                shapes.append(("table", {"id": "x"}, path[-1]))
                shapes.append(("item-table", [table], inner))
            for label, value, names in shapes:
                if path == ("model",) and label == "str":
                    continue  # `model = "id"` is the hosted / eval shorthand: valid
                if path[-1] == "full_offload" and label == "bool":
                    continue  # prime-rl's shorthand: true = the table with its defaults, false = off
                dotted = ".".join(path)
                cases.append(
                    pytest.param(command, root_name, path, value, names, id=f"{command}:{dotted}={label}")
                )
    return cases


CASES = _cases()


def _with(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    d = msgspec.json.decode(msgspec.json.encode(base))
    cur = d
    for p in path[:-1]:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[path[-1]] = value
    return d


def test_every_command_and_section_is_covered():
    commands = {c.values[0] for c in CASES}
    assert (
        commands == set(CONFIG_COMMANDS) >= {"run", "submit", "trainer", "orchestrator", "inference", "sft"}
    )
    assert len(CASES) >= 500, len(CASES)


@pytest.mark.parametrize("command,root_name,path,value,names", CASES)
def test_wrong_section_shape_is_one_line(tmp_path: Path, capsys, command, root_name, path, value, names):
    data = _with(BASES[root_name], path, value)
    if root_name in ("Config", "SFTConfig") and path[0] != "output_dir":
        data.setdefault("output_dir", str(tmp_path / "out"))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(data))
    argv = [command, str(cfg)] + (["--dry-run"] if command in ("run", "submit", "sft") else [])
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert rc == 2, f"rc {rc}: {err}"
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert names in lines[0], lines[0]
