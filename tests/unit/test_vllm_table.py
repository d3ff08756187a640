"""prime-rl's inference keys in the main venv (vLLM absent): `[inference.vllm]` aliases, conflicts and
refusals, the engine arguments and environment they become, the notes of the GPU-only keys, and the
dry run's line where vLLM is not installed. vLLM's own parser on the same arguments:
tests/vllm_conformance/test_engine_args.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.inference import vllm_args
from hpcrl.launch.checks import load
from tests.conftest import rl_toml

REPO = Path(__file__).resolve().parents[2]
BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']

# prime-rl's [inference.vllm] keys of its own configs (configs/, examples/ at 2026-08-21)
PRIME_TABLE = """
[inference.vllm]
max_model_len = 2048
tensor_parallel_size = 2
data_parallel_size = 2
gpu_memory_utilization = 0.80
enable_prefix_caching = true
enable_expert_parallel = true
enable_eplb = false
enable_ep_weight_filter = true
enable_return_routed_experts = true
safetensors_load_strategy = "prefetch"
quantization = "fp8"
tool_call_parser = "auto"
reasoning_parser = "glm45"
"""


def _load(tmp_path: Path, tables: str, top: str = "", model: str = "hpcrl/tiny-qwen3", *flags: str):
    f = tmp_path / "rl.toml"
    f.write_text(rl_toml(seq_len=64, top=top, model=model, tables=tables))
    return load([str(f), *flags]).config


def test_keys_that_are_hpcrl_fields_move_there(tmp_path: Path) -> None:
    cfg = _load(tmp_path, PRIME_TABLE + "[deployment]\nnum_train_gpus = 4\nnum_infer_gpus = 4\n")
    inf = cfg.inference
    assert (inf.max_model_len, inf.parallel.tp, inf.parallel.dp, inf.gpu_memory_utilization) == (
        2048,
        2,
        2,
        0.8,
    )
    assert "tensor_parallel_size" not in inf.vllm and "max_model_len" not in inf.vllm
    assert inf.vllm["enable_expert_parallel"] is True and inf.quantization == "fp8"  # its field (#3031)
    assert "quantization" not in inf.vllm


@pytest.mark.parametrize(
    ("flags", "moved"),
    [
        (["--inference.vllm.max-num-seqs", "8"], ("max_batch_size", 8)),
        (["--inference.vllm.enforce-eager", "true"], ("enforce_eager", True)),
        (["--inference.vllm.seed", "7"], ("seed", 7)),
        (["--inference.vllm", "{tensor-parallel-size = 2}"], ("parallel.tp", 2)),  # a flag's spelling
    ],
)
def test_flags_into_the_table(flags: list[str], moved: tuple[str, object]) -> None:
    cfg = load([*BASE, *flags]).config
    obj = cfg.inference
    for part in moved[0].split("."):
        obj = getattr(obj, part)
    assert obj == moved[1] and not cfg.inference.vllm


def test_model_keys_move_to_the_servers_model(tmp_path: Path) -> None:
    cfg = load(["--orchestrator.train.env", '[{id = "reverse-text"}]', "--model.name", "hpcrl/tiny-qwen3",
                "--inference.vllm", '{model = "hpcrl/tiny-qwen3", dtype = "bfloat16", max_lora_rank = 16}']).config  # fmt: skip
    assert (cfg.inference.model.name, cfg.inference.model.dtype, cfg.inference.model.max_lora_rank) == (
        "hpcrl/tiny-qwen3",
        "bfloat16",
        16,
    )


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--inference.vllm.tensor-parallel-size", "2", "--inference.parallel.tp", "4"],
         r"^inference\.vllm\.tensor_parallel_size: 2 conflicts with inference\.parallel\.tp = 4"),
        (["--inference.vllm.max-model-len", "4096", "--inference.max-model-len", "1024"],
         r"^inference\.vllm\.max_model_len: 4096 conflicts with inference\.max_model_len = 1024"),
        (["--inference.vllm.max-num-seqs", "lots"], r"^inference\.vllm\.max_num_seqs: 'lots': expected `int`"),
        (["--inference.vllm.port", "9000"], r"^inference\.vllm\.port: is set by hpcrl from server\.port"),
        (["--inference.vllm.kv-transfer-config", "{}"], r"^inference\.vllm\.kv_transfer_config: .*kv_cache_offload"),
        (["--inference.vllm.worker-extension-cls", "my.Ext"], r"^inference\.vllm\.worker_extension_cls: cannot be set"),
        (["--inference.vllm.logprobs-mode", "raw_logprobs"], r"^inference\.vllm\.logprobs_mode: must be 'processed_logprobs'"),
        (["--inference.vllm.hf-overrides", '{head_dtype = "model"}'],
         r"^inference\.vllm\.hf_overrides\.head_dtype: = 'model' conflicts with inference\.enable_fp32_lm_head = True"),
        (["--inference.vllm", "{enable_eplb = true, enable-eplb = false}"], r"^inference\.vllm\.enable-eplb: is set twice"),
        (["--inference.vllm.data-parallel-size", "3", "--deployment.num-train-gpus", "2",
          "--deployment.num-infer-gpus", "4"], r"^inference\.parallel\.dp: 3 \(vLLM's data_parallel_size\) but hpcrl runs 4"),
        (["--inference.vllm.enable-prefix-caching", "false", "--inference.kv-cache-offload.cpu.num-bytes", "9"],
         r"^inference\.vllm\.enable_prefix_caching: is false, but inference\.kv_cache_offload needs"),
    ],
)  # fmt: skip
def test_one_home_refusals_name_the_key(flags: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load([*BASE, *flags])


def test_logprobs_mode_that_hpcrl_uses_is_accepted() -> None:
    cfg = load([*BASE, "--inference.vllm.logprobs-mode", "processed_logprobs"]).config
    assert cfg.inference.vllm == {"logprobs_mode": "processed_logprobs"}


def test_engine_args_and_env(tmp_path: Path) -> None:
    tables = PRIME_TABLE.replace(
        'tool_call_parser = "auto"', 'tool_call_parser = "auto"\nhf_overrides = {rope_theta = 1e6}'
    )
    tables += "[inference]\nuse_deep_gemm = true\nenable_fp32_router_logits = false\n"
    tables += '[inference.kv_cache_offload]\ntype = "native"\ncpu = {num_bytes = 1000}\ndisk = {path = "/nvme/kv"}\n'
    cfg = _load(tmp_path, tables, "", "zai-org/GLM-5-FP8")
    args = vllm_args.engine_args(cfg)
    assert (
        args["tool_call_parser"] == "glm47" and args["enable_auto_tool_choice"] is True
    )  # prime-rl's "auto"
    assert args["hf_overrides"] == {"rope_theta": 1e6, "head_dtype": "float32"}  # router logits turned off
    assert args["kv_transfer_config"] == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1000,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs_python", "root_dir": "/nvme/kv"}],
        },
    }
    assert vllm_args.engine_env(cfg) == {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "1"}
    argv = vllm_args.to_argv(args)
    assert "--quantization" not in argv and "--no-enable-eplb" in argv  # quantization: from its field
    assert cfg.inference.quantization == "fp8"
    assert '{"kv_connector": "OffloadingConnector"' in argv[argv.index("--kv-transfer-config") + 1]


def test_auto_parsers_without_a_known_family_are_left_off(tmp_path: Path) -> None:
    cfg = _load(tmp_path, '[inference.vllm]\ntool_call_parser = "auto"\nreasoning_parser = "auto"\n')
    args = vllm_args.engine_args(cfg)
    assert (
        "tool_call_parser" not in args
        and "reasoning_parser" not in args
        and "enable_auto_tool_choice" not in args
    )


def test_notes_say_what_happens_to_gpu_only_keys(tmp_path: Path) -> None:
    tables = (
        "[inference]\nuse_deep_gemm = true\n"
        '[inference.kv_cache_offload]\ntype = "mooncake"\ncpu = {num_bytes = 1000}\n'
        '[inference.deployment]\ntype = "disaggregated"\nprefill_nodes_per_replica = 2\nnum_prefill_replicas = 4\n'
        'decode_nodes_per_replica = 8\n[inference.deployment.prefill_env_vars]\nVLLM_ENABLE_MOE_DP_CHUNK = "0"\n'
        "[inference.deployment.decode_vllm_overrides]\nmax_num_seqs = 96\n"
        '[inference.router]\ntype = "llm-d"\nscorers = {"prefix-cache-scorer" = 3.0}\n'
    )
    f = tmp_path / "rl.toml"
    f.write_text(rl_toml(seq_len=64, tables=tables))
    notes = load([str(f)]).notes
    text = "\n".join(notes)
    for key in (
        "use_deep_gemm",
        "kv_cache_offload: type 'mooncake'",
        "deployment: type 'disaggregated'",
        "router",
    ):
        assert f"inference.{key}" in text, text
    assert "4 x 2 prefill + 1 x 8 decode nodes" in text


def test_dry_run_says_vllm_checks_them_at_start(tmp_path: Path) -> None:
    """`hpcrl run --dry-run` where vLLM is not installed: one line, and the notes."""
    f = tmp_path / "rl.toml"
    f.write_text(rl_toml(seq_len=64, tables=PRIME_TABLE + "[inference]\nuse_deep_gemm = true\n"))
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "run", str(f), "--dry-run", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "inference.vllm: 9 argument(s) (enable_prefix_caching, enable_expert_parallel, enable_eplb, "
        "enable_ep_weight_filter, enable_return_routed_experts, safetensors_load_strategy, "
        "tool_call_parser, reasoning_parser, quantization) will be checked by vLLM's parser when a vLLM server starts "
        "(vLLM is not installed here)"
    ) in r.stdout
    assert "note:         inference.use_deep_gemm: vLLM servers start with VLLM_USE_DEEP_GEMM" in r.stdout


def test_resolved_config_reloads_to_the_same(tmp_path: Path) -> None:
    from hpcrl.config.resolved import to_dict, write_resolved

    cfg = _load(tmp_path, PRIME_TABLE, 'env_vars = { A = "1" }\n')
    write_resolved(cfg, tmp_path / "configs")
    again = load(["@", str(tmp_path / "configs" / "inference.toml")]).config
    assert to_dict(again) == to_dict(cfg)


def test_pipeline_parallel_counts_weight_receivers() -> None:
    from hpcrl.inference.options import weight_receivers

    assert weight_receivers("vllm", [], 2, {"pipeline_parallel_size": 3}) == 6
    with pytest.raises(ConfigError, match=r"^inference\.vllm\.pipeline_parallel_size"):
        weight_receivers("vllm", [], 2, {"pipeline_parallel_size": "x"})
