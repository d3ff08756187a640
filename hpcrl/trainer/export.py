"""HF weights from a sharded training checkpoint, offline and in bounded memory (`hpcrl export`), and
the warm start's reader of either form of a checkpoint's weights.

A checkpoint's trainer part (hpcrl.trainer.state: every rank's rows of every model tensor, in the
master dtype) is complete without weights/step_N, which ckpt.hf_weights may leave out. So that it can
be turned into HF weights later without the run's model code, config or cache, rank 0 writes beside
it `trainer/hf/` (a few MB): config.json (saying the policy dtype), generation_config.json, the
tokenizer's files and `names.json`, which maps every model state key to what `hf_named_tensors` makes
of it: its HF name (stacked experts: one name per row), its LoRA merge (A and B keys, scaling), or
nothing (LoRA tensors, tied weights).

    write_meta(model, tokenizer, dir, dtype)             rank 0, at each checkpoint
    checkpoint_tensors(step_dir, dtype) -> (name, tensor) pairs, one tensor at a time
    export(step_dir, out)                                 an HF directory, atomically

Memory: one output file (`max_file_bytes`) plus the tensor being assembled in the master dtype and
its cast (the largest non-expert tensor: the embedding; stacked experts are read one expert at a
time). The values are those of `hf_named_tensors` on the live model: the same casts and the same
LoRA merge on the same whole tensors, so the checksums are equal (tests/integration/test_export.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from hpcrl.errors import UserError

NAMES = "names.json"
FORMAT = 1


class ExportError(UserError, ValueError):
    """A checkpoint that cannot be exported (incomplete, written before trainer/hf existed): one line."""


def names_record(model: torch.nn.Module, dtype: str | torch.dtype | None) -> dict[str, Any]:
    """What `hf_named_tensors(model, dtype)` yields, as a plan over the model's state keys."""
    from hpcrl.trainer.model import _strip_peft
    from hpcrl.trainer.pieces import hf_view, lora_keys

    sd, skip, peft, scalings, adapter = hf_view(model)
    tensors: list[dict[str, Any]] = []
    for name, t in sd.items():
        if peft and ".lora_" in name:
            continue
        hf = _strip_peft(name) if peft else name
        if hf in skip:
            continue
        entry: dict[str, Any] = {"key": name, "hf": hf}
        lora = lora_keys(name, hf, scalings) if peft else None
        if lora is None and peft and hf.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            from hpcrl.models.vlm_moe import expert_lora_of  # a VL MoE's stacked experts' LoRA

            lora = expert_lora_of(model, name)
        if lora is not None:
            entry["lora"] = list(lora)
        if adapter is not None:
            names = [n for n, _ in adapter.to_hf([(hf, torch.empty(tuple(t.shape), device="meta"))])]
            entry["hf"] = names if len(names) > 1 else names[0]  # stacked experts: one name per row
        tensors.append(entry)
    out_dtype = None if dtype is None else str(dtype).removeprefix("torch.")
    return {"format": FORMAT, "dtype": out_dtype, "tensors": tensors}


def write_meta(model: torch.nn.Module, tokenizer: Any, out: Path, dtype: str | torch.dtype | None) -> None:
    """trainer/hf/ of a checkpoint (rank 0): the HF files besides the weights, and names.json."""
    from hpcrl.trainer.model import save_hf_meta

    out.mkdir(parents=True, exist_ok=True)
    save_hf_meta(model, tokenizer, out, dtype)
    (out / NAMES).write_text(json.dumps(names_record(model, dtype)))


def trainer_dir(step_dir: str | Path) -> Path:
    """`<run>/checkpoints/step_N` or its `trainer/`: the trainer part, checked to be complete."""
    d = Path(step_dir).expanduser()
    if d.name != "trainer":
        d = d / "trainer"
    if not (d / "rank_0.json").is_file():
        raise ExportError(f"{d.parent} holds no trainer checkpoint (no trainer/rank_0.json)")
    world = json.loads((d / "rank_0.json").read_text())["world_size"]
    missing = [r for r in range(world) if not (d / f"DONE.rank_{r}").is_file()]
    if missing:
        raise ExportError(f"{d.parent}: trainer rank(s) {missing} of {world} did not finish this checkpoint")
    if not (d / "hf" / NAMES).is_file():
        raise ExportError(
            f"{d.parent} was written before `hpcrl export` existed (no trainer/hf/{NAMES}); its HF "
            "weights are the run's weights/step_N"
        )
    return d


def checkpoint_tensors(
    step_dir: str | Path, dtype: str | None = "policy"
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights under their HF names, one tensor at a time. `dtype`: "policy" (what
    the run published: its compute dtype), None (the master weights as saved), or a dtype name."""
    from hpcrl.models.load import parse_dtype
    from hpcrl.trainer.state import _open_layouts, _Saved

    d = trainer_dir(step_dir)
    rec = json.loads((d / "hf" / NAMES).read_text())
    want = rec["dtype"] if dtype == "policy" else dtype
    to = parse_dtype(want) if want is not None else None
    world = json.loads((d / "rank_0.json").read_text())["world_size"]
    _, layouts, _ = _open_layouts(d, -1, 0, world)
    table = layouts[0][1]["model"]

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(to) if to is not None and t.is_floating_point() else t

    with ExitStack() as stack:
        saved = _Saved(d, layouts, stack)

        def whole(key: str) -> torch.Tensor:
            shape = table[key][0]
            return saved.rows("model", key, 0, shape[0] if shape else 0)

        for e in rec["tensors"]:
            key, hf = e["key"], e["hf"]
            if isinstance(hf, list):  # stacked experts: expert i is row i, read alone
                for i, name in enumerate(hf):
                    yield name, cast(saved.rows("model", key, i, 1)[0]).contiguous()
                continue
            full = whole(key)
            if "lora" in e:  # as hf_named_tensors merges: W + B @ A x scaling, in fp32 (stacked: per expert)
                a_key, b_key, scaling = e["lora"]
                a, b = whole(a_key), whole(b_key)
                full = (full.float() + (b.float() @ a.float()) * scaling).to(full.dtype)
            yield hf, cast(full).contiguous()


def export(
    step_dir: str | Path,
    out: str | Path | None = None,
    *,
    dtype: str | None = "policy",
    max_file_bytes: int = 2**30,
) -> Path:
    """Write the checkpoint's weights as an HF directory (safetensors + config + tokenizer), atomically.
    `out`: default `<run>/weights/step_N`, where the trainer would have written them."""
    from hpcrl.fileio import atomic_dir
    from hpcrl.trainer.model import write_weight_files

    d = trainer_dir(step_dir)
    dest = Path(out) if out is not None else d.parent.parent.parent / "weights" / d.parent.name
    with atomic_dir(dest) as tmp:
        write_weight_files(tmp, checkpoint_tensors(d, dtype), max_file_bytes)
        for f in (d / "hf").iterdir():
            if f.name != NAMES and f.is_file():
                shutil.copy2(f, tmp / f.name)
        if dtype != "policy":  # config.json (written in the policy dtype) says the weights' dtype
            _set_config_dtype(tmp / "config.json", dtype or _master_dtype(d))
    return dest


def _master_dtype(d: Path) -> str:
    """The dtype the trainer saved its weights in (the first floating tensor of rank 0's file)."""
    from safetensors import safe_open

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    with safe_open(str(d / "rank_0.model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118
            if f.get_slice(k).get_dtype() in names:
                return names[f.get_slice(k).get_dtype()]
    return "float32"


def _set_config_dtype(path: Path, dtype: str) -> None:
    cfg = json.loads(path.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    cfg.update(dict.fromkeys(keys, dtype))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The warm start's weights (master dtype for a checkpoint): an HF directory's safetensors, or a
    checkpoint step directory's sharded trainer state (hpcrl.warm_start names either)."""
    from hpcrl.models.load import read_hf_dir

    p = Path(path)
    if (p / "trainer" / "rank_0.json").is_file() or (p / "rank_0.json").is_file():
        return dict(checkpoint_tensors(p, dtype=None))
    return read_hf_dir(str(p))


def main(argv: list[str]) -> int:
    """`hpcrl export STEP_DIR [--out DIR] [--dtype ...]` (its usage: hpcrl.cli.EXPORT_USAGE)."""
    args = list(argv)
    out = dtype = None
    rest: list[str] = []
    while args:
        a = args.pop(0)
        if a in ("--out", "--dtype") and args:
            v = args.pop(0)
            out, dtype = (v, dtype) if a == "--out" else (out, v)
        elif a.startswith("--out=") or a.startswith("--dtype="):
            k, v = a.split("=", 1)
            out, dtype = (v, dtype) if k == "--out" else (out, v)
        else:
            rest.append(a)
    if len(rest) != 1 or rest[0].startswith("-"):
        raise ExportError(
            f"expected one STEP_DIR and --out/--dtype, got {' '.join(argv)} (hpcrl export --help)"
        )
    choice = {None: "policy", "policy": "policy", "master": None}.get(dtype, dtype)
    if choice not in ("policy", None, "bfloat16", "float32", "float16"):
        raise ExportError(f"--dtype {dtype}: use policy, master, bfloat16, float32 or float16")
    dest = export(rest[0], out, dtype=choice)
    n = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
    print(f"exported {trainer_dir(rest[0]).parent} -> {dest} ({n / 1e6:.1f} MB of safetensors)")
    return 0
