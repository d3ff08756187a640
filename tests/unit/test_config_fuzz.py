"""Table-driven config abuse, generated from the schema itself (not enumerated by hand).

For every field of every section (msgspec.inspect walk of Config and SFTConfig) we inject values of
the wrong type, non-finite floats and out-of-range numbers; for every section wrong shapes; for the
hosted shape every hosted key gets wrong shapes too. Each case goes through `hpcrl.cli.main`, the
same entry as the command line, and must end with exit 2 and one line naming the field - never a
traceback, never acceptance. A handful also run through the real CLI subprocess.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import tomli_w

from hpcrl.cli import main
from hpcrl.config import schema
from hpcrl.config.dicts import deep_merge

NAN, INF = float("nan"), float("inf")
DATE = datetime.date(1979, 5, 27)

BASE: dict[str, Any] = {
    "max_steps": 5,
    "seq_len": 128,
    "model": {"name": "hpcrl/tiny-qwen3"},
    "orchestrator": {
        "batch_size": 16,
        "rollouts_per_example": 4,
        "train": {"sampling": {"max_tokens": 16}, "env": [{"id": "reverse-text"}]},
        "eval": {"env": [{"id": "reverse-text"}]},
    },
}
SFT_BASE: dict[str, Any] = {"model": {"name": "hpcrl/tiny-qwen3"}, "data": {"name": "x.jsonl"}}
# Required fields of optional sections, so a section created by an injection is otherwise valid.
REQUIRED = {
    "orchestrator.teacher": {"base_url": "http://127.0.0.1:1"},
    "orchestrator.algo.teacher": {"base_url": "http://127.0.0.1:1"},
    "orchestrator.algo.filter": {"import_path": "m.f"},
    "algo.filter": {"import_path": "m.f"},  # an env's own algo (orchestrator.train.env[0].algo.filter ...)
}
HOSTED: dict[str, Any] = {
    "model": "Qwen/Qwen3-4B",
    "max_steps": 10,
    "batch_size": 16,
    "rollouts_per_example": 4,
    "sampling": {"max_tokens": 64},
    "env": [{"id": "reverse-text"}],
}


def _unwrap(t: mi.Type) -> mi.Type:
    while True:
        if isinstance(t, mi.Metadata):
            t = t.type
        elif isinstance(t, mi.UnionType) and len([u for u in t.types if not isinstance(u, mi.NoneType)]) == 1:
            t = next(u for u in t.types if not isinstance(u, mi.NoneType))
        else:
            return t


def _bad_values(t: mi.Type) -> list[tuple[str, Any]]:
    """Values a field of type `t` must refuse (label, value)."""
    wrong_shapes = [("list", [1, 2]), ("table", {"x": 1}), ("date", DATE)]
    if isinstance(t, mi.BoolType):
        return [("str", "maybe"), ("float", 0.5)] + wrong_shapes
    if isinstance(t, (mi.IntType, mi.FloatType)):
        out: list[tuple[str, Any]] = [("str", "abc"), ("bool-str", "yes")] + wrong_shapes
        if isinstance(t, mi.FloatType):
            out += [("nan", NAN), ("inf", INF), ("-inf", -INF)]
        else:
            out += [("fraction", 1.5), ("nan", NAN), ("inf", INF)]
        for bound, delta in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
            limit = getattr(t, bound, None)
            if limit is not None:
                out.append((f"not-{bound}", limit + delta if delta else limit))
        return out
    if isinstance(t, mi.StrType):
        return [("int", 5), ("float", 1.5)] + wrong_shapes
    if isinstance(t, mi.LiteralType):
        return [("choice", "not-a-choice"), ("int", 7), ("list", ["a"])]
    if isinstance(t, mi.ListType):
        item = _unwrap(t.item_type)
        items = (
            [("item", [v]) for _, v in _bad_values(item)[:4]] if not isinstance(item, mi.StructType) else []
        )
        return [("scalar", 5), ("str", "abc"), ("table", {"x": 1})] + items
    if isinstance(t, mi.DictType):
        return [("scalar", 5), ("str", "abc"), ("list", [1]), ("nan-value", {"x": NAN})]
    if isinstance(t, mi.StructType):
        return [("scalar", 5), ("str", "abc"), ("list", ["a"]), ("date", DATE), ("nan", NAN)]
    return []


def _walk(t: mi.StructType, path: list[str | int]):
    """(path parts, field type) for every field; list-of-struct fields recurse into item 0."""
    for f in t.fields:
        ft = _unwrap(f.type)
        yield path + [f.name], ft
        if isinstance(ft, mi.StructType):
            yield from _walk(ft, path + [f.name])
        elif isinstance(ft, mi.ListType) and isinstance(_unwrap(ft.item_type), mi.StructType):
            yield from _walk(_unwrap(ft.item_type), path + [f.name, 0])


def _inject(base: dict[str, Any], parts: list[str | int], value: Any) -> dict[str, Any]:
    d = msgspec.json.decode(msgspec.json.encode(base))  # deep copy (no NaN/dates in bases)
    cur: Any = d
    for i, p in enumerate(parts[:-1]):
        nxt_is_index = isinstance(parts[i + 1], int)
        if isinstance(p, int):
            while len(cur) <= p:
                cur.append({"id": "reverse-text"})
            cur = cur[p]
            continue
        if p not in cur or not isinstance(cur[p], (dict, list)):
            cur[p] = [] if nxt_is_index else {}
            dotted = ".".join(str(x) for x in parts[: i + 1])
            tail = ".".join(str(x) for x in parts[max(0, i - 1) : i + 1])
            if isinstance(cur[p], dict):
                cur[p].update(REQUIRED.get(dotted) or REQUIRED.get(tail) or {})
        cur = cur[p]
    if isinstance(parts[-1], int):
        cur.append(value)
    else:
        cur[parts[-1]] = value
    return d


def _dotted(parts: list[str | int]) -> str:
    return ".".join(str(p) for p in parts).replace(".0", "[0]")


def _schema_cases(root: type, base: dict[str, Any], command: str) -> list[Any]:
    cases = []
    for parts, t in _walk(mi.type_info(root), []):
        if parts[-1] in ("args",) and isinstance(t, mi.DictType):
            bads = [("scalar", 5), ("list", [1]), ("nan-value", {"x": NAN})]
        else:
            bads = _bad_values(t)
        for label, value in bads:
            if root is schema.Config and parts == ["model"] and label == "str":
                continue  # `model = "id"` is the hosted shorthand: valid
            dotted = _dotted(parts)
            cases.append(
                pytest.param(
                    command, _inject(base, parts, value), [], str(parts[-1]), id=f"{command}:{dotted}={label}"
                )
            )
    return cases


def _flag_cases() -> list[Any]:
    """The same injections as dotted flags (TOML literals on the command line)."""
    cases = []
    for parts, t in _walk(mi.type_info(schema.Config), []):
        if any(isinstance(p, int) for p in parts) or isinstance(t, (mi.StructType, mi.DictType)):
            continue
        flag = "--" + ".".join(str(p) for p in parts).replace("_", "-")
        literals = {
            "nan": "nan",
            "inf": "inf",
            "-inf": "-inf",
            "list": "[1, 2]",
            "table": "{x = 1}",
            "fraction": "1.5",
            "choice": "not-a-choice",
        }
        for label, _ in _bad_values(t):
            if isinstance(t, mi.BoolType):
                break  # a bare --flag means true; a following '[1, 2]' is a stray argument, not its value
            if label in literals and not (isinstance(t, (mi.StrType,)) and label in ("list", "table")):
                cases.append(
                    pytest.param(
                        "run", BASE, [flag, literals[label]], str(parts[-1]), id=f"flag:{flag}={label}"
                    )
                )
    return cases


def _hosted_cases() -> list[Any]:
    cases = []
    shapes = [
        ("int", 5),
        ("str", "abc"),
        ("list", ["a"]),
        ("date", DATE),
        ("nan", NAN),
        ("inf", INF),
        ("table", {"zzz": 1}),
    ]
    keys = [
        "model",
        "max_steps",
        "batch_size",
        "rollouts_per_example",
        "sampling",
        "env",
        "eval",
        "val",
        "buffer",
        "checkpoints",
        "adapters",
        "wandb",
        "learning_rate",
        "lora_alpha",
        "oversampling_factor",
        "max_async_level",
        "trajectory_strategy",
        "env_file",
        "checkpoint_id",
        "trainer",
        "orchestrator",
        "inference",
        "max_off_policy_steps",
    ]
    valid = {
        "model": ("str",),
        "env_file": ("str", "list"),
        "checkpoint_id": ("str",),
        "max_steps": ("int",),
        "batch_size": ("int",),
        "rollouts_per_example": ("int",),
        "learning_rate": ("int",),
        "lora_alpha": ("int",),
        "oversampling_factor": ("int",),
        "max_async_level": ("int",),
        "max_off_policy_steps": ("int",),
    }
    for key in keys:
        for label, value in shapes:
            if label in valid.get(key, ()):
                continue
            d = dict(HOSTED)
            d[key] = value
            cases.append(pytest.param("run", d, [], key, id=f"hosted:{key}={label}"))
    for sec, field in (
        ("sampling", "temperature"),
        ("buffer", "easy_threshold"),
        ("eval", "interval"),
        ("checkpoints", "interval"),
        ("env", "ratio"),
    ):
        for label, value in shapes:
            if label == "int" and field != "interval":
                continue  # 5 is a valid float
            if label == "int":
                value = -5
            d = msgspec.json.decode(msgspec.json.encode(HOSTED))
            if sec == "env":
                d["env"][0][field] = value
            else:
                d.setdefault(sec, {})[field] = value
            cases.append(pytest.param("run", d, [], field, id=f"hosted:{sec}.{field}={label}"))
    return cases


def _nesting_cases() -> list[Any]:
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    deep_table: Any = {"v": 1}
    for _ in range(200):
        deep_table = {"a": deep_table}
    return [
        pytest.param(
            "run",
            deep_merge(BASE, {"orchestrator": {"train": {"env": [{"id": "x", "args": {"a": deep}}]}}}),
            [],
            "nested",
            id="nest:env-args-list",
        ),
        pytest.param(
            "run",
            deep_merge(BASE, {"orchestrator": {"train": {"env": [{"id": "x", "args": deep_table}]}}}),
            [],
            "nested",
            id="nest:env-args-table",
        ),
        pytest.param(
            "run", BASE, ["--trainer.optim.betas", "[" * 3000 + "]" * 3000], "nested", id="nest:flag"
        ),
        pytest.param("run", BASE, ["--max-steps", "[" * 3000 + "]" * 3000], "nested", id="nest:flag-scalar"),
    ]


def _output_dir_cases(tmp: Path) -> list[tuple[str, str]]:
    a_file = tmp / "plain-file"
    return [
        ("/proc/hpcrl-run", "/proc"),
        ("/proc/self/fd/run", "/proc"),
        ("/sys/kernel/run", "/sys"),
        (str(a_file / "run"), "is a file"),
        (str(tmp / "a\x00b"), "NUL"),
        (str(tmp / ("x" * 300)), "300 bytes"),
        (str(a_file), "not a directory"),
        ("", "empty"),
    ]


CASES = (
    _schema_cases(schema.Config, BASE, "run")
    + _schema_cases(schema.SFTConfig, SFT_BASE, "sft")
    + _flag_cases()
    + _hosted_cases()
    + _nesting_cases()
)


def _run(
    tmp_path: Path, command: str, data: dict[str, Any], flags: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    cfg = tmp_path / "cfg.toml"
    data = dict(data)
    data.setdefault("output_dir", str(tmp_path / "out"))
    cfg.write_text(tomli_w.dumps(data))
    rc = main([command, str(cfg), "--dry-run", *flags])
    return rc, capsys.readouterr().err


def test_case_count():
    assert len(CASES) >= 600, len(CASES)


@pytest.mark.parametrize("command,data,flags,field", CASES)
def test_bad_config_is_one_line(tmp_path, capsys, command, data, flags, field):
    try:
        text = tomli_w.dumps(data)
    except (TypeError, ValueError):  # pragma: no cover - every generated value is TOML-expressible
        pytest.fail("generator produced a value TOML cannot hold")
    del text
    rc, err = _run(tmp_path, command, data, flags, capsys)
    lines = err.strip().splitlines()
    assert rc == 2, f"accepted (rc {rc}): {err}"
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert field in lines[0], lines[0]


@pytest.mark.parametrize("index", range(8))
def test_bad_output_dir(tmp_path, capsys, index):
    (tmp_path / "plain-file").write_text("x")
    raw, fragment = _output_dir_cases(tmp_path)[index]
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(BASE))
    rc = main(["run", str(cfg), "--dry-run", "--output-dir", raw])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "output_dir" in err and fragment in err, err


def test_deep_toml_file(tmp_path, capsys):
    cfg = tmp_path / "deep.toml"
    cfg.write_text(tomli_w.dumps(BASE) + "x = " + "[" * 5000 + "]" * 5000 + "\n")
    inline = tmp_path / "inline.toml"
    inline.write_text("x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n")
    for f in (cfg, inline):
        for argv in (
            ["run", str(f), "--dry-run"],
            ["run", "@", str(f), "--dry-run"],
            ["run", str(cfg.with_name("x.toml")), "--trainer", "@", str(f)],
        ):
            if argv[1].endswith("x.toml"):
                argv[1] = str(tmp_path / "base.toml")
                Path(argv[1]).write_text(tomli_w.dumps(BASE))
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "nested" in err, err


def test_finite_valid_values_still_load(tmp_path, capsys):
    """The finite-float walk refuses only non-finite values: large finite ones load."""
    data = deep_merge(
        BASE,
        {
            "trainer": {"optim": {"lr": 1e300}},
            "orchestrator": {"train": {"sampling": {"temperature": 1e10}, "env": [{"id": "reverse-text"}]}},
        },
    )
    rc, err = _run(tmp_path, "run", data, [], capsys)
    assert rc == 0, err


SUBPROCESS_CASES = [
    ("nan-lr", ["--trainer.optim.lr", "nan"], "trainer.optim.lr"),
    ("inf-temp", ["--orchestrator.train.sampling.temperature", "inf"], "temperature"),
    ("proc-dir", ["--output-dir", "/proc/x"], "output_dir"),
    ("deep-flag", ["--trainer.optim.betas", "[" * 3000 + "]" * 3000], "betas"),
    ("hosted-scalar", None, "eval"),
]


@pytest.mark.parametrize("name,flags,field", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_real_cli(tmp_path, name, flags, field):
    cfg = tmp_path / "cfg.toml"
    if flags is None:
        cfg.write_text(tomli_w.dumps({**HOSTED, "eval": "abc", "output_dir": str(tmp_path / "o")}))
        flags = []
    else:
        cfg.write_text(tomli_w.dumps({**BASE, "output_dir": str(tmp_path / "o")}))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--dry-run", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], p.stderr
