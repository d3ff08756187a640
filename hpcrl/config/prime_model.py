"""prime-rl's trainer model keys as its configs of today write them (snapshot of 2026-08-21), read into
hpcrl's trainer model section (hpcrl.config.sections.model), and the one-line notes where a key's
effect here differs from a GPU node running prime-rl.

- Same setting, another name (:data:`MODEL_ALIASES`, listed once; the loader's ``_ALIASES`` moves them
  for a run config's files and flags, :func:`translate` for an SFT config's [model]): ``cp_style`` is
  ``cp_mode``, ``fused_lm_head_token_chunk_size`` is ``logprobs_chunk_tokens``.
- Values prime-rl's parser takes that a typed table does not: ``"None"`` for an optional table
  (``compile = "None"``: off), ``full_offload = true / false`` (the table with its defaults / off),
  ``fused_lm_head_token_chunk_size = "disabled"`` (0: the LM head over all positions at once).
- ``ac``, ``ac_offloading``, ``compile``, ``optim_cpu_offload``, ``full_offload``, ``quantization`` are
  fields of hpcrl's own under prime-rl's names (hpcrl.trainer.memory_savers implements them).
- A served FP8 copy of the trained model (``zai-org/GLM-5-FP8`` served while ``zai-org/GLM-5`` trains,
  the older prime-rl path where the trainer sent FP8 weights, ``quantize_in_weight_transfer``) is
  served as the trained model quantized online: :func:`fp8_served_copy`.
"""

from __future__ import annotations

from typing import Any

from hpcrl.config.dicts import get_path, set_path
from hpcrl.errors import ConfigError

MODEL_ALIASES = {"cp_style": "cp_mode", "fused_lm_head_token_chunk_size": "logprobs_chunk_tokens"}
_OPTIONAL_TABLES = ("compile", "ac", "ac_offloading", "full_offload", "quantization", "lora")


def _model_tables(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(d.get("model"), dict):
        out.append(("model", d["model"]))
    trainer = d.get("trainer")
    if isinstance(trainer, dict) and isinstance(trainer.get("model"), dict):
        out.append(("trainer.model", trainer["model"]))
    return out


def translate(d: dict[str, Any]) -> None:
    """prime-rl's names and values in the trainer model tables of one config dict, in place."""
    for where, table in _model_tables(d):
        for alias, field in MODEL_ALIASES.items():
            if alias not in table:
                continue
            value = table.pop(alias)
            if field in table and table[field] != value:
                raise ConfigError(
                    f"{where}.{alias}",
                    f"conflicts with {where}.{field} = {table[field]!r} (the same setting)",
                )
            table[field] = value
        for key in _OPTIONAL_TABLES:
            if table.get(key) == "None":  # prime-rl's spelling of null: the table is off
                table.pop(key)
        offload = table.get("full_offload")
        if offload is True:
            table["full_offload"] = {}
        elif offload is False:
            table.pop("full_offload")
        if table.get("logprobs_chunk_tokens") == "disabled":
            table["logprobs_chunk_tokens"] = 0


def device_notes(model: Any, field: str, on_gpu: bool) -> list[str]:
    """One line per trainer model key whose effect where the trainer computes (GPU or CPU) is not
    what its name promises on a prime-rl GPU node; [] when none is set."""
    out: list[str] = []
    q = model.quantization
    if q is not None:
        kind = f"{q.type} ({q.recipe})" if q.type == "mxfp8" else q.type
        unused = ["ignore_patterns"] + [n for n in ("enable_grouped_gemm", "enable_a2a") if getattr(q, n)]
        out.append(
            f"{field}.quantization = {kind}: FP8 training matmuls are GPU kernels hpcrl does not have; the "
            f"trainer computes in its compute dtype ({', '.join(unused)}: nothing to act on; inference may "
            "still serve FP8: inference.vllm.quantization)"
        )
    if model.full_offload is not None:
        fo = model.full_offload
        out.append(
            f"{field}.full_offload: the optimizer state is kept in host memory between steps (as "
            "optim_cpu_offload); master weights and gradients stay with the model and the step runs "
            f"where the model is (no CPU optimizer-in-backward: cpu_optimizer_backend = {fo.cpu_optimizer_backend!r}, "
            f"numa_bind = {fo.numa_bind} act on nothing); gradient clipping stays on"
        )
    if on_gpu:
        return out
    if model.ac_offloading is not None:
        out.append(
            f"{field}.ac_offloading: the trainer computes on CPU, so offloaded activations are copies within "
            "host memory (same numbers, no memory saved)"
        )
    if model.optim_cpu_offload:
        out.append(
            f"{field}.optim_cpu_offload: the trainer computes on CPU; its optimizer state is in host memory "
            "already"
        )
    return out


FP8_SUFFIX = "-FP8"  # the FP8 checkpoints next to their bf16 model: Qwen/Qwen3-8B-FP8, zai-org/GLM-5-FP8
_SERVED = (("orchestrator", "model", "name"), ("inference", "vllm", "model"), ("inference", "model", "name"))


def fp8_served_copy(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """A config serving ``<trained>-FP8`` (an FP8 checkpoint of the trained model) serves the trained
    model with ``inference.quantization = "fp8_per_block"`` instead, in place: vLLM quantizes the bf16
    policy as it loads it, in 128 x 128 blocks as those checkpoints are (prime-rl #3031), and
    re-quantizes every bf16 update (#3581 removed the trainer-side FP8 path). Any other served name
    that is not the trained one stays refused by the caller."""
    trained = get_path(d, ["trainer", "model", "name"]) or get_path(d, ["model", "name"])
    if not isinstance(trained, str):
        return
    fp8 = trained + FP8_SUFFIX
    hits = [".".join(p) for p in _SERVED if get_path(d, list(p)) == fp8]
    if not hits:
        return
    for where in hits:
        set_path(d, where.split("."), trained)
    given = get_path(d, ["inference", "quantization"]) or get_path(d, ["inference", "vllm", "quantization"])
    if given is None:
        set_path(d, ["inference", "quantization"], "fp8_per_block")
    notes.append(
        f"{source}: {', '.join(hits)} = {fp8!r} is the FP8 copy of the trained model: served as {trained!r} "
        f"quantized online (inference.quantization = {given or 'fp8_per_block'!r}, prime-rl #3031), every "
        "update sent in bf16 and re-quantized (#3581); use trainer.loss.use_tis against the mismatch"
    )
