"""prime-rl's inference keys beside hpcrl's own: the `[inference.vllm]` table of vLLM engine arguments,
and the tables of its GPU deployments (`kv_cache_offload`, `deployment` = disaggregated prefill/decode,
`router`).

`[inference.vllm]` holds arguments of `vllm serve` under vLLM's own names (`max_num_seqs = 256`,
`enable_prefix_caching = true`, `compilation_config = {cudagraph_mode = "NONE"}`). They reach vLLM's
own argument parser when a vLLM server starts (hpcrl.inference.vllm_args), merged with the arguments
hpcrl derives from its fields. One home per setting:
- a key that names an hpcrl field (VLLM_HOMES: `tensor_parallel_size` is `inference.parallel.tp`) is an
  alias: its value moves to that field, and an explicit field of another value is an error;
- a key hpcrl must decide itself (RESERVED: the worker extension its weight sync runs in, the logprobs
  its losses need) is refused unless it says what hpcrl sets;
- every other key passes through verbatim, checked by vLLM's parser at --dry-run where vLLM is
  installed (or by vLLM at start).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.model import InferenceModelConfig
from hpcrl.errors import ConfigError

# vLLM argument -> (hpcrl field under [inference], that field's default): the alias's value moves there.
VLLM_HOMES: dict[str, tuple[str, Any]] = {
    "tensor_parallel_size": ("parallel.tp", 1),
    "data_parallel_size": ("parallel.dp", 1),
    "max_model_len": ("max_model_len", None),
    "max_num_seqs": ("max_batch_size", 64),
    "gpu_memory_utilization": ("gpu_memory_utilization", 0.9),
    "enforce_eager": ("enforce_eager", False),
    "quantization": ("quantization", None),
    "seed": ("seed", 0),
    "model": ("model.name", None),
    "dtype": ("model.dtype", "auto"),
    "trust_remote_code": ("model.trust_remote_code", False),
    "max_lora_rank": ("model.max_lora_rank", None),
}
# vLLM arguments whose home is another section of hpcrl's config.
ELSEWHERE = {
    "host": "server.host",
    "port": "server.port",
    "api_key": "server.api_key",
    "served_model_name": "inference.model.name (the name clients send)",
    "kv_transfer_config": "inference.kv_cache_offload",
}
# vLLM arguments hpcrl sets itself, with the only value it runs with (None: none may be given).
RESERVED: dict[str, tuple[Any, str]] = {
    "worker_extension_cls": (None, "hpcrl's weight sync runs in its own worker extension"),
    "logprobs_mode": ("processed_logprobs", "the losses need the logprobs of the sampled distribution"),
    "enable_scale_out": (True, "hpcrl's token route (/inference/v1/generate) needs it"),
    "api_server_count": (1, "each hpcrl server is one vLLM API server on its own socket"),
    "headless": (False, "each hpcrl server serves HTTP"),
    "data_parallel_size_local": (None, "hpcrl starts one engine per server (inference.parallel.tp GPUs)"),
    "data_parallel_rank": (None, "hpcrl starts one engine per server (inference.parallel.tp GPUs)"),
    "data_parallel_address": (None, "hpcrl starts one engine per server (inference.parallel.tp GPUs)"),
    "data_parallel_rpc_port": (None, "hpcrl starts one engine per server (inference.parallel.tp GPUs)"),
}


# prime-rl's fp32 flags reach vLLM 0.33 as its own model-config overrides (`--hf-overrides`):
# hf_overrides key -> (the flag that sets it, the value it sets).
FP32_OVERRIDES = {
    "head_dtype": ("enable_fp32_lm_head", "float32"),
    "moe_router_dtype": ("enable_fp32_router_logits", "float32"),
}


def normalize_key(key: str) -> str:
    """`max-num-seqs` (a flag's spelling) and `max_num_seqs` are the same vLLM argument."""
    return key.replace("-", "_")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _typed(obj: Any, dotted: str, value: Any) -> Any:
    """`value` as the type (and bounds) of the field at `dotted`; msgspec.ValidationError if it is not."""
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    field = next(f for f in msgspec.structs.fields(type(obj)) if f.name == last)
    return msgspec.convert(value, field.type, strict=False)


def _set(obj: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, _typed(obj, last, value))


def move_homes(inf: Any) -> None:
    """[inference.vllm] keys that are hpcrl fields move to them (InferenceConfig.__post_init__): where
    the field holds its default the key's value becomes the field's; where both say the same the key
    goes; a key whose field says otherwise stays, for `check_vllm` to name both."""
    for raw in list(inf.vllm):
        key = normalize_key(raw)
        if key != raw:
            if key in inf.vllm:
                continue  # both spellings: check_vllm names them
            inf.vllm[key] = inf.vllm.pop(raw)
        if key == "hf_overrides" and isinstance(inf.vllm[key], str):  # prime-rl's CLI form: JSON text
            try:
                inf.vllm[key] = json.loads(inf.vllm[key])
            except json.JSONDecodeError:
                pass  # check_vllm: must be a table
        if key not in VLLM_HOMES:
            continue
        home, default = VLLM_HOMES[key]
        if home.startswith("model.") and inf.model is None:
            inf.model = InferenceModelConfig()
        value = inf.vllm[key]
        current = _get(inf, home)
        if current in (default, value):
            try:
                _set(inf, home, value)
            except msgspec.ValidationError:
                continue  # a badly typed value: check_vllm names it
            del inf.vllm[key]


def check_vllm(cfg: Any) -> None:
    """What is left in [inference.vllm] after the moves: conflicts with hpcrl's fields, keys with a
    home elsewhere, reserved keys with another value. Values' types are vLLM's to check."""
    inf = cfg.inference
    seen: set[str] = set()
    for raw, value in inf.vllm.items():
        key = normalize_key(raw)
        where = f"inference.vllm.{raw}"
        if key in seen:
            raise ConfigError(where, f"is set twice (as {key} and {key.replace('_', '-')})")
        seen.add(key)
        if key in VLLM_HOMES:
            home = VLLM_HOMES[key][0]
            try:
                _typed(inf, home, value)
            except msgspec.ValidationError as e:
                raise ConfigError(
                    where, f"{value!r}: {str(e).split(' - at ')[0].lower()} (as inference.{home})"
                ) from None
            raise ConfigError(
                where,
                f"{value!r} conflicts with inference.{home} = {_get(inf, home)!r} (the same setting: set one)",
            )
        if key in ELSEWHERE:
            raise ConfigError(where, f"is set by hpcrl from {ELSEWHERE[key]}; set that instead")
        if key in RESERVED:
            allowed, why = RESERVED[key]
            if allowed is None or value != allowed:
                only = "cannot be set" if allowed is None else f"must be {allowed!r} if set"
                raise ConfigError(where, f"{only}: {why}")
        if key == "enable_lora" and value is False and inf.model is not None and inf.model.max_lora_rank:
            raise ConfigError(where, "is false, but the servers load the LoRA adapters the trainer makes")
        if key == "enable_prefix_caching" and value is False and inf.kv_cache_offload is not None:
            raise ConfigError(where, "is false, but inference.kv_cache_offload needs prefix caching")
    overrides = inf.vllm.get("hf_overrides", {})
    if not isinstance(overrides, dict):
        raise ConfigError("inference.vllm.hf_overrides", "must be a table (it is merged with hpcrl's own)")
    for key, (flag, on) in FP32_OVERRIDES.items():
        if key in overrides and (overrides[key] == on) != getattr(inf, flag):
            raise ConfigError(
                f"inference.vllm.hf_overrides.{key}",
                f"= {overrides[key]!r} conflicts with inference.{flag} = {getattr(inf, flag)} (the same setting: "
                f"set inference.{flag})",
            )
    d = inf.deployment
    for part, table in (
        ("prefill_vllm_overrides", d.prefill_vllm_overrides),
        ("decode_vllm_overrides", d.decode_vllm_overrides),
    ):
        if table and d.type != "disaggregated":
            raise ConfigError(f"inference.deployment.{part}", "is only read with type = 'disaggregated'")


# -- prime-rl's deployment tables ------------------------------------------------------------------
class CPUOffloadTier(Section):
    num_bytes: Annotated[int, D("CPU memory for offloaded KV blocks (vLLM's cpu_bytes_to_use).", gt=0)]


class DiskOffloadTier(Section):
    path: Annotated[str, D("Directory of the disk tier behind the CPU tier.")]


class KVCacheOffloadConfig(Section):
    """prime-rl's [inference.kv_cache_offload]: KV blocks evicted from GPU memory kept in CPU memory (and
    on disk). `native` reaches vLLM as its OffloadingConnector (`--kv-transfer-config`); `mooncake`
    needs Mooncake store processes that hpcrl does not start (a note says so)."""

    type: Annotated[
        Literal["native", "mooncake"], D("native: vLLM's own offloading; mooncake: a Mooncake store.")
    ] = "native"
    cpu: Annotated[CPUOffloadTier | None, D("The CPU tier (required).")] = None
    disk: Annotated[DiskOffloadTier | None, D("An optional disk tier behind the CPU tier.")] = None
    device_name: Annotated[str, D("mooncake: RDMA device name(s) of the store (empty: auto-detect).")] = ""


class InferenceDeploymentConfig(Section):
    """prime-rl's [inference.deployment]: how its inference command lays engines over nodes. hpcrl's
    placement comes from [deployment]; `disaggregated` (separate prefill and decode engines joined by
    NIXL KV transfer behind a router) is a GPU cluster setup hpcrl does not build: noted, not run."""

    type: Annotated[
        Literal["single_node", "multi_node", "disaggregated"], D("single_node, multi_node or disaggregated.")
    ] = "single_node"
    gpus_per_node: Annotated[int, D("GPUs per inference node.", ge=1)] = 8
    num_nodes: Annotated[Annotated[int, Meta(ge=1)] | None, D("multi_node: inference nodes.")] = None
    prefill_nodes_per_replica: Annotated[int, D("disaggregated: nodes of one prefill engine.", ge=1)] = 1
    decode_nodes_per_replica: Annotated[int, D("disaggregated: nodes of one decode engine.", ge=1)] = 1
    num_prefill_replicas: Annotated[int, D("disaggregated: prefill engines.", ge=1)] = 1
    num_decode_replicas: Annotated[int, D("disaggregated: decode engines.", ge=1)] = 1
    prefill_port: Annotated[int, D("disaggregated: port of the prefill engines.", ge=1, le=65535)] = 8100
    decode_port: Annotated[int, D("disaggregated: port of the decode engines.", ge=1, le=65535)] = 8200
    prefill_env_vars: Annotated[EnvVars, D("disaggregated: variables of the prefill engines only.")] = (
        msgspec.field(default_factory=dict)
    )
    decode_env_vars: Annotated[EnvVars, D("disaggregated: variables of the decode engines only.")] = (
        msgspec.field(default_factory=dict)
    )
    prefill_vllm_overrides: Annotated[
        dict[str, Any], D("disaggregated: vLLM arguments of the prefill engines only.")
    ] = msgspec.field(default_factory=dict)
    decode_vllm_overrides: Annotated[
        dict[str, Any], D("disaggregated: vLLM arguments of the decode engines only.")
    ] = msgspec.field(default_factory=dict)


class RouterConfig(Section):
    """prime-rl's [inference.router]: the HTTP router in front of its engines. hpcrl's orchestrator
    spreads requests over the servers itself (hpcrl.orchestrator.servers), so no router runs."""

    type: Annotated[Literal["vllm-router", "llm-d"], D("vllm-router or llm-d (EPP + Envoy).")] = "vllm-router"
    policy: Annotated[str, D("vllm-router: routing policy (consistent_hash, round_robin).")] = (
        "consistent_hash"
    )
    scorers: Annotated[dict[str, float], D("llm-d: scorer -> weight.")] = msgspec.field(default_factory=dict)
    prefill_scorer_overrides: Annotated[dict[str, float], D("llm-d: prefill profile weights.")] = (
        msgspec.field(default_factory=dict)
    )
    decode_scorer_overrides: Annotated[dict[str, float], D("llm-d: decode profile weights.")] = msgspec.field(
        default_factory=dict
    )
    non_cached_tokens: Annotated[int, D("llm-d: prompts with fewer uncached tokens skip prefill.", ge=0)] = 16
    decode_sidecar_port: Annotated[int, D("llm-d: port of the decode sidecar.", ge=1, le=65535)] = 8300


def check_inference(cfg: Any) -> None:
    """hpcrl.config.validate's check of prime-rl's inference keys: [inference.vllm] (check_vllm) and
    inference.parallel.dp (vLLM's data_parallel_size) against the GPU layout of [deployment]."""
    check_vllm(cfg)
    dp, tp, d = cfg.inference.parallel.dp, cfg.inference.parallel.tp, cfg.deployment
    gpus = (
        d.num_infer_gpus if d.num_infer_gpus is not None else d.gpus_per_node if d.num_infer_nodes else None
    )
    if dp != 1 and gpus and gpus // tp != dp:
        raise ConfigError(
            "inference.parallel.dp",
            f"{dp} (vLLM's data_parallel_size) but hpcrl runs {gpus // tp} server(s) per inference node "
            f"({gpus} GPU(s) / inference.parallel.tp {tp}), one engine each; set {gpus // tp} or leave it unset",
        )
