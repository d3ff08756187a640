"""`hpcrl sft` with `[model.vlm]` end to end on a tiny Qwen3-VL built offline and a few generated
images (colored squares, the assistant names the color): the loss falls, the vision encoder is
unchanged when frozen and changed when not, a resume from a checkpoint lands on the same weights,
LoRA in prime-rl's example shape, and the exported weights load with their image processor."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import pytest

from hpcrl.paths import RunPaths
from tests.integration.test_sft import losses, resumed_at_step_2, run_sft

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def make_data(out: Path, n: int = 24, text_every: int = 0) -> Path:
    """Rows with an image (a local png relative to the data file, or a base64 data URL) and a question;
    with `text_every` k, every k-th row (1, 1 + k, ...) has no image."""
    from PIL import Image

    (out / "img").mkdir(parents=True)
    rng = random.Random(0)
    rows = []
    for i in range(n):
        name = rng.choice(sorted(COLORS))
        img = Image.new("RGB", rng.choice([(32, 32), (48, 40), (64, 64)]), COLORS[name])
        if i % 3 == 0:
            img.save(out / "img" / f"{i}.png")
            part = {"type": "image", "image": f"img/{i}.png"}
        else:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
        text_only = text_every and i % text_every == 1
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": f"Say {name}."}]
                        if text_only
                        else [part, {"type": "text", "text": "What color is this?"}],
                    },
                    {"role": "assistant", "content": f"It is {name}."},
                ]
            }
        )
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(path: Path, model: Path, data: Path, out: Path, vlm: str = "", extra: str = "") -> Path:
    path.write_text(
        f'max_steps = 4\nseq_len = 64\noutput_dir = "{out}"\n{extra}'
        f'[model]\nname = "{model}"\n[model.vlm]\n{vlm}'
        f'[data]\nname = "{data}"\nbatch_size = 4\n[val]\ninterval = 2\nfraction = 0.2\n'
        "[optim]\nlr = 3e-3\n[ckpt]\ninterval = 2\n"
    )
    return path


def weights(d: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def changed(a: dict, b: dict, vision: bool) -> list[bool]:
    """Per weight of the vision tower (or of the rest): whether b differs from a (a cast to b's dtype)."""
    return [not bool((a[k].to(b[k].dtype) == b[k]).all()) for k in a if ("visual" in k) == vision]


@pytest.fixture(scope="module")
def vlm_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("sft-vlm")
    model = build_tiny_vlm(root / "tiny-vlm")
    return root, model, make_data(root / "data")


@pytest.fixture(scope="module")
def frozen_run(vlm_setup) -> tuple[Path, Path]:
    root, model, data = vlm_setup
    cfg = write_config(root / "sft.toml", model, data, root / "run")
    run_sft(str(cfg))
    return root / "run", cfg


@pytest.mark.slow
def test_vlm_sft_learns_with_a_frozen_vision_encoder(vlm_setup, frozen_run):
    _, model, _ = vlm_setup
    run, _ = frozen_run
    m = losses(run)
    assert sorted(m) == [1, 2, 3, 4]
    assert m[4]["loss/mean"] < m[1]["loss/mean"] - 0.5
    assert m[4]["val/loss"] < m[2]["val/loss"]  # held-out rows with images, no gradient
    paths = RunPaths(run)
    before, after = weights(model), weights(paths.weights_dir(4))
    assert sorted(before) == sorted(after)  # the export keeps HF's names, vision tower included
    assert not any(changed(before, after, vision=True))  # frozen: bit for bit
    assert all(changed(before, after, vision=False))  # every language-model weight trained

    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    assert (
        AutoModelForImageTextToText.from_pretrained(str(paths.weights_dir(4))).config.model_type == "qwen3_vl"
    )
    assert AutoImageProcessor.from_pretrained(str(paths.weights_dir(4))).merge_size == 2


@pytest.mark.slow
def test_vlm_sft_resume_lands_on_the_same_weights(frozen_run, tmp_path):
    run, cfg = frozen_run
    copy = resumed_at_step_2(run, cfg, tmp_path)
    paths = RunPaths(copy)
    a, b = losses(run), losses(copy)
    assert sorted(b) == [3, 4]
    assert [b[s]["loss/mean"] for s in (3, 4)] == [a[s]["loss/mean"] for s in (3, 4)]
    assert b[4]["val/loss"] == a[4]["val/loss"]
    wa, wb = weights(RunPaths(run).weights_dir(4)), weights(paths.weights_dir(4))
    assert all(bool((wa[k] == wb[k]).all()) for k in wa)


@pytest.mark.slow
def test_vlm_sft_trains_the_vision_encoder_when_not_frozen(vlm_setup, tmp_path):
    root, model, data = vlm_setup
    cfg = write_config(
        tmp_path / "sft.toml", model, data, tmp_path / "run", "freeze_vision_encoder = false\n"
    )
    run_sft(str(cfg), "--max-steps", "2")
    after = weights(RunPaths(tmp_path / "run").weights_dir(2))
    assert all(changed(weights(model), after, vision=True))


@pytest.mark.slow
def test_prime_rl_vlm_example_shape_with_lora(vlm_setup, tmp_path):
    """examples/vlm_sft/sft.toml's keys (impl custom, explicit attrs, LoRA, ac, micro_batch_size 1,
    bf16) on the tiny model: LoRA trains the language model only; the vision tower stays as it was."""
    _, model, data = vlm_setup
    out = tmp_path / "run"
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'max_steps = 3\noutput_dir = "{out}"\n[ckpt]\n'
        f'[model]\nname = "{model}"\noptimization_dtype = "bfloat16"\nreduce_dtype = "bfloat16"\nimpl = "custom"\n'
        '[renderer]\nname = "auto"\n'
        '[model.vlm]\nvision_encoder_attr = "model.visual"\nlanguage_model_attr = "model.language_model"\n'
        "freeze_vision_encoder = true\n[model.lora]\nrank = 16\n[model.ac]\nfreq = 1\n"
        f'[data]\ntype = "sft"\nname = "{data}"\nbatch_size = 2\nmicro_batch_size = 1\nseq_len = 128\n'
        "[optim]\nlr = 1e-2\n"
    )
    proc = run_sft(str(cfg))
    assert "impl = 'custom' with [model.vlm]" in proc.stdout + proc.stderr
    m = losses(out)
    assert m[3]["loss/mean"] < m[1]["loss/mean"]
    before, after = weights(model), weights(RunPaths(out).weights_dir(3))
    assert not any(changed(before, after, vision=True))
    assert any(changed(before, after, vision=False))  # LoRA merged into the exported weights


@pytest.mark.slow
def test_vlm_sft_two_ranks_match_one(vlm_setup, frozen_run, tmp_path):
    """Two gloo ranks (FSDP2, rows by stride, the frozen encoder sharded with the rest): the same
    losses as one rank, the encoder unchanged."""
    _, model, data = vlm_setup
    run, _ = frozen_run
    cfg = write_config(tmp_path / "sft.toml", model, data, tmp_path / "run")
    cfg.write_text(cfg.read_text() + "[deployment]\nnum_trainer_ranks = 2\n")
    run_sft(str(cfg), timeout=600)
    a, b = losses(run), losses(tmp_path / "run")
    for s in (1, 2, 3, 4):
        assert b[s]["loss/mean"] == pytest.approx(a[s]["loss/mean"], rel=1e-4)
    after = weights(RunPaths(tmp_path / "run").weights_dir(4))
    assert not any(changed(weights(model), after, vision=True))


@pytest.mark.slow
def test_two_ranks_train_the_encoder_when_one_ranks_rows_have_no_image(vlm_setup, tmp_path):
    """Rows by stride over data whose odd rows have no image: rank 0's micro-batches carry images,
    rank 1's none, so rank 1's encoder gradients are None. FSDP2 must still reduce-scatter the same
    tensors on both ranks (a hang or mispaired gradients before): the losses equal one rank's."""
    _, model, _ = vlm_setup
    data = make_data(tmp_path / "mixed", n=16, text_every=2)
    trained = "freeze_vision_encoder = false\n"
    one = write_config(tmp_path / "one.toml", model, data, tmp_path / "one", trained)
    run_sft(str(one), "--max-steps", "2")
    two = write_config(tmp_path / "two.toml", model, data, tmp_path / "two", trained)
    two.write_text(two.read_text() + "[deployment]\nnum_trainer_ranks = 2\n")
    run_sft(str(two), "--max-steps", "2", timeout=300)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    for s in (1, 2):
        assert b[s]["loss/mean"] == pytest.approx(a[s]["loss/mean"], rel=1e-4)
    after = weights(RunPaths(tmp_path / "two").weights_dir(2))
    assert all(changed(weights(model), after, vision=True))
