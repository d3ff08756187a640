"""The --dry-run memory plan (hpcrl/launch/memory_plan.py) and architecture lookup (hpcrl/models/arch.py),
against numbers worked out by hand here."""

from __future__ import annotations

import json

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch import memory_plan as mp
from hpcrl.launch.checks import load
from hpcrl.launch.placement import slurm_placement
from hpcrl.models.arch import KNOWN, find_arch, from_config
from hpcrl.models.hub import seed_cache

GIB = 1024**3
Q8B = from_config(KNOWN["Qwen/Qwen3-8B"], "test")
Q30B = from_config(KNOWN["Qwen/Qwen3-30B-A3B"], "test")


def test_parameter_counts_by_hand():
    # Qwen3-8B: embed + untied head 2 x 151936 x 4096 = 1,244,659,712 (+ final norm 4096); a layer:
    # q,k,v 4096 x (4096 + 2 x 1024) + o 4096 x 4096 = 41,943,040, norms 2 x 128 + 2 x 4096 = 8,448,
    # MLP 3 x 4096 x 12288 = 150,994,944 -> 192,946,432; x 36 layers. The published 8.2 B.
    assert Q8B.dense_layer_params == 192_946_432
    assert Q8B.params == 1_244_663_808 + 36 * 192_946_432 == 8_190_735_360
    assert Q8B.params * 2 / 1e9 == pytest.approx(16.38, abs=0.01)  # 16.4 GB in bf16
    # Qwen3-30B-A3B: 128 experts x 3 x 2048 x 768 = 603,979,776 per layer; the published 30.5 B.
    assert Q30B.expert_layer_params == 603_979_776
    assert Q30B.dense_layer_params == 2048 * 5120 + 4096 * 2048 + 256 + 4096 + 2048 * 128 == 19_140_864
    assert Q30B.params / 1e9 == pytest.approx(30.53, abs=0.01)
    assert from_config(KNOWN["Qwen/Qwen3-235B-A22B"], "t").params / 1e9 == pytest.approx(235.09, abs=0.01)


@pytest.mark.parametrize(
    ("sparse", "moe_layers", "params"),
    [  # 6 layers; a layer's attention 64 x (64 + 2 x 32) + 64 x 64 + norms 2 x 16 + 2 x 64 = 12,448;
        # router 64 x 8 = 512; experts 8 x 3 x 64 x 32 = 49,152; a dense layer's MLP 3 x 64 x 128 = 24,576;
        # untied embedding + head + final norm 2 x 100 x 64 + 64 = 12,864
        ({}, 6, 12_864 + 6 * (12_448 + 512 + 49_152)),  # 385,536
        ({"decoder_sparse_step": 2}, 3, 12_864 + 3 * 62_112 + 3 * (12_448 + 24_576)),  # 310,272
        ({"mlp_only_layers": [0]}, 5, 12_864 + 5 * 62_112 + 37_024),  # 360,448
        ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, 1, 12_864 + 62_112 + 5 * 37_024),  # 260,096
    ],
)
def test_moe_models_with_dense_layers_count_them(sparse, moe_layers, params):
    """Qwen-MoE's decoder_sparse_step / mlp_only_layers: dense layers carry an MLP, no router or experts
    (the counts equal transformers' Qwen3MoeForCausalLM's numel for these configs)."""
    c = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=100, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, **sparse)  # fmt: skip
    a = from_config(c, "test")
    assert (a.moe_layers, a.params, a.expert_params) == (moe_layers, params, moe_layers * 49_152)


def items(arch, **kw):
    base = dict(ranks=8, ep=1, cp=1, tokens=4096, compute="bfloat16", master="float32", reduce="float32",
                optimizer="adamw", ac=False, chunk=None)  # fmt: skip
    return {i.name: i.gib for i in mp.trainer_items(arch, **{**base, **kw})}


def test_dense_8b_on_8_fsdp_ranks():
    got = items(Q8B)
    shard = 8_190_735_360 * 4 / 8  # fp32 master shard: 4,095,367,680 B
    assert got["parameters"] == pytest.approx(shard / GIB) == pytest.approx(3.814, abs=1e-3)
    assert got["gradients"] == pytest.approx(shard / GIB)
    assert got["optimizer"] == pytest.approx(2 * shard / GIB)
    # root (LM head 151,936 x 4096 + norm 4096 = 622,333,952; the untied embedding is resharded after
    # the forward) + 2 layers in bf16, one layer's gradients in fp32
    assert got["gathered"] * GIB == pytest.approx((622_333_952 + 2 * 192_946_432) * 2 + 192_946_432 * 4)
    # per token per layer: 4 x 4096 + 6 x (4096 + 2 x 1024) + 4 x 12288 = 102,400 elements (bf16)
    assert got["activations"] * GIB == pytest.approx(4096 * 36 * 102_400 * 2)  # 28.13 GiB
    assert got["logits"] * GIB == pytest.approx(4096 * 151_936 * (2 + 12))  # 8.11 GiB
    on = items(Q8B, ac=True, chunk=1024)
    assert on["activations"] * GIB == pytest.approx(4096 * (36 * 4096 + 102_400) * 2)  # 1.91 GiB
    assert on["logits"] * GIB == pytest.approx(1024 * 151_936 * (2 + 4))  # one fp32 buffer a chunk
    # offloaded: the 36 checkpointed inputs are in host memory, one layer is recomputed on the GPU
    assert items(Q8B, ac=True, offload=True)["activations"] * GIB == pytest.approx(4096 * 102_400 * 2)
    assert items(Q8B, cp=2)["activations"] == pytest.approx(got["activations"] / 2)
    # SGD: its momentum buffer (prime-rl's default momentum 0.9), half AdamW's two moments; sign SGD none
    assert items(Q8B, optimizer="sgd")["optimizer"] == pytest.approx(got["optimizer"] / 2)
    assert items(Q8B, optimizer="sign_sgd")["optimizer"] == 0
    # vocabulary-parallel under cp 2: half the head's rows gathered, half the chunk's columns, and a
    # chunk even when chunking is off (the head always chunks then); without cp it changes nothing
    vp = items(Q8B, cp=2, vocab_parallel=True)
    assert vp["gathered"] * GIB == pytest.approx(
        (75_968 * 4096 + 4096 + 2 * 192_946_432) * 2 + 192_946_432 * 4
    )
    # + the cp group's gathered hidden states and their gradient: 2 x (2 x 2048) x 4096 bf16
    assert vp["logits"] * GIB == pytest.approx(256 * 75_968 * (2 + 4) + 2 * 2 * 2048 * 4096 * 2)
    assert items(Q8B, vocab_parallel=True) == got


def test_vocab_parallel_chunk_is_the_trainers():
    from hpcrl.models.chunked import DEFAULT_CHUNK

    assert mp.VOCAB_PARALLEL_CHUNK == DEFAULT_CHUNK


def test_expert_parallelism_shards_experts_within_a_position_and_gathers_a_layers_share():
    """hpcrl's EP: an ep position computes with E / ep experts, FSDP-sharded over the N / ep ranks that
    share it (gathered a layer at a time); the non-expert parameters stay FSDP-sharded over all N ranks.
    Every rank stores P / N; with N = ep the experts are whole and never gathered."""
    ep1, ep8 = items(Q30B, ranks=16), items(Q30B, ranks=16, ep=8)
    assert ep1["parameters"] == pytest.approx(Q30B.params * 4 / 16 / GIB)  # 7.11 GiB
    experts = 48 * 603_979_776  # 128 experts x 3 x 2048 x 768 per layer
    assert Q30B.expert_params == experts
    assert ep8["parameters"] == ep1["parameters"]  # 7.11 GiB (13.86 when experts were replicated over 2)
    assert ep8["optimizer"] == pytest.approx(2 * ep8["parameters"])
    layer8 = 19_140_864 + 603_979_776 / 8  # attention + router + this position's 16 experts
    head = 151_936 * 2048 + 2048  # the untied embedding is resharded after the forward
    assert ep8["gathered"] * GIB == pytest.approx((head + 2 * layer8) * 2 + layer8 * 4)
    assert ep8["gathered"] < ep1["gathered"] / 3  # a layer gathers 1/8 of its experts
    whole = items(Q30B, ranks=8, ep=8)  # one position per rank: experts stored whole, never gathered
    assert whole["gathered"] * GIB == pytest.approx((head + 2 * 19_140_864) * 2 + 19_140_864 * 4)
    # MoE activations: the MLP term is top_k x moe_intermediate and each token is dispatched top_k times
    per = 4 * 2048 + 6 * (4096 + 1024) + 4 * 8 * 768 + 2 * 8 * 2048
    assert ep8["activations"] * GIB == pytest.approx(4096 * 48 * per * 2)


def test_inference_gpu_weights_and_kv_budget():
    rows, tokens = mp.inference_items(Q8B, tp=1, dtype="bfloat16", limit_gib=80, utilization=0.9)
    got = {i.name: i.gib for i in rows}
    assert got["weights"] * GIB == pytest.approx(8_190_735_360 * 2)  # 15.26 GiB
    assert got["KV cache"] == pytest.approx(72 - got["weights"] - mp.INFER_RESERVE_GIB)
    assert tokens == int(got["KV cache"] * GIB // (2 * 36 * 8 * 128 * 2))  # 144 KiB a token
    # tp 8 over 4 kv heads: one (replicated) kv head per GPU
    _, t30 = mp.inference_items(Q30B, tp=8, dtype="bfloat16", limit_gib=80, utilization=0.9)
    kv = 72 - Q30B.params * 2 / 8 / GIB - 2
    assert t30 == int(kv * GIB // (2 * 48 * 1 * 128 * 2))


def test_ep_groups():
    assert mp.ep_groups(16, 8) == [list(range(8)), list(range(8, 16))]
    assert mp.expert_shard_groups(16, 8)[:2] == [[0, 8], [1, 9]]
    assert mp.ep_groups(4, 1) == [[0], [1], [2], [3]] and mp.ep_lines(4, 1, 4, 8) == []
    with pytest.raises(ConfigError) as e:
        mp.ep_groups(12, 8)
    assert e.value.path == "trainer.model.ep" and "trainer ranks (12)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        mp.ep_lines(6, 3, 6, 128)
    assert "128 experts" in str(e.value)
    lines = mp.ep_lines(16, 8, 8, 128)
    assert "2 x 8 ranks" in lines[0] and "[0-7] [8-15]" in lines[0] and "16 experts per rank" in lines[0]
    assert (
        "[0,8] [1,9]" in lines[1] and "FSDP over the 2 ranks" in lines[1] and "8 experts stored" in lines[1]
    )
    assert not any("spans nodes" in x for x in lines)
    assert len(mp.ep_lines(8, 8, 8, 128)) == 1  # one ep group: experts whole, nothing shared
    assert "spans nodes" in mp.ep_lines(16, 16, 8, 128)[-1]


def test_architecture_sources(tmp_path):
    assert "built-in table (Qwen/Qwen3-30B-A3B" in find_arch("Qwen/Qwen3-30B-A3B-Thinking-2507").source
    assert find_arch("someone/unknown-model") is None and find_arch(None) is None
    cfg = dict(KNOWN["Qwen/Qwen3-8B"], num_hidden_layers=2)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": cfg}))
    assert find_arch(str(model)).layers == 2
    cache = tmp_path / "hub"
    seed_cache(model, "someone/cached-model", cache)
    arch = find_arch("someone/cached-model", cache_dir=str(cache))
    assert arch.layers == 2 and "HF cache" in arch.source


def cfg_of(*args, nodes=True):
    base = ["--model.name", "Qwen/Qwen3-8B", "--orchestrator.train.env", '[{id = "reverse-text"}]',
            "--slurm.time", "01:00:00"]  # fmt: skip
    if nodes:
        base += ["--deployment.num-train-nodes", "1", "--deployment.num-infer-nodes", "1"]
    return load([*base, *args]).config


def test_a_plan_that_cannot_fit_is_refused_in_one_line():
    cfg = cfg_of("--seq-len", "32768")
    placement = slurm_placement(cfg)
    with pytest.raises(ConfigError) as e:
        mp.dry_run_lines(cfg, placement)
    msg = str(e.value)
    assert e.value.path == "trainer.model.activation_checkpointing" and "\n" not in msg
    assert "a trainer rank needs" in msg and "of 80 GiB" in msg and "deployment.gpu_memory_gib" in msg
    # the same job computing on CPU: information only
    cpu = cfg_of("--seq-len", "32768", "--deployment.compute", "cpu")
    assert "not checked" in mp.dry_run_lines(cpu, slurm_placement(cpu))[-1]
    fits = cfg_of("--seq-len", "4096", "--trainer.model.activation-checkpointing")
    lines = mp.dry_run_lines(fits, slurm_placement(fits))
    assert lines[0].startswith("memory plan:  Qwen/Qwen3-8B: 8.19 B params")
    assert "trainer rank (8 ranks, FSDP 8; bf16 compute, fp32 master)" in lines[1] and "of 80 GiB" in lines[1]
    small = cfg_of(
        "--seq-len",
        "4096",
        "--trainer.model.activation-checkpointing",
        "--inference.gpu-memory-utilization",
        "0.2",
    )
    with pytest.raises(ConfigError) as e:
        mp.dry_run_lines(small, slurm_placement(small))  # 15.3 GiB of bf16 weights in 16 GiB
    assert "KV cache holds 0 tokens" in str(e.value) and "inference.parallel.tp" in str(e.value)


def test_gpu_memory_gib_must_be_positive():
    with pytest.raises(ConfigError) as e:
        cfg_of("--deployment.gpu-memory-gib", "0")
    assert "deployment.gpu_memory_gib" in str(e.value)


def test_lora_trains_only_the_adapter():
    # r x (in + out) per projection, Qwen3-8B, r 16: q 16 x 8192, k and v 16 x 5120, o 16 x 8192,
    # gate and up 16 x 16384, down 16 x 16384 -> 1,212,416 a layer, x 36
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    n = mp.lora_param_count(Q8B, 16, targets)
    assert n == 36 * 1_212_416
    got = items(Q8B, lora_params=n)
    assert got["gradients"] * GIB == pytest.approx(n * 4 / 8) and got["optimizer"] * GIB == pytest.approx(
        n * 8 / 8
    )
    assert got["parameters"] == pytest.approx(items(Q8B)["parameters"])  # the frozen base is still sharded


def test_one_machine_with_gpus_names_the_gpu_count_to_raise():
    from hpcrl.launch.placement import local_placement

    cfg = cfg_of(
        "--deployment.num-train-gpus",
        "1",
        "--deployment.num-infer-gpus",
        "1",
        "--seq-len",
        "2048",
        nodes=False,
    )
    with pytest.raises(ConfigError) as e:  # 8.19 B x 16 bytes of master state on one GPU
        mp.dry_run_lines(cfg, local_placement(cfg, gpus_available=2))
    assert e.value.path == "deployment.num_train_gpus" and "a trainer rank needs 1" in str(e.value)


def test_flash_attention_3_against_the_nodes_gpu_types():
    """FA3 needs Hopper or newer: refused on a100 nodes, a note where the GPU type is unknown."""
    from types import SimpleNamespace

    from hpcrl.config import ConfigError
    from hpcrl.launch.attention_check import attention_lines

    model = SimpleNamespace(attn="flash_attention_3")
    cfg = SimpleNamespace(trainer=SimpleNamespace(model=model), model=model)
    gpu = SimpleNamespace(uses_gpus=True, cpu_compute=False)
    with pytest.raises(ConfigError, match=r"^trainer\.model\.attn: flash_attention_3 needs Hopper.*a100"):
        attention_lines(cfg, gpu, {"a100"})
    assert not any("Hopper" in line for line in attention_lines(cfg, gpu, {"h100"}))
    assert any("no GPU type" in line for line in attention_lines(cfg, gpu, set()))
    cpu = SimpleNamespace(uses_gpus=True, cpu_compute=True)
    assert "SDPA" in attention_lines(cfg, cpu, {"a100"})[0]
    model.attn = "sdpa"
    assert attention_lines(cfg, gpu, {"a100"}) == []


@pytest.mark.parametrize("name", sorted(__import__("hpcrl.models.names", fromlist=["x"]).BUILTIN_MODELS))
def test_every_builtin_model_has_an_arch_before_it_is_built(name, tmp_path, monkeypatch):
    """The preset stands in for a model not built yet: MoE presets and 'preset:template' names too."""
    from hpcrl.models import arch, resolve

    monkeypatch.setattr(resolve, "cache_root", lambda: tmp_path)
    a = arch.find_arch(name)
    assert a is not None and a.layers >= 2
    assert a.moe == ("moe" in name)


def test_chunk_is_bounded_in_bytes_as_the_trainer_bounds_it():
    cfg = cfg_of("--trainer.model.logprobs-chunk-mib", "32")  # 32 MiB: 55 rows at vocab 151,936
    assert mp.chunk_tokens(cfg, 151_936) == 55 and mp.chunk_tokens(cfg, 32_000) == 256
    assert mp.chunk_tokens(cfg_of(), 151_936) == 256  # default: no byte bound
    assert mp.chunk_tokens(cfg_of("--trainer.model.logprobs-chunk-tokens", "0"), 151_936) is None


# -- the weight sync (issue 49, protocol 4): "weight publish" on a trainer GPU, "weight receive" on an
# inference GPU, outside vLLM's pool ------------------------------------------------------------------
Q235B = from_config(KNOWN["Qwen/Qwen3-235B-A22B"], "test")
MIB = 1024**2


def shipped(path, *args):
    cfg = load([path, "--slurm.time", "01:00:00", *args]).config
    return cfg, slurm_placement(cfg)


def rows(plan):
    return {i.name: i for i in plan.trainer}, {i.name: i for i in plan.inference}


def test_weight_sync_items_of_the_30b_example_by_hand():
    """configs/hosted/full_ft_multi_node.toml: 16 trainer ranks (2 x 8) send to 2 vLLM servers of tp 8,
    C = chunk_mb = 256 MiB, bf16 policy."""
    cfg, pl = shipped("configs/hosted/full_ft_multi_node.toml")
    plan = mp.plan_for(cfg, pl)
    trainer, infer = rows(plan)
    # trainer rank: its rows of the embedding 151,936 x 2,048 / 16 = 19,447,808 elements x 2 B
    # = 38,895,616 B + a scratch bucket 256 MiB / 16 = 16,777,216 B + one process in each of 2 servers
    # x 0.0625 GiB
    assert mp.largest_piece(Q30B, 16) == 19_447_808
    assert trainer["weight publish"].gib == pytest.approx((38_895_616 + 16_777_216) / GIB + 2 * 0.0625)
    assert round(trainer["weight publish"].gib, 3) == 0.177
    # every vLLM TP worker: 2 x 256 MiB round buffers = 0.5 GiB + assembly (largest tensor)
    # 151,936 x 2,048 x 2 B = 622,329,856 B = 0.580 GiB + (16 / 8 = 2 senders + 2 ring neighbours)
    # x 0.0625 = 0.25
    receive = infer["weight receive"]
    assert receive.gib == pytest.approx(0.5 + 622_329_856 / GIB + 4 * 0.0625)
    assert round(receive.gib, 2) == 1.33
    assert "assembly (largest tensor) 0.58" in receive.note and "4 NCCL communicators" in receive.note
    assert "outside vLLM's pool: 1.33 of 8.00 GiB" in receive.note  # 80 x (1 - 0.9)
    assert plan.receive.ring_peers == 2
    lines = mp.dry_run_lines(cfg, pl)  # fits: checked, no refusal
    assert any(x.startswith("    weight publish bf16      0.18 GiB") for x in lines)
    assert any(x.startswith("    weight receive bf16      1.33 GiB") for x in lines)
    assert lines[1].startswith(
        "  trainer rank (16 ranks, FSDP 16, ep 8; bf16 compute, fp32 master): 42.0 GiB"
    )
    # KV cache unchanged: the receive sits outside vLLM's 72 GiB pool
    assert infer["KV cache"].gib == pytest.approx(72 - Q30B.params * 2 / 8 / GIB - 2)


def test_weight_sync_items_of_the_235b_example_by_hand():
    """configs/multi_node/qwen3_235b.toml: 64 trainer ranks (8 x 8) send to 8 vLLM servers of tp 8."""
    cfg, pl = shipped("configs/multi_node/qwen3_235b.toml")
    assert (pl.trainer_ranks, pl.inference_servers, cfg.inference.parallel.tp) == (64, 8, 8)
    plan = mp.plan_for(cfg, pl)
    trainer, infer = rows(plan)
    # trainer rank: 151,936 x 4,096 / 64 = 9,723,904 elements x 2 B = 19,447,808 B (a whole expert,
    # 1,536 x 4,096 = 6,291,456 elements, is smaller) + 256 MiB / 64 = 4,194,304 B + 8 servers x 0.0625
    assert mp.largest_piece(Q235B, 64) == 9_723_904 > 1536 * 4096
    assert trainer["weight publish"].gib == pytest.approx((19_447_808 + 4_194_304) / GIB + 8 * 0.0625)
    assert round(trainer["weight publish"].gib, 3) == 0.522
    # a worker: 0.5 + 151,936 x 4,096 x 2 B = 1,244,659,712 B = 1.159 GiB + (64 / 8 + 2) x 0.0625 = 0.625
    assert infer["weight receive"].gib == pytest.approx(0.5 + 1_244_659_712 / GIB + 10 * 0.0625)
    assert round(infer["weight receive"].gib, 2) == 2.28  # of 8 GiB outside the pool: fits
    lines = mp.dry_run_lines(cfg, pl)
    assert plan.trainer_gib < 80 and round(plan.trainer_gib, 1) == 76.7
    assert any("10 NCCL communicators" in x for x in lines)


def test_hf_engine_receives_without_assembly_or_ring():
    r = mp.receive_of(Q30B, senders=16, tp=8, vllm=False, collective=True, chunk_mb=256, dtype="bfloat16")
    assert (r.assembly_gib, r.peers, r.ring_peers) == (0.0, 16, 0)  # copies parts into its parameters
    assert r.gib() == pytest.approx(0.5 + 16 * 0.0625)
    one = mp.receive_of(Q30B, senders=16, tp=1, vllm=True, collective=True, chunk_mb=256, dtype="bfloat16")
    assert one.peers == 16 and one.ring_peers == 0  # tp 1: no ring
    two = mp.receive_of(Q30B, senders=3, tp=2, vllm=True, collective=True, chunk_mb=256, dtype="bfloat16")
    assert (two.peers, two.ring_peers) == (2 + 1, 1)  # ceil(3 / 2) senders + the other worker
    files = mp.receive_of(Q30B, senders=16, tp=8, vllm=True, collective=False, chunk_mb=256, dtype="bfloat16")
    assert files.gib() == 0  # read on the host (host plan)


def test_publish_over_files_and_with_lora():
    files = mp.publish_item(Q30B, ranks=16, servers=2, collective=False, chunk_mb=256, dtype="bfloat16")
    assert files.gib * GIB == pytest.approx(19_447_808 * 2)  # the largest cast piece; its bucket is host's
    # LoRA materialises the cast shard S = P / ranks in the policy dtype (+ scratch + communicators)
    lora = mp.publish_item(
        Q8B, ranks=8, servers=1, collective=True, chunk_mb=256, dtype="bfloat16", lora=True
    )
    assert lora.gib == pytest.approx(8_190_735_360 * 2 / 8 / GIB + 32 * MIB / GIB + 0.0625)


def test_a_chunk_the_receivers_cannot_hold_is_refused_naming_chunk_mb():
    """chunk_mb = 4096 at gpu_memory_utilization 0.95: 80 x 0.05 = 4 GiB outside vLLM's pool; a worker
    needs 2 x 4 GiB + 0.58 + 4 x 0.0625. The largest chunk that fits: (4 - 0.580 - 0.25) / 2 GiB =
    1,623 MiB."""
    cfg, pl = shipped(
        "configs/hosted/full_ft_multi_node.toml",
        "--trainer.broadcast.chunk-mb", "4096", "--inference.gpu-memory-utilization", "0.95",
    )  # fmt: skip
    with pytest.raises(ConfigError) as e:
        mp.dry_run_lines(cfg, pl)
    msg = str(e.value)
    assert e.value.path == "trainer.broadcast.chunk_mb" and "\n" not in msg
    assert "needs 8.83 GiB outside vLLM's pool" in msg and "leaves 4.00 GiB" in msg
    assert "trainer.broadcast.chunk_mb <= 1623" in msg
    assert int((4 - 622_329_856 / GIB - 4 * 0.0625) * 1024 // 2) == 1623
    ok, pl = shipped(
        "configs/hosted/full_ft_multi_node.toml",
        "--trainer.broadcast.chunk-mb", "1623", "--inference.gpu-memory-utilization", "0.95",
    )  # fmt: skip
    mp.dry_run_lines(ok, pl)
    # over files nothing is received on the GPU: the same chunk is no concern
    fs, pl = shipped(
        "configs/hosted/full_ft_multi_node.toml", "--trainer.broadcast.transport", "filesystem",
        "--trainer.broadcast.chunk-mb", "4096", "--inference.gpu-memory-utilization", "0.95",
    )  # fmt: skip
    mp.dry_run_lines(fs, pl)


def test_when_no_chunk_fits_the_utilization_is_named():
    """235B at gpu_memory_utilization 0.98: 1.6 GiB outside the pool, but the assembly (1.159) and 10
    communicators (0.625) alone need 1.784: even chunk_mb = 1 cannot fit. At most
    1 - (1.7842 + 2 MiB) / 80 = 0.9777 -> 0.97."""
    cfg, pl = shipped("configs/multi_node/qwen3_235b.toml", "--inference.gpu-memory-utilization", "0.98")
    with pytest.raises(ConfigError) as e:
        mp.dry_run_lines(cfg, pl)
    assert e.value.path == "inference.gpu_memory_utilization" and "\n" not in str(e.value)
    assert "inference.gpu_memory_utilization <= 0.97" in str(e.value)


def test_delta_with_vllm_is_refused_at_load():
    with pytest.raises(ConfigError) as e:
        cfg_of("--inference.backend", "vllm", "--trainer.broadcast.delta")
    assert e.value.path == "trainer.broadcast.delta" and "\n" not in str(e.value)
    cfg_of("--inference.backend", "hf", "--trainer.broadcast.delta")  # the hf engine applies it in place
