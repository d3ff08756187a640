"""The arguments of `vllm serve`: hpcrl's own (from its fields) merged with `[inference.vllm]` and the
prime-rl keys that reach vLLM as engine arguments or environment variables.

    engine_args(cfg)           what the config adds to hpcrl's own arguments (no vLLM import):
                               [inference.vllm] after its aliases moved (hpcrl.config.sections.vllm),
                               kv_cache_offload (native) as kv_transfer_config, the fp32 lm_head /
                               router-logit flags as vLLM's hf_overrides, "auto" parsers resolved
    engine_env(cfg)            the variables the server process sets before vLLM loads (use_deep_gemm)
    to_argv(args, parser)      one argv; with vLLM's parser at hand its booleans and lists are
                               rendered the way that parser reads them
    parse(argv, keys)          vLLM's own parser and validators on the whole argv: a refused argument
                               is a ConfigError naming the config key it came from
    notes(cfg)                 what happens to prime-rl's GPU-only inference keys here

Imports nothing of vLLM at module level; `parse` builds vLLM's parser (seconds: it imports vLLM).
The --dry-run check is hpcrl.launch.vllm_check.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from functools import cache
from typing import Any

from hpcrl.errors import ConfigError

# prime-rl's parsers for `tool_call_parser = "auto"` / `reasoning_parser = "auto"`, by model name
# (prime_rl/utils/parsers.py at 2026-08-21): first match wins; no match leaves the parser off.
TOOL_CALL_PARSERS = (
    (r"^arcee-ai/Trinity-Large-Thinking", "qwen3_coder"),
    (r"^arcee-ai/Trinity-", "hermes"),
    (r"^deepseek-ai/DeepSeek-V3\.2", "deepseek_v32"),
    (r"^deepseek-ai/DeepSeek-V3\.1", "deepseek_v31"),
    (r"^zai-org/GLM-4\.5", "glm45"),
    (r"^zai-org/GLM-4\.7", "glm47"),
    (r"^zai-org/GLM-5", "glm47"),
    (r"^MiniMaxAI/MiniMax-M2", "minimax_m2"),
    (r"^openai/gpt-oss", "openai"),
    (r"^poolside/Laguna", "poolside_v1"),
    (r"^PrimeIntellect/INTELLECT-3", "qwen3_coder"),
    (r"^nvidia/NVIDIA-Nemotron-3", "qwen3_coder"),
    (r"^stepfun-ai/Step-3\.5", "step3p5"),
    (r"^Qwen/Qwen3\.(5|6|8)-", "qwen3_coder"),
    (r"^Qwen/Qwen3-Coder", "qwen3_coder"),
    (r"^Qwen/Qwen3-", "hermes"),
)
REASONING_PARSERS = (
    (r"^arcee-ai/Trinity-(Large-Thinking|Mini|Nano)", "deepseek_r1"),
    (r"^deepseek-ai/DeepSeek-V3\.[12]", "deepseek_r1"),
    (r"^zai-org/GLM-", "glm45"),
    (r"^MiniMaxAI/MiniMax-M2", "minimax_m2_append_think"),
    (r"^poolside/Laguna", "poolside_v1"),
    (r"^PrimeIntellect/INTELLECT-3", "deepseek_r1"),
    (r"^nvidia/NVIDIA-Nemotron-3-Super", "nemotron_v3"),
    (r"^nvidia/NVIDIA-Nemotron-3-Nano", "nano_v3"),
    (r"^nvidia/NVIDIA-Nemotron-3\.5", "nano_v3"),
    (r"^stepfun-ai/Step-3\.5", "step3p5"),
    (r"^Qwen/Qwen3-.*Thinking", "deepseek_r1"),
    (r"^Qwen/Qwen3\.(5|6|8)-", "qwen3"),
)
_PARSERS = {"tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS}


def resolve_parser(key: str, model: str) -> str | None:
    """prime-rl's "auto" for a tool-call / reasoning parser: the parser of `model`'s family, or None."""
    return next((name for pattern, name in _PARSERS[key] if re.search(pattern, model)), None)


def _served_name(cfg: Any) -> str:
    inf_model = cfg.inference.model
    return (inf_model.name if inf_model is not None and inf_model.name else None) or cfg.model.name or ""


def engine_args(cfg: Any) -> dict[str, Any]:
    """{vLLM argument: value} the config adds to hpcrl's own (key_source names where each came from)."""
    inf = cfg.inference
    args = {k: v for k, v in inf.vllm.items() if v is not None}
    for key in _PARSERS:
        if args.get(key) == "auto":
            resolved = resolve_parser(key, _served_name(cfg))
            if resolved is None:
                del args[key]
            else:
                args[key] = resolved
    if "tool_call_parser" in args:  # prime-rl: auto tool choice wherever a tool-call parser is set
        args.setdefault("enable_auto_tool_choice", True)
    connector = kv_connector(inf.kv_cache_offload)
    if connector is not None:
        args["kv_transfer_config"] = connector
        args.setdefault("enable_prefix_caching", True)  # offloading works on prefix-cached blocks
    # prime-rl's fp32 flags are vLLM 0.33's own model-config overrides (FP32_OVERRIDES)
    overrides = dict(args.get("hf_overrides") or {})
    if inf.enable_fp32_lm_head:
        overrides.setdefault("head_dtype", "float32")  # LogitsProcessor: bf16 x bf16 -> fp32 GEMM
    if inf.enable_fp32_router_logits:
        overrides.setdefault("moe_router_dtype", "float32")  # DeepSeek-family gates emit fp32 logits
    if overrides:
        args["hf_overrides"] = overrides
    return args


def kv_connector(offload: Any) -> dict[str, Any] | None:
    """vLLM's kv_transfer_config for `inference.kv_cache_offload` type native (prime-rl's connector:
    OffloadingConnector, a disk tier behind the CPU one as TieringOffloadingSpec); None otherwise."""
    if offload is None or offload.type != "native" or offload.cpu is None:
        return None
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(offload.cpu.num_bytes)}
    if offload.disk is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs_python", "root_dir": offload.disk.path}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def key_source(key: str) -> str:
    """The config key an engine argument came from (for errors)."""
    homes = {"kv_transfer_config": "inference.kv_cache_offload", "quantization": "inference.quantization"}
    return homes.get(key, f"inference.vllm.{key}")


def engine_env(cfg: Any) -> dict[str, str]:
    """What the server process exports before vLLM loads (prime-rl's setup_vllm_env)."""
    deep_gemm = "1" if cfg.inference.use_deep_gemm else "0"
    return {"VLLM_USE_DEEP_GEMM": deep_gemm, "VLLM_MOE_USE_DEEP_GEMM": deep_gemm}


# -- argv ----------------------------------------------------------------------------------------------
def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _action(parser: argparse.ArgumentParser | None, key: str) -> argparse.Action | None:
    if parser is None:
        return None
    return parser._option_string_actions.get(_flag(key))  # noqa: SLF001 (argparse has no public lookup)


def _one(key: str, value: Any, parser: argparse.ArgumentParser | None) -> list[str]:
    flag, action = _flag(key), _action(parser, key)
    if isinstance(value, bool):
        if value:
            return [flag]
        if (
            action is not None
            and not isinstance(action, argparse.BooleanOptionalAction)
            and not action.default
        ):
            return []  # a plain switch that is off by default: off is not saying it
        return ["--no-" + flag[2:]]
    if isinstance(value, list):
        nargs = action.nargs if action is not None else "+"
        if nargs in ("+", "*") or isinstance(nargs, int) and nargs > 1:
            return [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        return [f"{flag}={json.dumps(value)}"]
    text = json.dumps(value) if isinstance(value, dict) else str(value)
    switch = action is not None and action.nargs == 0  # `--x=text`: refused, not read as a positional
    return [f"{flag}={text}"] if switch or text.startswith("-") or not text else [flag, text]


def to_argv(args: Mapping[str, Any], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """`vllm serve` flags for {argument: value}: bools as switches (`--no-x` for off), lists as
    several values where the argument takes several, tables as JSON, the rest as text."""
    out: list[str] = []
    for key, value in args.items():
        if value is not None:
            out += _one(key, value, parser)
    return out


# -- vLLM's own check ----------------------------------------------------------------------------------
class _Refused(Exception):
    pass


@cache
def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's `vllm serve` parser (make_arg_parser on its FlexibleArgumentParser), built once."""
    from hpcrl.inference.vllm_symbols import vllm_symbol

    return vllm_symbol("make_arg_parser")(vllm_symbol("FlexibleArgumentParser")(prog="vllm serve"))


_OPTION_RE = re.compile(r"--([A-Za-z0-9][A-Za-z0-9_.-]*)")


def _named(message: str, user_keys: set[str]) -> str:
    """The config key a message of vLLM's parser is about (`argument --max-num-seqs: ...`)."""
    for m in _OPTION_RE.finditer(message):
        key = m.group(1).split("=", 1)[0].split(".", 1)[0].replace("-", "_").removeprefix("no_")
        if key in user_keys:
            return key_source(key)
    lowered = message.lower()  # validators name an argument in words: "invalid tool call parser: x"
    for key in sorted(user_keys, key=len, reverse=True):
        if key in lowered or key.replace("_", " ") in lowered:
            return key_source(key)
    return "inference.vllm"


def parse(argv: list[str], user_keys: set[str]) -> Any:
    """vLLM's parser and validators on `argv`; a refusal is a ConfigError naming the config key."""
    from hpcrl.inference.vllm_symbols import vllm_symbol, vllm_version

    parser = vllm_parser()

    def refuse(message: str) -> None:
        raise _Refused(message)

    saved = parser.error
    parser.error = refuse  # type: ignore[method-assign]  # argparse would print usage and exit 2
    try:
        args = parser.parse_args(argv)
        vllm_symbol("validate_parsed_serve_args")(args)
        vllm_symbol("validate_api_server_args")(args)
    except (_Refused, ValueError, TypeError, KeyError) as e:  # validate_api_server_args raises KeyError
        message = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        where = _named(message, user_keys)
        if message.startswith("unrecognized arguments"):
            message = f"is not an argument of vLLM {vllm_version()}'s `vllm serve` ({message})"
        else:
            message = f"refused by vLLM {vllm_version()}'s parser: {message}"
        raise ConfigError(where, message) from None
    finally:
        parser.error = saved  # type: ignore[method-assign]
    return args


def check_quantization(name: str | None) -> None:
    """`inference.quantization` is one of the installed vLLM's methods: its parser takes any text and
    its ModelConfig refuses an unknown one only as the server starts."""
    from hpcrl.inference.vllm_symbols import vllm_symbol, vllm_version

    methods = vllm_symbol("QUANTIZATION_METHODS")
    if name is not None and name not in methods:
        online = [m for m in methods if m.startswith(("fp8_", "mxfp"))]
        raise ConfigError(
            "inference.quantization",
            f"{name!r} is not a quantization method of vLLM {vllm_version()} (online FP8: {', '.join(online)})",
        )


def notes(cfg: Any) -> list[str]:
    """One line for each prime-rl inference key that needs GPUs, kernels or processes this run may not
    have, saying what happens here (printed at start and by --dry-run; never a silent no-op)."""
    inf, out = cfg.inference, []
    if inf.use_deep_gemm:
        out.append(
            "inference.use_deep_gemm: vLLM servers start with VLLM_USE_DEEP_GEMM=VLLM_MOE_USE_DEEP_GEMM=1 "
            "(DeepGEMM block-FP8 kernels, Hopper/Blackwell GPUs); the embedded (hf) engine has no such kernels"
        )
    if inf.quantization is not None:
        from hpcrl.inference.fp8 import scheme

        here = (
            "the embedded (hf) engine emulates it (FP8 quantize-dequantize of the linear weights, docs/fp8.md)"
            if scheme(inf.quantization) is not None
            else "the embedded (hf) engine serves the weights unquantized (it emulates the FP8 schemes only)"
        )
        out.append(
            f"inference.quantization = {inf.quantization!r}: vLLM servers quantize the bf16 policy as they load "
            f"it and re-quantize every update; {here}"
        )
    offload = inf.kv_cache_offload
    if offload is not None and offload.type == "mooncake":
        rdma = f" on {offload.device_name}" if offload.device_name else ""
        out.append(
            f"inference.kv_cache_offload: type 'mooncake' needs a Mooncake store{rdma} (a master and a client "
            "per node) that hpcrl does not start; the servers run without KV cache offload"
        )
    elif offload is not None:
        out.append(
            "inference.kv_cache_offload: vLLM servers offload KV blocks to CPU memory (vLLM's OffloadingConnector, "
            "--kv-transfer-config); the embedded (hf) engine keeps no KV cache between requests"
        )
    d = inf.deployment
    unused = ", ".join(_given(inf.deployment, ("type",))) or "none"
    if d.type == "disaggregated":
        out.append(
            f"inference.deployment: type 'disaggregated' ({d.num_prefill_replicas} x {d.prefill_nodes_per_replica} "
            f"prefill + {d.num_decode_replicas} x {d.decode_nodes_per_replica} decode nodes, NIXL KV transfer) "
            "is not built by hpcrl: every server prefills and decodes, placed by [deployment]; what it sets "
            f"({unused}) applies to no process"
        )
    elif d.type == "multi_node" or unused != "none":
        out.append(
            f"inference.deployment: type '{d.type}': hpcrl places inference nodes from [deployment] "
            f"(num_infer_nodes), one server per inference.parallel.tp GPUs; what it sets ({unused}) is not used"
        )
    if inf.router is not None:
        given = ", ".join(_given(inf.router, ("type",)))
        out.append(
            f"inference.router: no {inf.router.type} router runs here ({given or 'defaults'} unused); the "
            "orchestrator spreads requests over the servers itself"
        )
    return out


def _given(section: Any, skip: tuple[str, ...]) -> list[str]:
    """The fields of a section that is only noted (no process reads it here) set away from their
    defaults: the note names them, so none is dropped silently."""
    import msgspec

    default = type(section)()
    return [
        k for k, v in msgspec.structs.asdict(section).items() if k not in skip and v != getattr(default, k)
    ]
