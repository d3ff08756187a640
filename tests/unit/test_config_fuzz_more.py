"""Config inputs a fuzz campaign found escaping as tracebacks or as errors that name no field.

Mutations of the shipped configs (configs/**/*.toml, hosted shape included) and of dotted flags:
deleted keys, swapped types, edge values (NUL, lone surrogates from undecodable argv bytes, 2^64,
1e308, 300-byte names, `~nosuchuser`), unknown / empty / wrong-case keys, tables <-> arrays of
tables, deep nesting. Each class is fixed once in hpcrl/config; the cases below are the fuzzer's
hand-picked reproducers (old exception type in the id), then a small seeded fuzz loop that asserts
every outcome is a success or a one-line ConfigError naming a field.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib

from hpcrl.cli import main
from hpcrl.config import fields, schema
from hpcrl.errors import MAX_MESSAGE, MAX_PATH, ConfigError, UserError
from hpcrl.launch.checks import load

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {
    "max_steps": 5,
    "seq_len": 128,
    "model": {"name": "hpcrl/tiny-qwen3"},
    "orchestrator": {
        "batch_size": 16,
        "rollouts_per_example": 4,
        "train": {"sampling": {"max_tokens": 16}, "env": [{"id": "reverse-text"}]},
    },
}
HOSTED: dict[str, Any] = {
    "model": "Qwen/Qwen3-4B",
    "max_steps": 10,
    "batch_size": 16,
    "rollouts_per_example": 4,
    "sampling": {"max_tokens": 64},
    "env": [{"id": "reverse-text"}],
}
SFT: dict[str, Any] = {"model": {"name": "hpcrl/tiny-qwen3"}, "data": {"name": "x.jsonl"}}


def _with(base: dict[str, Any], **over: Any) -> dict[str, Any]:
    d = copy.deepcopy(base)
    for dotted, value in over.items():
        cur = d
        parts = dotted.split("__")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
    return d


def _deep_name(levels: int) -> dict[str, Any]:
    v: Any = 1
    for _ in range(levels):
        v = {"a": v}
    return v


# (id: what it was, command, config dict or raw TOML text, flags, fragments the one line must contain)
CASES: list[tuple[str, str, dict[str, Any] | str, list[str], tuple[str, ...]]] = [
    # --- exceptions that escaped as tracebacks -----------------------------------------------
    (
        "TypeError:hosted-compute-size-list",
        "run",
        {**HOSTED, "infrastructure": {"compute_size": []}},
        [],
        ("infrastructure.compute_size", "S, M or L"),
    ),
    (
        "TypeError:hosted-compute-size-table",
        "run",
        {**HOSTED, "infrastructure": {"compute_size": {"a": 1}}},
        [],
        ("infrastructure.compute_size",),
    ),
    (
        "ValueError:warm-start-NUL",
        "run",
        _with(BASE, ckpt__warm_start="a\x00b"),
        [],
        ("ckpt.warm_start", "NUL"),
    ),
    (
        "OSError:warm-start-name-too-long",
        "run",
        _with(BASE, ckpt__warm_start="x" * 300),
        [],
        ("ckpt.warm_start", "300 bytes"),
    ),
    (
        "RuntimeError:warm-start-unknown-user",
        "run",
        _with(BASE, ckpt__warm_start="~hpcrl_no_such_user/x"),
        [],
        ("ckpt.warm_start", "no home directory"),
    ),
    (
        "RuntimeError:hosted-checkpoint-id-unknown-user",
        "run",
        {**HOSTED, "checkpoint_id": "~hpcrl_no_such_user/x"},
        [],
        ("ckpt.warm_start", "checkpoint_id"),
    ),
    (
        "OSError:env-file-name-too-long",
        "run",
        _with(BASE, env_files=["y" * 300]),
        [],
        ("env_files[0]", "bytes"),
    ),
    (
        "RuntimeError:env-file-unknown-user",
        "run",
        _with(BASE, env_files=["~hpcrl_no_such_user/.env"]),
        [],
        ("env_files[0]", "no home directory"),
    ),
    ("UnicodeEncodeError:flag-surrogate", "run", BASE, ["--model.name", "\udcff"], ("model.name", "UTF-8")),
    (
        "UnicodeEncodeError:flag-surrogate-written-config",
        "run",
        BASE,
        ["--deployment.env-partition", "a\udcffb"],
        ("deployment.env_partition", "UTF-8"),
    ),
    ("UnicodeEncodeError:sft-flag-surrogate", "sft", SFT, ["--data.name", "\udcff"], ("data.name", "UTF-8")),
    ("NUL-in-env-id", "run", _with(HOSTED, env=[{"id": "reverse-text\x00"}]), [], ("env[0].id", "NUL")),
    (
        "MemoryError:gpus-per-node-2^64",
        "run",
        BASE,
        ["--deployment.gpus-per-node", str(2**64)],
        ("deployment.gpus_per_node",),
    ),
    (
        "MemoryError:slurm-gpus-per-node-2^64",
        "run",
        BASE,
        ["--slurm.gpus-per-node", str(2**64)],
        ("slurm.gpus_per_node",),
    ),
    (
        "OverflowError:logprobs-chunk-mib-1e308",
        "run",
        BASE,
        ["--trainer.model.logprobs-chunk-mib", "1e308"],
        ("logprobs_chunk_mib",),
    ),
    (
        "ValueError:gpu-memory-gib-1e308",
        "run",
        BASE,
        ["--deployment.gpu-memory-gib", "1e308"],
        ("gpu_memory_gib",),
    ),
    ("int-past-64-bits", "run", BASE, ["--seed", str(2**70)], ("seed", "64-bit")),
    (
        "int-past-64-bits-in-env-args",
        "run",
        _with(BASE, orchestrator__train__env=[{"id": "reverse-text", "args": {"n": 2**70}}]),
        [],
        ("orchestrator.train.env[0].args.n", "64-bit"),
    ),
    (
        "ValueError:signal-before-s-past-time-limit",
        "run",
        BASE,
        ["--slurm.time", "00:05:00", "--slurm.signal-before-s", "600"],
        ("slurm.signal_before_s", "below the time limit"),
    ),
    # --- errors that named no field ----------------------------------------------------------
    ("nofield:empty-key", "run", '"" = 1\n', [], ('"": unknown field in top level',)),
    ("nofield:empty-key-in-section", "run", {**BASE, "trainer": {"": 1}}, [], ('trainer."": unknown field',)),
    ("nofield:sft-empty-key", "sft", '"" = 1\n', [], ('"": unknown field',)),
    ("nofield:hosted-empty-table", "run", {**HOSTED, "": {"q": 1}}, [], ('"": unknown field in top level',)),
    ("nofield:empty-argv-token", "run", BASE, [""], ("''", "unexpected argument")),
    ("nofield:section-at-nothing", "run", BASE, ["--trainer.model.lora=@"], ("trainer.model.lora", "'@'")),
    ("nofield:at-empty-file-name", "run", BASE, ["@", ""], ("''", "config file not found")),
    (
        "nofield:depth-after-flow",
        "run",
        _with(BASE, model__name=_deep_name(30)),  # at the limit as written, past it once flowed
        [],
        ("model.name", "expected str"),
    ),
    (
        "nofield:depth-flag-lands-deep",
        "run",
        BASE,
        ["--orchestrator.train.sampling.max-tokens", "[" * 31 + "]" * 31],
        ("orchestrator.train.sampling", "nested more than"),
    ),
]


def _argv(tmp_path: Path, command: str, data: dict[str, Any] | str, flags: list[str]) -> list[str]:
    cfg = tmp_path / "cfg.toml"
    if isinstance(data, str):
        base = SFT if command == "sft" else BASE
        data = data + tomli_w.dumps(base)  # before the first table: at top level
    else:
        data = tomli_w.dumps(data)
    cfg.write_text(data)
    return [command, str(cfg), "--dry-run", "--output-dir", str(tmp_path / "out"), *flags]


@pytest.mark.parametrize("name,command,data,flags,fragments", CASES, ids=[c[0] for c in CASES])
def test_found_case_is_one_line(tmp_path, capsys, name, command, data, flags, fragments):
    rc = main(_argv(tmp_path, command, data, flags))
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert rc == 2, f"rc {rc}: {err}"
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert not lines[0].startswith("config error: config:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "field,value",
    [("slurm.time", "a\nb"), ("slurm.mem", "a\u2028b"), ("ckpt.warm_start", "a\nb")],
)
def test_message_escapes_line_breaks(tmp_path, field, value):
    """A value quoted in a message cannot break it into lines (str(e) is one line, not just the print)."""
    section, key = field.split(".")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(_with(BASE, **{f"{section}__{key}": value})))
    with pytest.raises(ConfigError) as e:
        load([str(cfg), "--output-dir", str(tmp_path / "o")])
    assert e.value.path == field and len(str(e.value).splitlines()) == 1, str(e.value)


def test_huge_values_are_shortened(tmp_path):
    """A 20 kB value or key is named, not echoed whole."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(_with(BASE, orchestrator__batch_size="x" * 20000, **{"k" * 20000: 1})))
    with pytest.raises(ConfigError) as e:
        load([str(cfg)])
    assert len(e.value.path) <= MAX_PATH and len(e.value.message) <= MAX_MESSAGE
    assert "…" in str(e.value)


def test_env_file_not_text(tmp_path):
    """An env file that is binary or a directory is the user's error, named by its index."""
    binary = tmp_path / "bin.env"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    for p in (binary, tmp_path):
        cfg = tmp_path / "cfg.toml"
        cfg.write_text(tomli_w.dumps(_with(BASE, env_files=[str(p)])))
        with pytest.raises(ConfigError) as e:
            load([str(cfg), "--output-dir", str(tmp_path / "o")])
        assert e.value.path == "env_files[0]", str(e.value)


# ---------------------------------------------------------------------------------------------
# a small seeded fuzz loop over the shipped configs
# ---------------------------------------------------------------------------------------------
def _deep(n: int, kind: str) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v] if kind == "list" else {"a": v}
    return v


BAD = [
    "", "x" * 3000, "ünï ✓", "\x00", 0, -1, 2**70, 2**64, float("nan"), float("inf"), 1e308, 1.5, True,
    [], [1, "a"], {}, {"a": 1}, [{}], [[1]], _deep(40, "list"), _deep(40, "table"), "~hpcrl_no_such_user",
]  # fmt: skip
RAW = [
    "nan",
    "inf",
    "1e309",
    "",
    "[1,2]",
    "{a=1}",
    "[",
    "true",
    "-1",
    str(2**70),
    "\x00",
    "\udcff",
    "@",
    "--x",
]


def _paths(d: Any, pre: tuple = ()) -> list[tuple]:
    out: list[tuple] = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else []
    for k, v in items:
        out.append(pre + (k,))
        out.extend(_paths(v, pre + (k,)))
    return out


def _get(d: Any, p: tuple) -> Any:
    for k in p:
        d = d[k]
    return d


def _mutate(rng: random.Random, d: dict[str, Any], root: type) -> dict[str, Any]:
    d = copy.deepcopy(d)
    ps = _paths(d)
    op = rng.choice(["del", "swap", "swap", "unknown", "case", "tab2arr", "arr2tab", "leaf", "leaf"])
    if op == "del" and ps:
        p = rng.choice(ps)
        del _get(d, p[:-1])[p[-1]]
    elif op == "swap" and ps:
        p = rng.choice(ps)
        _get(d, p[:-1])[p[-1]] = copy.deepcopy(rng.choice(BAD))
    elif op == "unknown":
        tables = [()] + [p for p in ps if isinstance(_get(d, p), dict)]
        _get(d, rng.choice(tables))[rng.choice(["zz", "Model", "", "a.b", "ü"])] = 1
    elif op == "case":
        keys = [p for p in ps if isinstance(p[-1], str)]
        if keys:
            p = rng.choice(keys)
            parent = _get(d, p[:-1])
            parent[p[-1].upper()] = parent.pop(p[-1])
    elif op in ("tab2arr", "arr2tab"):
        if op == "tab2arr":
            ts = [p for p in ps if isinstance(_get(d, p), dict)]
        else:
            ts = [
                p
                for p in ps
                if isinstance(_get(d, p), list) and _get(d, p) and isinstance(_get(d, p)[0], dict)
            ]
        if ts:
            p = rng.choice(ts)
            parent = _get(d, p[:-1])
            parent[p[-1]] = [parent[p[-1]]] if op == "tab2arr" else parent[p[-1]][0]
    else:  # a real field of the schema, any bad value
        leaves = [path for path, typ, *_ in fields.iter_leaves(root) if typ != "section"]
        cur = d
        parts = rng.choice(leaves).split(".")
        for k in parts[:-1]:
            if not isinstance(cur.get(k), dict):
                cur[k] = {}
            cur = cur[k]
        cur[parts[-1]] = copy.deepcopy(rng.choice(BAD))
    return d


def _flags(rng: random.Random, root: type) -> list[str]:
    leaves = [path for path, *_ in fields.iter_leaves(root)]
    out: list[str] = []
    for _ in range(rng.choice([1, 2])):
        flag = "--" + rng.choice(leaves).replace("_", "-") + rng.choice(["", "", "", ".zz"])
        out += [flag + "=" + rng.choice(RAW)] if rng.random() < 0.3 else [flag, rng.choice(RAW)]
    return out


def _bases() -> list[tuple[type, dict[str, Any]]]:
    out = []
    for f in sorted((REPO / "configs").rglob("*.toml")):
        root = schema.SFTConfig if "sft" in f.name else schema.Config
        out.append((root, tomllib.loads(f.read_text())))
    out.append((schema.Config, HOSTED))
    return out


def test_seeded_fuzz(tmp_path):
    rng = random.Random(20240917)
    bases = _bases()
    out = str(tmp_path / "out")
    problems: list[str] = []
    outcomes = {"ok": 0, "error": 0}
    for i in range(400):
        root, d = rng.choice(bases)
        for _ in range(rng.choice([1, 1, 2])):
            d = _mutate(rng, d, root)
        if isinstance(d, dict):
            d["output_dir"] = out
        cfg = tmp_path / f"c{i % 4}.toml"
        try:
            cfg.write_text(tomli_w.dumps(d))
        except (TypeError, ValueError):
            continue
        argv = [str(cfg), *(_flags(rng, root) if rng.random() < 0.4 else [])]
        try:
            load(argv, root)
            outcomes["ok"] += 1
        except ConfigError as e:
            outcomes["error"] += 1
            if e.path in ("", "config") or "\n" in str(e) or len(str(e)) > MAX_PATH + MAX_MESSAGE + 2:
                problems.append(f"#{i} {argv[1:]!r:.200}: {e}")
        except UserError as e:
            outcomes["error"] += 1
            if "\n" in str(e):
                problems.append(f"#{i} {argv[1:]!r:.200}: {e}")
        except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
            problems.append(f"#{i} {argv[1:]!r:.200}: {type(e).__name__}: {e}"[:400])
    assert not problems, "\n".join(problems[:10])
    assert outcomes["ok"] >= 10 and outcomes["error"] >= 200, outcomes


@pytest.mark.parametrize(
    "flags,field",
    [
        (["--model.name", b"\xff".decode("utf-8", "surrogateescape")], "model.name"),
        (["--seed", str(2**70)], "seed"),
    ],
    ids=["undecodable-argv-byte", "int-past-64-bits"],
)
def test_real_cli(tmp_path, flags, field):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps({**BASE, "output_dir": str(tmp_path / "o")}))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "hpcrl.cli", "run", str(cfg), "--dry-run", *flags]
    p = subprocess.run([os.fsencode(a) for a in argv], capture_output=True, timeout=60, env=env)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {field}:"), err


def test_eval_env_args_nested_past_the_stack(capsys):
    """`hpcrl eval ENV -a '<JSON nested 3000 deep>'`: json.loads recurses; one line, exit 2."""
    deep = '{"a": ' * 3000 + "1" + "}" * 3000
    code = main(["eval", "reverse-text", "-a", deep, "--model.name", "hpcrl/tiny-qwen3", "--dry-run"])
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if x.strip()]
    assert code == 2 and lines == [
        "config error: env.args: -a expects a JSON object nested at most a few hundred levels"
    ]
