"""`[inference.vllm]` and prime-rl's inference keys through vLLM 0.33's own parser: every key prime-rl's
configs use is accepted and lands in vLLM's namespace with its value (booleans both ways, lists,
tables), the keys that become engine arguments (kv_cache_offload, the fp32 flags) reach vLLM's
engine config, and a refused argument is one ConfigError naming the config key it came from, at
--dry-run as at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import rl_toml
from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from hpcrl.config import ConfigError  # noqa: E402
from hpcrl.inference import vllm_args  # noqa: E402
from hpcrl.inference import vllm_backend as vb  # noqa: E402
from hpcrl.inference.options import ServeOptions  # noqa: E402
from hpcrl.launch import vllm_check  # noqa: E402
from hpcrl.launch.checks import load  # noqa: E402

# Every pass-through key of prime-rl's configs/ and examples/ (2026-08-21), and a few vLLM ones more.
TABLE = """
[inference.vllm]
enable_prefix_caching = true
enable_expert_parallel = true
enable_eplb = false
enable_ep_weight_filter = true
enable_return_routed_experts = true
safetensors_load_strategy = "prefetch"
quantization = "fp8"
tool_call_parser = "glm47"
reasoning_parser = "glm45"
enable_lora = true
max_loras = 4
max_cpu_loras = 100
lora_target_modules = ["q_proj", "v_proj"]
all2all_backend = "deepep_low_latency"
enable_dbo = true
max_num_batched_tokens = 4096
compilation_config = { cudagraph_mode = "FULL_DECODE_ONLY" }
[inference]
use_deep_gemm = true
[inference.kv_cache_offload]
cpu = { num_bytes = 1000000 }
"""


def _cfg(tmp_path: Path, tables: str, model: str = "zai-org/GLM-5-FP8"):
    f = tmp_path / "rl.toml"
    f.write_text(rl_toml(seq_len=64, model=model, tables=tables))
    return load([str(f), "--output-dir", str(tmp_path / "out")]).config


def _namespace(cfg, tmp_path: Path):
    opts = ServeOptions(
        model_name="m",
        backend="vllm",
        port=8000,
        engine_args=vllm_args.engine_args(cfg),
        quantization=cfg.inference.quantization,  # [inference.vllm] quantization's home (prime-rl #3031)
    )
    return vb.parse_serve_args(opts, str(tmp_path))


def test_prime_rl_keys_reach_vllms_namespace(tmp_path: Path) -> None:
    args = _namespace(_cfg(tmp_path, TABLE), tmp_path)
    assert args.enable_prefix_caching is True and args.enable_expert_parallel is True
    assert args.enable_eplb is False and args.enable_ep_weight_filter is True and args.enable_dbo is True
    assert (args.safetensors_load_strategy, args.quantization) == ("prefetch", "fp8")
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice) == (
        "glm47",
        "glm45",
        True,
    )
    assert args.lora_target_modules == ["q_proj", "v_proj"] and (args.max_loras, args.max_cpu_loras) == (
        4,
        100,
    )
    assert args.all2all_backend == "deepep_low_latency" and args.max_num_batched_tokens == 4096
    assert args.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"
    assert args.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert args.kv_transfer_config.kv_connector_extra_config == {"cpu_bytes_to_use": 1000000}
    assert args.hf_overrides == {"head_dtype": "float32", "moe_router_dtype": "float32"}
    # hpcrl's own arguments are still there, untouched by the table
    assert args.worker_extension_cls == vb.EXTENSION_CLS and args.logprobs_mode == "processed_logprobs"


def test_the_engine_config_takes_them(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = AsyncEngineArgs.from_cli_args(_namespace(_cfg(tmp_path, TABLE), tmp_path))
    assert engine.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert engine.hf_overrides["head_dtype"] == "float32" and engine.enable_expert_parallel is True


def test_fp32_head_is_vllms_own_head_dtype() -> None:
    """enable_fp32_lm_head is vLLM 0.33's `head_dtype` override: what its LogitsProcessor computes in."""
    import torch
    from transformers import Qwen3Config
    from vllm.config.model import _get_head_dtype

    config = Qwen3Config()
    config.update({"head_dtype": "float32"})  # what hf_overrides does to the model's config
    assert _get_head_dtype(config, torch.bfloat16, "generate") == torch.float32
    assert _get_head_dtype(Qwen3Config(), torch.bfloat16, "generate") == torch.bfloat16  # off: model dtype


def test_fp32_router_logits_is_what_deepseek_reads() -> None:
    import torch
    from transformers import DeepseekV3Config
    from vllm.model_executor.models.deepseek_v2 import _get_moe_router_dtype

    config = DeepseekV3Config()
    assert _get_moe_router_dtype(config) is None
    config.update({"moe_router_dtype": "float32"})
    assert _get_moe_router_dtype(config) == torch.float32


def test_a_switch_turned_off_is_rendered_as_vllm_reads_it(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "[inference.vllm]\nheadless = false\nenable_prefix_caching = false\n")
    parser = vllm_args.vllm_parser()
    argv = vllm_args.to_argv(vllm_args.engine_args(cfg), parser)
    assert "--no-enable-prefix-caching" in argv and not any("headless" in a for a in argv)  # a plain switch
    assert _namespace(cfg, tmp_path).enable_prefix_caching is False


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ("foo_bar = 1", r"^inference\.vllm\.foo_bar: is not an argument of vLLM 0\.33\.\d+'s `vllm serve`"),
        ("rope_scaling = { rope_type = 'yarn' }", r"^inference\.vllm\.rope_scaling: is not an argument"),
        (
            "max_num_batched_tokens = 'lots'",
            r"^inference\.vllm\.max_num_batched_tokens: refused by vLLM .*invalid",
        ),
        (
            "all2all_backend = 'nope'",
            r"^inference\.vllm\.all2all_backend: refused by vLLM .*invalid choice: 'nope'",
        ),
        (
            "tool_call_parser = 'nosuchparser'",
            r"^inference\.vllm\.tool_call_parser: refused by vLLM .*nosuchparser",
        ),
        ("enable_eplb = 'maybe'", r"^inference\.vllm\.enable_eplb: refused by vLLM"),
    ],
)
def test_a_refused_argument_names_its_key(tmp_path: Path, table: str, error: str) -> None:
    cfg = _cfg(tmp_path, f"[inference.vllm]\n{table}\n")
    with pytest.raises(ConfigError, match=error):
        vllm_check.dry_run_lines(cfg)  # --dry-run
    with pytest.raises(ConfigError, match=error):
        _namespace(cfg, tmp_path)  # at start, the same check


def test_dry_run_accepts_them(tmp_path: Path) -> None:
    (line,) = vllm_check.dry_run_lines(_cfg(tmp_path, TABLE))
    assert line.startswith("inference.vllm: 17 argument(s) (enable_prefix_caching, ") and line.endswith(
        f"accepted by vLLM {vllm.__version__}'s parser; servers started on this machine (no GPU) run the embedded hf engine"
    )


def test_deep_gemm_reaches_the_server_environment(tmp_path: Path) -> None:
    from hpcrl.inference.server import serve_options

    cfg = _cfg(tmp_path, TABLE, model="hpcrl/tiny-qwen3")
    cfg.inference.backend = "vllm"
    opts = serve_options(cfg)
    assert opts.engine_env == {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "1"}
    assert opts.quantization == "fp8" and "quantization" not in opts.engine_args  # moved to its field
    assert vb.hpcrl_args(opts, "m")["quantization"] == "fp8"  # what serve() hands to vLLM
