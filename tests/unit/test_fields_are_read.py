"""No parsed-and-ignored config: every field `--help` lists (and every config key the docs name)
reaches code that reads it, and each role command's --help lists only what that role reads.

"Reads" is checked statically: outside the section definitions, some module of hpcrl accesses the
field by name (`.field`, `"field"` for dict views, or `getattr(x, "field")`). Sections consumed
whole (converted to a dataclass or a request body field by field) are listed with the code that
consumes them, and that code is checked to exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcrl.cli import COMMANDS, _config_help
from hpcrl.config import fields, roles, schema

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    p: p.read_text()
    for p in (ROOT / "hpcrl").rglob("*.py")
    if "config/sections" not in p.as_posix() and p.name != "schema.py"
}
CODE = "\n".join(SOURCES.values())
# Sections whose fields are consumed as a whole; (section path, a snippet of the code that does it).
WHOLE = {
    # vLLM's own arguments, handed to its parser as they are (hpcrl.inference.vllm_args.engine_args)
    "inference.vllm": "inf.vllm.items()",
    # prime-rl's GPU deployment tables: noted, their set fields named (hpcrl.inference.vllm_args.notes)
    "inference.deployment": "_given(inf.deployment,",
    "inference.router": "_given(inf.router,",
}


def _read_by_name(name: str) -> bool:
    return re.search(rf"\.{name}\b|[\"']{name}[\"']", CODE) is not None


def _help_paths(command: str, root: str) -> list[str]:
    out = []
    for line in _config_help(command, root).splitlines():
        m = re.match(r"\s+--([a-z0-9.\-]+)\s", line)
        if m:
            out.append(m.group(1).replace("-", "_"))
    return out


HELP = sorted({(p, root) for cmd, (_, root) in COMMANDS.items() if root for p in _help_paths(cmd, root)})


def test_help_lists_fields():
    assert len(HELP) > 200


@pytest.mark.parametrize("path,root", HELP, ids=[f"{r}:{p}" for p, r in HELP])
def test_every_help_field_is_read(path, root):
    if any(path.startswith(w + ".") for w in WHOLE):
        snippet = next(v for w, v in WHOLE.items() if path.startswith(w + "."))
        assert snippet in CODE, f"{path}: the code that consumes its section is gone ({snippet})"
        return
    name = path.rsplit(".", 1)[-1]
    assert _read_by_name(name), f"{root}: {path} is parsed but no code outside the schema reads '{name}'"


@pytest.mark.parametrize("role", sorted(roles.VIEWS))
def test_role_help_lists_only_what_the_role_reads(role):
    paths = _help_paths(role, "Config")
    assert paths and all(roles.reads(role, p) for p in paths)
    others = {
        "trainer": ("inference.", "server.host"),
        "orchestrator": ("trainer.",),
        "inference": ("trainer.", "orchestrator."),
    }
    for p in paths:
        assert not p.startswith(others[role]), f"hpcrl {role} --help lists {p}"


def test_inference_help_shows_no_trainer_only_field():
    from hpcrl.config.sections.model import ModelConfig, TrainerModelConfig

    trainer_only = set(TrainerModelConfig.__struct_fields__) - set(ModelConfig.__struct_fields__)
    text = _config_help("inference", "Config")
    assert "--trainer." not in text and "--orchestrator." not in text
    for f in trainer_only:
        assert f"model.{f.replace('_', '-')} " not in text, f  # inference.quantization is the servers' own


DOC_KEY = re.compile(
    r"`(?:--)?((?:model|trainer|orchestrator|inference|server|deployment|slurm|ckpt|wandb|log)(?:\.[a-z_\-]+)+)"
)


# Backticked names in the docs that are code, not config keys (library calls, files), or that the
# docs quote as refused (an error message).
NOT_KEYS = {"wandb.init", "wandb.teardown", "model.generate", "trainer.py", "inference.model.ep"}
# prime-rl's platform settings, accepted with an "ignored here" note (tests/seed_names.toml holds them)
NOT_KEYS |= {"orchestrator.prime_monitor"}
# attribute paths inside a vision-language model ([model.vlm] *_attr values), not config keys
NOT_KEYS |= {"model.visual", "model.language_model"}
# prime-rl's keys that are translated on load, not fields (hpcrl.config.prime_shapes; docs/prime-rl.md)
NOT_KEYS |= {"deployment.num_infer_replicas", "deployment.nodes_per_fsdp_group", "deployment.type"}


def _documented() -> list[str]:
    keys = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        if doc.name == "config.md":  # generated from every root's schema itself (test_config_docs)
            continue
        text = doc.read_text()
        for m in DOC_KEY.finditer(text):
            key = m.group(1).replace("-", "_").rstrip(".")
            if key not in NOT_KEYS and text[m.end() : m.end() + 1] != "(":
                keys.add(key)
    return sorted(keys)


@pytest.mark.parametrize("key", _documented())
def test_documented_keys_exist_and_are_read(key):
    from hpcrl.config import ConfigError
    from hpcrl.config.loader import canonical_path

    parts = canonical_path(key.split("."))  # prime-rl's names (aliases) are documented too
    try:
        leaf = fields.resolve(schema.Config, parts)  # a documented key that is not a field fails here
    except ConfigError:
        if parts[-1] in ("log", "py", "md", "json", "jsonl", "toml", "sh", "pid"):
            pytest.skip(f"{key} is a file name (`server.log`), not a config key")
        raise
    key = ".".join(parts)
    if leaf.kind == "section" or any(key.startswith(w + ".") for w in WHOLE):
        return
    assert _read_by_name(key.rsplit(".", 1)[-1]), key
