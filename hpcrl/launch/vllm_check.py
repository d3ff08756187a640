"""--dry-run of `[inference.vllm]`: the arguments a vLLM server of this run would start with, through
vLLM's own parser and validators where vLLM is installed (hpcrl.inference.vllm_args.parse), else one
line saying vLLM checks them when a server starts (docs/inference.md)."""

from __future__ import annotations

from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.inference.vllm_args import check_quantization, engine_args, parse, vllm_parser


def dry_run_lines(cfg: Any) -> list[str]:
    """The dry run's line about [inference.vllm] (none when it is empty); a ConfigError naming the key
    vLLM's parser refuses."""
    import importlib.util

    args = engine_args(cfg)
    user = [k for k in cfg.inference.vllm]
    shown = ", ".join(user) if user else "none"
    if cfg.inference.backend == "hf":
        if not user:
            return []
        return [
            f"inference.vllm: {len(user)} argument(s) ({shown}) unused: inference.backend = 'hf' starts no vLLM"
        ]
    if cfg.inference.quantization is not None:  # hpcrl's field, but its value is vLLM's to accept
        user.append("quantization")
        shown = ", ".join(user)
    if not user and cfg.inference.kv_cache_offload is None:
        return []  # only hpcrl's own arguments: the conformance tests check those against vLLM
    if importlib.util.find_spec("vllm") is None:
        return [
            f"inference.vllm: {len(user)} argument(s) ({shown}) will be checked by vLLM's parser when a vLLM "
            "server starts (vLLM is not installed here)"
        ]
    from dataclasses import replace

    from hpcrl.inference.server import serve_options
    from hpcrl.inference.vllm_backend import vllm_serve_argv
    from hpcrl.inference.vllm_symbols import vllm_version

    base = serve_options(cfg)
    opts = replace(base, backend="vllm", engine_args=args)  # what a vLLM server would get
    try:
        parser = vllm_parser()
    except ConfigError as e:  # an installed vLLM that does not import: say so, a server would fail too
        return [f"inference.vllm: {len(user)} argument(s) ({shown}) not checked: {e.message}"]
    parse(vllm_serve_argv(opts, opts.model_name, parser), set(args) | set(user))
    check_quantization(cfg.inference.quantization)
    here = (
        ""
        if base.backend == "vllm"
        else "; servers started on this machine (no GPU) run the embedded hf engine"
    )
    return [
        f"inference.vllm: {len(user)} argument(s) ({shown}) accepted by vLLM {vllm_version()}'s parser{here}"
    ]
