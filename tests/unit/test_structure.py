"""Structure rules the code review asked for, checked on the source itself.

- No import cycle among hpcrl modules, counting imports inside functions (a lazy import still runs,
  and a cycle through it breaks as soon as the order of first use changes). Imports under
  `if TYPE_CHECKING:` never run and do not count.
- The repository is self-contained: nothing refers to a file outside it (`../shared/...`, the
  design notes it came from); docs/architecture.md is the map.
- Atomic writes have one home (hpcrl/fileio.py): nobody else builds a `.tmp-<pid>` name by hand.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted((REPO / "hpcrl").rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """hpcrl modules `module` imports anywhere (top level, functions, classes), TYPE_CHECKING aside.
    `from pkg import name` counts pkg.name when that is a module, else pkg (its __init__)."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(r for a in node.names if a.name.startswith("hpcrl") and (r := resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.startswith("hpcrl"):
                for a in node.names:
                    full = f"{source}.{a.name}"
                    if (r := full if full in known else resolve(source)) is not None:
                        found.add(r)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imported(m, p, known) for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one concrete cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A path a -> ... -> a inside the component, for the failure message."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_no_import_cycles_counting_lazy_imports() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (lazy imports included): " + "; ".join(" -> ".join(c) for c in found)


def test_cycle_finder_finds_a_lazy_cycle_and_ignores_type_checking(tmp_path: Path) -> None:
    """The checker itself: a function-level import closes a cycle, a TYPE_CHECKING one does not."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("import hpcrl.b\n")
    b.write_text("def f():\n    from hpcrl.c import x\n")
    c.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpcrl.a import y\n"
        "def g():\n    from hpcrl import a\n"
    )
    known = {"hpcrl": tmp_path / "__init__.py", "hpcrl.a": a, "hpcrl.b": b, "hpcrl.c": c}
    graph = {m: _imported(m, p, known) for m, p in known.items() if m != "hpcrl"}
    graph["hpcrl"] = set()
    assert graph == {"hpcrl.a": {"hpcrl.b"}, "hpcrl.b": {"hpcrl.c"}, "hpcrl.c": {"hpcrl.a"}, "hpcrl": set()}
    assert cycles(graph) == [["hpcrl.a", "hpcrl.b", "hpcrl.c", "hpcrl.a"]]
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpcrl.a import y\n")
    graph["hpcrl.c"] = _imported("hpcrl.c", c, known)
    assert cycles(graph) == []


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def test_nothing_refers_to_a_file_outside_the_repository() -> None:
    offenders = []
    for f in _tracked_files():
        if not f.is_file() or f == Path(__file__).resolve():
            continue
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        if "../shared" in text or "DESIGN.md" in text or "DESIGN §" in text:
            offenders.append(str(f.relative_to(REPO)))
    assert not offenders, f"refer to files outside the repository (use docs/architecture.md): {offenders}"


def test_atomic_writes_have_one_home() -> None:
    """A hand-made tmp name (`.tmp-{os.getpid()}` and friends) means a second write protocol."""
    pattern = re.compile(r"tmp-\{os\.getpid\(\)\}|\.tmp\.png|mkdtemp\(prefix=\"\.build")
    offenders = [
        str(f.relative_to(REPO))
        for f in (REPO / "hpcrl").rglob("*.py")
        if f.name != "fileio.py" and pattern.search(f.read_text())
    ]
    assert not offenders, f"write through hpcrl.fileio (write_atomic / write_text / atomic_dir): {offenders}"


# The floors of hpcrl (docs/architecture.md, "Floors"): rooms in order, lowest first. A room imports
# only rooms before it in this list (its own floor's earlier rooms included), lazy imports counted;
# a room that is not listed fails the test until it is given a place.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "net", "paths", "fileio", "storage", "runtime", "balance"),  # ground
    ("config", "monitor"),  # 1: typed config, logging and metrics sinks
    ("bus", "weights", "checkpoint", "warm_start", "models", "render", "envs"),  # 2: shared machinery
    ("inference", "trainer", "orchestrator"),  # 3: the process roles
    (
        "launch",
        "evaluation",
        "dashboard",
        "cli",
    ),  # 4: planning and launching runs, the dashboard, the commands
)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """`a -> b` for every import whose target room is not below its source room in `floors`."""
    rank = {room: i for i, room in enumerate(r for floor in floors for r in floor)}
    rank["__init__"] = -1  # the package's own __init__ is below everything
    bad = []
    for src, targets in sorted(graph.items()):
        a = room_of(src)
        for dst in sorted(targets):
            b = room_of(dst)
            if a == b:
                continue
            if a not in rank or b not in rank:
                bad.append(f"{src} -> {dst}: room {a if a not in rank else b!r} has no floor")
            elif rank[b] > rank[a]:
                bad.append(f"{src} -> {dst}: {a} may not import {b}, which stands above it")
    return bad


def test_every_import_points_down_the_floors() -> None:
    bad = upward_imports(import_graph(), FLOORS)
    assert not bad, "imports that point up (pass a callable or a registry down instead):\n" + "\n".join(bad)


def test_floors_are_the_ones_the_architecture_page_shows() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    for floor in FLOORS:
        for room in floor:
            assert f"`{room}" in page, f"docs/architecture.md does not place room {room!r} on a floor"


def test_upward_import_finder_names_the_arrow() -> None:
    graph = {"hpcrl.config.validate": {"hpcrl.trainer.precision"}, "hpcrl.trainer.rl": {"hpcrl.config"}}
    bad = upward_imports(graph, FLOORS)
    assert bad == [
        "hpcrl.config.validate -> hpcrl.trainer.precision: config may not import trainer, which stands above it"
    ]


# ------------------------------------------------------------------ one construction path per family
# What only a model family's spec (hpcrl/models/spec.py, hpcrl/models/parallelize.py) may do: shard,
# apply expert parallelism, bind the cp group, switch checkpointing on, or reach a family's internals.
MODEL_BUILDING_CALLS = {
    "fully_shard",
    "apply_fsdp",
    "apply_ep",
    "apply_cp",
    "bind_cp_group",
    "parallelize",
    "enable_checkpointing",
    "gradient_checkpointing_enable",
    "activation_checkpointing_enable",
    "fill_from_rank0",
    "cp_context",
}


def _calls(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_trainer_builds_models_only_through_the_family_spec() -> None:
    """trainer/ imports no family's internals (models.qwen3, models.custom: a family is reached through
    the registry and its spec) and applies no FSDP, ep, cp or checkpointing itself: it calls
    hpcrl.models.spec.build with its process groups."""
    graph = import_graph()
    internals = ("hpcrl.models.qwen3", "hpcrl.models.custom")
    bad = [
        f"{src} -> {dst}"
        for src, targets in sorted(graph.items())
        if src.startswith("hpcrl.trainer")
        for dst in sorted(targets)
        if dst.startswith(internals)
    ]
    assert not bad, "trainer/ reaches past the family spec:\n" + "\n".join(bad)
    applied = {
        f"{f.relative_to(REPO)}: {name}"
        for f in sorted((REPO / "hpcrl" / "trainer").rglob("*.py"))
        for name in _calls(f) & MODEL_BUILDING_CALLS
    }
    assert not applied, f"trainer/ parallelizes a model itself (the spec's job): {sorted(applied)}"
    assert "build" in {
        n.func.attr
        for n in ast.walk(ast.parse((REPO / "hpcrl/trainer/setup.py").read_text()))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and getattr(n.func.value, "id", "") == "model_spec"
    }, "trainer/setup.py builds its model through hpcrl.models.spec.build"


def test_cp_attention_reads_no_global_context() -> None:
    """The cp group is bound to the attention modules when cp is applied and the micro-batch's layout
    is a forward argument: no thread-local or module-global context is read in forward."""
    for rel in ("hpcrl/models/ring_attention.py", "hpcrl/models/ulysses.py", "hpcrl/models/qwen3/model.py"):
        src = (REPO / rel).read_text()
        for word in ("threading", "current_context", "cp_context", "contextvars"):
            assert word not in src, f"{rel} still holds a global cp context ({word!r})"
        assert not any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(src))), f"{rel} sets a global"


def test_each_family_spec_exposes_the_whole_construction_path(tmp_path: Path) -> None:
    """Every registered family (hpcrl's Qwen3 / Qwen3-MoE, transformers' generic path) has config
    args, build, parallelize, a state-dict adapter and checks; the built-in tiny models (dense and MoE
    presets) reach a registered spec through the registry, custom or transformers' as asked."""
    import json

    from hpcrl.models import registry, spec
    from hpcrl.models.tiny import MOE_PRESETS, PRESETS

    families = {registry.family(t).SPEC for t in registry.FAMILIES}
    for s in (spec.HF, *families):
        for part in ("config_args", "build", "parallelize", "from_hf", "to_hf", "unsupported"):
            assert callable(getattr(s, part)), f"spec {s.name} has no {part}"
    (qwen3,) = families
    assert set(qwen3.model_types) == set(registry.FAMILIES) and qwen3.apply_ep is not None
    assert spec.HF.apply_ep is None and spec.HF.unsupported({"model_type": "llama"}) is None
    for preset, shape in {**PRESETS, **MOE_PRESETS}.items():
        d = tmp_path / preset
        d.mkdir()
        model_type = "qwen3_moe" if preset in MOE_PRESETS else "qwen3"
        (d / "config.json").write_text(json.dumps({"model_type": model_type, **shape}))
        assert spec.spec_for(d, "auto") is qwen3 and spec.spec_for(d, "custom") is qwen3, preset
        assert spec.spec_for(d, "hf") is spec.HF and spec.spec_for(d, "auto", lora=True) is spec.HF, preset
    with __import__("pytest").raises(Exception, match="trainer.model.ep"):
        spec.HF.parallelize(object(), device="cpu", param_dtype=None, reduce_dtype=None, ep=2)
