"""Renderer selection (prime-rl's names) and the pure pieces of the renderer rollout client."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("renderers")

from hpcrl.config.schema import RendererConfig  # noqa: E402
from hpcrl.errors import ConfigError  # noqa: E402
from hpcrl.orchestrator.renderer_client import completion_logprobs, generate_sampling  # noqa: E402
from hpcrl.render import select  # noqa: E402

F = "orchestrator.renderer"


def test_auto_uses_the_packages_exact_model_map_and_falls_back_with_a_note() -> None:
    assert select.resolve_name("auto", "Qwen/Qwen3-8B") == ("qwen3", None)
    name, note = select.resolve_name("auto", "/models/my-finetune")
    assert name == "default" and "not in the renderers package's model map" in note
    assert select.resolve_name("glm-5", "anything") == ("glm-5", None)
    config, _ = select.renderer_config(RendererConfig(), "Qwen/Qwen3-8B", F)
    assert config.name == "qwen3"


@pytest.mark.parametrize(
    ("model", "outside"),
    [
        ("hpcrl/tiny-qwen3", True),
        ("/models/my-finetune", True),
        ("./runs/a/weights/step_5", True),
        ("../weights", True),
        ("~/models/x", True),
        ("runs/a/weights/step_5", True),
        ("", True),
        ("Qwen/Qwen3-8B", False),
        ("my-org/my-finetune", False),
        ("gpt2", False),
    ],
)
def test_outside_the_map_only_for_names_no_hub_id_can_be(model: str, outside: bool) -> None:
    assert select.outside_the_map(model) is outside
    if not outside:
        return
    from renderers.base import MODEL_RENDERER_MAP

    assert model not in MODEL_RENDERER_MAP


def test_auto_on_a_local_model_resolves_without_importing_the_package(tmp_path) -> None:
    """The orchestrator of a run on a built-in or local model never imports renderers (nor openai)."""
    import subprocess

    code = (
        "import sys, logging\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from hpcrl.config.schema import RendererConfig\n"
        "from hpcrl.render.select import typed_renderers, dry_run_check\n"
        "assert typed_renderers(object(), RendererConfig(), 'hpcrl/tiny-qwen3', 'orchestrator.renderer') is None\n"
        "class C: pass\n"
        "c = C(); c.orchestrator = C(); c.orchestrator.renderer = RendererConfig(); c.model = C()\n"
        f"c.model.name = {str(tmp_path)!r}\n"
        "print(dry_run_check(c))\n"
        "assert 'renderers' not in sys.modules and 'openai' not in sys.modules, 'imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("not in the renderers package's model map") == 2, r.stdout
    with pytest.raises(ConfigError) as e:
        select.auto_fallback(RendererConfig(thinking_retention="all"), "hpcrl/tiny-qwen3", F)
    assert e.value.path == f"{F}.thinking_retention"
    with pytest.raises(ConfigError) as e:
        select.auto_fallback(RendererConfig(import_path="a.B"), "/m", F)
    assert e.value.path == f"{F}.import_path"
    assert select.auto_fallback(RendererConfig(), "Qwen/Qwen3-8B", F) is None


def test_auto_without_the_package_installed_says_so_as_before() -> None:
    """The short cut applies only where the package is installed: without it, auto's note names the
    install command (a typed renderer could not be chosen there), and eval keeps falling back."""
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['renderers'] = None\n"  # as if not installed
        "from hpcrl.config.schema import RendererConfig\n"
        "from hpcrl.render import select\n"
        "assert select.auto_fallback(RendererConfig(), 'hpcrl/tiny-qwen3', 'renderer') is None\n"
        "section = RendererConfig(thinking_retention='all')\n"
        "assert select.typed_renderers(object(), section, '/m', 'renderer') is None\n"
        "class C: pass\n"
        "c = C(); c.renderer = RendererConfig(); c.model = C(); c.model.name = 'hpcrl/tiny-qwen3'\n"
        "print(select.dry_run_check(c))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the renderers package is not installed" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "glm-5", "gpt-oss", "default"])
def test_every_shipped_renderer_name_is_accepted(name: str) -> None:
    assert select.renderer_config(RendererConfig(name=name), "m", F)[0].name == name


@pytest.mark.parametrize(
    ("section", "field", "words"),
    [
        (RendererConfig(name="qwen9"), f"{F}.name", "unknown renderer 'qwen9'"),
        (RendererConfig(name="custom"), f"{F}.import_path", "is required with name = 'custom'"),
        (RendererConfig(name="qwen3", import_path="a.B"), f"{F}.import_path", "only applies"),
        (RendererConfig(name="default", thinking_retention="all"), f"{F}.thinking_retention", "default"),
        (
            RendererConfig(name="custom", import_path="no_such_mod.R"),
            f"{F}.import_path",
            "ModuleNotFoundError",
        ),
    ],
)
def test_bad_sections_are_one_line_naming_the_field(section, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        select.renderer_config(section, "m", F)
    assert e.value.path == field and words in str(e.value) and "\n" not in str(e.value)


def test_thinking_retention_reaches_the_renderer_config() -> None:
    config, _ = select.renderer_config(RendererConfig(name="qwen3", thinking_retention="all"), "m", F)
    assert config.thinking_retention == "all"


def test_a_renderer_whose_special_tokens_the_tokenizer_lacks_is_refused() -> None:
    from hpcrl.models.tiny import build_tokenizer

    with pytest.raises(ConfigError, match="Special token '<tool_call>' not found") as e:
        select.create(build_tokenizer("chatml"), RendererConfig(name="qwen3"), "hpcrl/tiny-qwen3", F)
    assert e.value.path == f"{F}.name"
    renderer, _ = select.create(build_tokenizer("qwen3"), RendererConfig(name="qwen3"), "m", F)
    assert type(renderer).__name__ == "Qwen3Renderer"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "renderers", None)  # import renderers -> ImportError
    with pytest.raises(ConfigError) as e:
        select.require_renderers(f"{F}.name")
    assert "pip install 'renderers>=0.1.12'" in str(e.value) and "Python >= 3.11" in str(e.value)


def test_logprobs_are_read_in_both_shapes_and_must_line_up() -> None:
    vllm = {"logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 2, "logprob": -0.1}]}}
    chat = {
        "logprobs": {
            "content": [{"token": "token_id:5", "logprob": -0.5}, {"token": "token_id:2", "logprob": -0.1}]
        }
    }
    assert completion_logprobs(vllm, [5, 2]) == completion_logprobs(chat, [5, 2]) == [-0.5, -0.1]
    from hpcrl.orchestrator.pool import RequestFailed

    with pytest.raises(RequestFailed):
        completion_logprobs(vllm, [5, 3])
    with pytest.raises(RequestFailed):
        completion_logprobs(vllm, [5])


def test_generate_sampling_keeps_vllm_names_and_sets_the_renderers_stops() -> None:
    sp = generate_sampling(
        {"temperature": 0.7, "top_k": 5, "max_tokens": 99, "chat_template_kwargs": {}}, 12, [7, 8]
    )
    assert sp == {
        "temperature": 0.7,
        "top_k": 5,
        "max_tokens": 12,
        "stop_token_ids": [7, 8],
        "logprobs": 0,
        "skip_special_tokens": False,
    }


@pytest.mark.parametrize(
    ("model", "name", "rc", "words"),
    [
        ("hpcrl/tiny-qwen3", "qwen3", 2, "orchestrator.renderer.name: renderer 'qwen3' does not fit"),
        ("hpcrl/tiny-qwen3", "qwen33", 2, "unknown renderer 'qwen33' (did you mean 'qwen3'?)"),
        ("hpcrl/tiny-qwen3-think", "qwen3", 0, ""),
        ("hpcrl/tiny-qwen3", "auto", 0, ""),
    ],
)
def test_dry_run_refuses_in_one_line(tmp_path, capsys, model: str, name: str, rc: int, words: str) -> None:
    from hpcrl.cli import main
    from tests.conftest import rl_toml

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(rl_toml(model=model, tables=f'[orchestrator.renderer]\nname = "{name}"\n'))
    assert main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "out")]) == rc
    out, err = capsys.readouterr()
    if rc:
        assert err.strip().count("\n") == 0 and words in err, err
    elif name == "auto":
        assert "using the tokenizer's own chat template (default)" in out
