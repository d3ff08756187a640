"""The `vllm serve` argv hpcrl renders parses with vLLM 0.33's own parser and validators."""

from __future__ import annotations

import pytest

from hpcrl.net import free_port
from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from hpcrl.inference import vllm_backend as vb  # noqa: E402
from hpcrl.inference.options import ServeOptions, bind_server_socket  # noqa: E402

CONFIGS = {
    "tp1": dict(tp=1),
    "tp2_lora": dict(tp=2, lora_rank=16, host="0.0.0.0", api_key="k"),  # non-loopback needs a key
    "lora_rank_rounded_up": dict(lora_rank=20, gpu_memory_utilization=0.85),
    "lora_rank_1_eager": dict(lora_rank=1, enforce_eager=True, dtype="bfloat16"),
    "extra_args": dict(tp=2, vllm_args=["--max-num-batched-tokens", "4096", "--enable-prefix-caching"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_argv_parses_and_validates(name, tmp_path):
    kw = CONFIGS[name]
    opts = ServeOptions(
        model_name="hpcrl/tiny-qwen3",
        served_model_name="policy",
        backend="vllm",
        port=free_port(),
        max_model_len=512,
        max_batch_size=8,
        seed=7,
        **kw,
    )
    opts.validate()
    args = vb.parse_serve_args(opts, str(tmp_path))  # make_arg_parser + both validators
    assert args.model == str(tmp_path)
    assert (args.host, args.port) == (opts.host, opts.port)
    assert args.tensor_parallel_size == opts.tp
    assert args.served_model_name == ["policy"]
    assert (args.max_model_len, args.max_num_seqs, args.seed) == (512, 8, 7)
    assert args.worker_extension_cls == vb.EXTENSION_CLS
    assert args.logprobs_mode == "processed_logprobs"
    assert args.enable_scale_out is True  # serves /inference/v1/generate (test_generate_route.py)
    assert bool(args.enable_lora) is (opts.lora_rank is not None)  # None (unset) when off
    if opts.lora_rank is not None:
        assert args.max_lora_rank == vb.vllm_lora_rank(opts.lora_rank) >= opts.lora_rank
    if opts.gpu_memory_utilization is not None:
        assert args.gpu_memory_utilization == opts.gpu_memory_utilization
    assert args.enforce_eager is opts.enforce_eager
    if opts.vllm_args:
        assert args.max_num_batched_tokens == 4096 and args.enable_prefix_caching is True


def test_engine_args_accept_the_parsed_namespace(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    opts = ServeOptions(model_name="m", backend="vllm", port=free_port(), tp=2, lora_rank=64)
    engine_args = AsyncEngineArgs.from_cli_args(vb.parse_serve_args(opts, str(tmp_path)))
    assert (engine_args.tensor_parallel_size, engine_args.enable_lora, engine_args.max_lora_rank) == (
        2,
        True,
        64,
    )
    assert engine_args.worker_extension_cls == vb.EXTENSION_CLS


def test_vllm_rejects_an_unrounded_lora_rank(tmp_path):
    # Why vllm_lora_rank exists: vLLM only takes its listed ranks.
    opts = ServeOptions(model_name="m", backend="vllm", port=free_port(), vllm_args=["--max-lora-rank", "20"])
    with pytest.raises(SystemExit):
        vb.parse_serve_args(opts, str(tmp_path))


def test_port_zero_becomes_the_bound_port(tmp_path):
    opts = ServeOptions(model_name="m", backend="vllm", port=0, tp=2)
    sock, ready, args = vb.prepare(opts, str(tmp_path))
    try:
        port = sock.getsockname()[1]
        assert port != 0 and ready.port == port and args.port == port
        with pytest.raises(ValueError, match="server.port"):  # nobody else can take it meanwhile
            bind_server_socket("127.0.0.1", port).close()
    finally:
        sock.close()
