"""The vLLM backend's pure parts, in the normal venv (vLLM absent): argv, LoRA ranks, error messages."""

from __future__ import annotations

import sys

import pytest

from hpcrl.errors import ConfigError
from hpcrl.inference import vllm_backend as vb
from hpcrl.inference.options import ServeOptions


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_argv_carries_tp_lora_port_and_extra_flags():
    opts = ServeOptions(
        model_name="m", backend="vllm", port=41000, tp=4, lora_rank=20, vllm_args=["--enable-prefix-caching"]
    )
    f = _flags(vb.vllm_serve_argv(opts, "/models/m"))
    assert f["--model"] == "/models/m" and f["--port"] == "41000" and f["--tensor-parallel-size"] == "4"
    assert "--enable-lora" in f and f["--max-lora-rank"] == "32"
    assert f["--worker-extension-cls"] == vb.EXTENSION_CLS and "--enable-prefix-caching" in f


def test_no_lora_flags_without_lora():
    f = _flags(vb.vllm_serve_argv(ServeOptions(model_name="m", backend="vllm"), "m"))
    assert "--enable-lora" not in f and "--max-lora-rank" not in f and f["--tensor-parallel-size"] == "1"


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
def test_lora_rank_rounds_up_to_a_vllm_rank(rank, served):
    assert vb.vllm_lora_rank(rank) == served


def test_lora_rank_above_vllms_largest_is_a_config_error():
    with pytest.raises(ValueError, match="model.lora.rank: 600"):
        ServeOptions(model_name="m", backend="vllm", lora_rank=600).validate()
    ServeOptions(model_name="m", backend="hf", lora_rank=600).validate()  # the hf engine has no such limit


def test_tp_must_be_positive():
    with pytest.raises(ValueError, match="inference.parallel.tp"):
        ServeOptions(model_name="m", backend="vllm", tp=0).validate()


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """An installed package named vllm (with dist metadata) that lacks hpcrl's modules."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    dist = tmp_path / "vllm-0.99.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    vb.vllm_symbol.cache_clear()
    yield tmp_path
    vb.vllm_symbol.cache_clear()


def test_missing_vllm_says_not_installed():
    if vb.vllm_version() is not None:
        pytest.skip("vllm is installed in this venv")
    vb.vllm_symbol.cache_clear()
    with pytest.raises(ConfigError, match="inference.backend: vllm is not installed"):
        vb.vllm_symbol("make_arg_parser")


def test_installed_vllm_without_a_module_names_it_and_the_version(fake_vllm):
    with pytest.raises(ConfigError) as e:
        vb.vllm_symbol("make_arg_parser")
    msg = str(e.value)
    assert "vllm 0.99.0 is installed but has no make_arg_parser" in msg
    assert "vllm.entrypoints.common.cli_args" in msg and "not installed" not in msg


def test_installed_vllm_with_a_broken_dependency_names_it(fake_vllm):
    pkg = fake_vllm / "vllm" / "entrypoints" / "common"
    pkg.mkdir(parents=True)
    for d in (pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "cli_args.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(
        ConfigError,
        match="vllm 0.99.0 is installed but importing vllm.entrypoints.common.cli_args "
        "failed: No module named 'no_such_dependency_xyz'",
    ):
        vb.vllm_symbol("make_arg_parser")


def test_init_broadcaster_rpc_bounds_the_join():
    from hpcrl.inference.vllm_routes import init_broadcaster_rpc

    body = {"host": "h", "port": 5, "world_size": 3, "rank": 1}
    assert init_broadcaster_rpc(body) == ("hpcrl_init_broadcaster", ("h", 5, 3, 1, 300.0, 8.0))
    assert init_broadcaster_rpc(body, 4.0)[1][5] == 4.0  # the server's control_timeout_s
    assert init_broadcaster_rpc({**body, "join_timeout": 60})[1][5] == 60.0  # the request's own
    assert init_broadcaster_rpc({**body, "timeout": 2})[1][4:] == (2.0, 2.0)  # never above `timeout`
    with pytest.raises(ValueError, match="join_timeout"):
        init_broadcaster_rpc({**body, "join_timeout": 0})


def test_moe_model_asks_vllm_for_routed_experts():
    from hpcrl.models.resolve import resolve_model

    moe, dense = resolve_model("hpcrl/tiny-qwen3-moe"), resolve_model("hpcrl/tiny-qwen3")
    assert "--enable-return-routed-experts" in vb.vllm_serve_argv(ServeOptions(model_name=moe), moe)
    assert "--enable-return-routed-experts" not in vb.vllm_serve_argv(ServeOptions(model_name=dense), dense)


def test_update_rpc_tells_the_workers_whether_to_keep_a_delta_base():
    """The workers keep the loaded policy (host memory per tp worker) only on a server started for
    delta sync (ServeOptions.delta_base, from trainer.broadcast.delta)."""
    from hpcrl.inference.vllm_routes import update_weights_rpc

    assert update_weights_rpc({"path": "/r/b/step_1"}) == ("hpcrl_update_from_path", ("/r/b/step_1", False))
    assert update_weights_rpc({"path": "/p"}, delta_base=True) == ("hpcrl_update_from_path", ("/p", True))
    assert update_weights_rpc({"transport": "collective"}, True) == ("hpcrl_update_collective", (True,))
    assert update_weights_rpc({"transport": "collective"}) == ("hpcrl_update_collective", (False,))


def test_serve_config_passes_the_delta_setting_to_the_server(monkeypatch, tmp_path):
    """The launchers give every role the whole resolved run file: the server takes
    trainer.broadcast.delta from it (a role flag for it stays the trainer's)."""
    from hpcrl.inference import server
    from hpcrl.launch.checks import load

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    monkeypatch.setattr(server, "_has_cuda_and_vllm", lambda: False)
    for delta in (False, True):
        f = tmp_path / f"run_{delta}.toml"
        f.write_text(
            '[model]\nname = "hpcrl/tiny-qwen3"\n[[orchestrator.train.env]]\nid = "reverse-text"\n'
            f"[trainer.broadcast]\ndelta = {str(delta).lower()}\n"
        )
        cfg = load(["@", str(f)], require_envs=False, role="inference").config
        server.serve_config(cfg)
        assert seen[-1].delta_base is delta
