"""Vision-language RL's pieces (`[model.vlm]` in `hpcrl run`): the images part of a TrainBatch on the
wire (and an old batch file without it), packing and re-packing samples with images, the one image
token expansion the server, the orchestrator and the trainer share, the color-codeword env, a
prime-rl taskset's fields as the built-in's args, and the engine's sampled logprobs against the
trainer's forward of the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.bus.images import ImageBatch, join_images
from hpcrl.bus.messages import TrainBatch, decode, encode
from hpcrl.orchestrator.packing import Sample, pack_for_ranks

GOLDEN = Path(__file__).parents[1] / "golden" / "bus" / "train_batch_a48cbd3.msgpack"


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


def _batch(images: ImageBatch | None, n: int = 3) -> TrainBatch:
    lens = [2] * n
    t = sum(lens)
    return TrainBatch(
        step=1,
        rank=0,
        world_size=1,
        input_ids=np.arange(t),
        position_ids=np.concatenate([np.arange(k) for k in lens]),
        seq_lens=lens,
        loss_mask=np.tile([False, True], n),
        advantages=np.ones(t),
        inference_logprobs=np.zeros(t),
        policy_versions=np.zeros(n),
        temperatures=np.ones(n),
        env_names=["e"] * n,
        example_ids=np.arange(n),
        rewards=np.zeros(n),
        total_loss_tokens=n,
        images=images,
    )


def _images() -> ImageBatch:
    # sample 0: no image; sample 1: grids (1,2,2) and (1,2,4) = 4 + 8 patches; sample 2: (1,1,2) = 2
    pix = np.arange(14 * 3, dtype=np.float32).reshape(14, 3)
    return ImageBatch(
        pixel_values=pix, image_grid_thw=[[1, 2, 2], [1, 2, 4], [1, 1, 2]], images_per_sample=[0, 2, 1]
    )


def test_images_round_trip_on_the_wire_and_an_old_file_decodes_without_them() -> None:
    b = decode(encode(_batch(_images())), TrainBatch)
    assert b.images is not None and b.images.pixel_values.dtype == np.float32
    assert b.images.image_grid_thw.tolist() == [[1, 2, 2], [1, 2, 4], [1, 1, 2]]
    pix, grid = b.images.sample(1)  # rows 0..11 (4 + 8 patches)
    assert grid.tolist() == [[1, 2, 2], [1, 2, 4]] and pix[:, 0].tolist() == [3.0 * i for i in range(12)]
    pix, grid = b.images.sample(2)  # rows 12, 13
    assert grid.tolist() == [[1, 1, 2]] and pix.tolist() == [[36, 37, 38], [39, 40, 41]]
    assert b.images.sample(0)[1].shape == (0, 3)
    assert decode(encode(_batch(None)), TrainBatch).images is None
    old = decode(GOLDEN.read_bytes(), TrainBatch)  # written before the field existed
    assert old.images is None and old.input_ids.size > 0 and b"images" not in GOLDEN.read_bytes()


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"image_grid_thw": [[1, 2, 2], [1, 2, 4], [1, 1, 3]]}, "covers 15 patches"),
        ({"images_per_sample": [0, 1, 1]}, "sums to 2"),
        ({"image_grid_thw": [[1, 2, 2], [1, 2, 4], [1, 0, 2]]}, "positive"),
    ],
)
def test_inconsistent_images_are_refused(kw: dict, words: str) -> None:
    good = _images()
    args = {
        "pixel_values": good.pixel_values,
        "image_grid_thw": good.image_grid_thw,
        "images_per_sample": good.images_per_sample,
        **kw,
    }
    with pytest.raises(ValueError, match=words):
        ImageBatch(**args)
    with pytest.raises(ValueError, match="2 samples, expected 3"):
        _batch(
            ImageBatch(pixel_values=np.zeros((4, 3)), image_grid_thw=[[1, 2, 2]], images_per_sample=[1, 0])
        )


def _sample(n: int, example: int, mm=None, image_end: int = 0) -> Sample:
    mask = np.zeros(n, bool)
    mask[-2:] = True
    return Sample(
        input_ids=np.full(n, example, np.int32),
        loss_mask=mask,
        inference_logprobs=np.zeros(n, np.float32),
        advantage=1.0,
        policy_version=0,
        example_id=example,
        env_name="e",
        temperature=1.0,
        reward=0.0,
        mm=mm,
        image_end=image_end,
    )


def test_packing_keeps_each_samples_images_on_its_rank_and_drops_a_cut_image() -> None:
    from hpcrl.orchestrator.batch import build_batches, repack_batches, unpack_samples

    img = lambda v, g: (np.full((int(np.prod(g)), 2), v, np.float32), np.asarray([g], np.int32))  # noqa: E731
    samples = [
        _sample(6, 0, img(1.0, [1, 2, 2]), image_end=3),
        _sample(5, 1),  # text
        _sample(4, 2, img(2.0, [1, 1, 2]), image_end=2),
        _sample(
            9, 3, img(3.0, [1, 2, 2]), image_end=9
        ),  # 9 > seq_len 8 and the cut orphans its image: dropped
        _sample(9, 4, img(4.0, [1, 2, 2]), image_end=5),  # cut after its image: kept, truncated to 8 tokens
    ]
    packed, stats = pack_for_ranks(samples, 2, 8)
    assert (stats.num_dropped, stats.num_truncated) == (1, 1)
    # longest first to the emptier rank: #4 (8) -> 0, #0 (6) -> 1, #1 (5) -> 1, #2 (4) -> 0; input order inside
    r0, r1 = packed[0]["images"], packed[1]["images"]
    assert packed[0]["example_ids"].tolist() == [2, 4] and packed[1]["example_ids"].tolist() == [0, 1]
    assert r0.images_per_sample.tolist() == [1, 1] and r0.pixel_values[:, 0].tolist() == [2.0] * 2 + [4.0] * 4
    assert r1.images_per_sample.tolist() == [1, 0] and r1.pixel_values.tolist() == [[1.0, 1.0]] * 4
    assert pack_for_ranks([samples[1]], 1, 8)[0][0]["images"] is None  # a text-only rank: no images part
    batches, _ = build_batches(samples, 1, 2, 8)
    back = decode(encode(batches[1]), TrainBatch)
    assert [s.mm is None for s in unpack_samples(back)] == [False, True]
    one = repack_batches(batches, 1, 8)[0]  # a resume with one trainer rank: the same images
    assert one.example_ids.tolist() == [2, 4, 0, 1] and one.images.images_per_sample.tolist() == [1, 1, 1, 0]
    assert one.images.pixel_values[:, 0].tolist() == [2.0] * 2 + [4.0] * 4 + [1.0] * 4


def test_join_images_none_when_no_sample_has_one() -> None:
    assert join_images([None, None]) is None
    got = join_images([None, (np.ones((4, 5)), np.asarray([[1, 2, 2]]))])
    assert got.images_per_sample.tolist() == [0, 1] and got.pixel_values.shape == (4, 5)


def _conversation(n_images: int = 1, size: int = 48) -> list[dict]:
    from hpcrl.envs.builtin.color_codeword import png_data_url

    parts = [
        {"type": "image_url", "image_url": {"url": png_data_url((200, 10, 10), size)}}
        for _ in range(n_images)
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is the codeword?"}]}]


def test_one_image_token_expansion_for_server_orchestrator_and_trainer(tiny_vlm: Path) -> None:
    from transformers import AutoTokenizer

    from hpcrl.inference.protocol import parse_messages
    from hpcrl.models.vision_inputs import ImageInputs, image_refs
    from hpcrl.orchestrator.images import SampleImages
    from hpcrl.trainer.sft_data import Conversation
    from hpcrl.trainer.sft_vlm import VisionData

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    vi = ImageInputs(str(tiny_vlm), tok)
    msgs = parse_messages({"messages": _conversation(2, size=64)})  # the server's normalised messages
    mm = vi.encode(image_refs(msgs))
    # a 64 x 64 image: 4 x 4 patches of 16 px (t = 1), merged 2 x 2 -> 4 image tokens each
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]] and mm["pixel_values"].shape == (32, 1536)
    assert vi.tokens_per_image(mm["image_grid_thw"]) == [4, 4]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    server = tok(vi.expand(text, [4, 4]), add_special_tokens=False)["input_ids"]
    assert server.count(vi.image_id) == 8
    # the trainer's SFT rendering of the same conversation (placeholders expanded before the template)
    sft = VisionData(str(tiny_vlm), tok, None)
    conv, sft_mm = sft.conversation(
        Conversation(messages=[*msgs, {"role": "assistant", "content": "x"}]), "row"
    )
    assert torch.equal(sft_mm["pixel_values"], mm["pixel_values"])
    trained = tok.apply_chat_template(conv.messages[:1], add_generation_prompt=True, tokenize=False)
    assert tok(trained, add_special_tokens=False)["input_ids"] == server
    # the orchestrator: the same tensors, checked against the prompt's image tokens; a request's room
    # in seq_len counts the expansion (the template's rendering has one placeholder token per image)
    assert SampleImages(vi).extra_tokens(image_refs(msgs)) == 8 - 2
    assert len(server) == len(tok(text, add_special_tokens=False)["input_ids"]) + 6
    pix, grid = SampleImages(vi).of(image_refs(msgs), np.asarray(server), "s")
    assert np.array_equal(pix, mm["pixel_values"].numpy()) and grid.tolist() == [[1, 4, 4], [1, 4, 4]]
    with pytest.raises(ValueError, match="7 image tokens in the sequence, its 2 image"):
        one_less = [t for i, t in enumerate(server) if i != server.index(vi.image_id)]
        SampleImages(vi).of(image_refs(msgs), np.asarray(one_less), "s")
    with pytest.raises(ValueError, match="placeholders for 3 images"):
        vi.expand(text, [4, 4, 4])


def test_a_sequence_that_sampled_the_image_token_is_dropped(tiny_vlm: Path) -> None:
    from transformers import AutoTokenizer

    from hpcrl.errors import ConfigError
    from hpcrl.models.vision_inputs import ImageInputs, image_refs
    from hpcrl.orchestrator.images import DROP, SampleImages, sample_images
    from hpcrl.orchestrator.state import Piece

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    vi = ImageInputs(str(tiny_vlm), tok)
    url = image_refs(_conversation(1, size=32))  # 32 x 32: one image token
    images = SampleImages(vi)
    ok = Piece(
        input_ids=[5, vi.image_id, 6, 7],
        loss_mask=[False, False, False, True],
        logprobs=[0.0] * 4,
        images=url,
    )
    assert sample_images(images, ok, "s")[1].tolist() == [[1, 2, 2]]
    bad = Piece(
        input_ids=[5, vi.image_id, 6, vi.image_id],
        loss_mask=[False, False, False, True],
        logprobs=[0.0] * 4,
        images=url,
    )
    assert sample_images(images, bad, "s") is DROP and (images.seen, images.dropped) == (1, 1)
    assert sample_images(None, Piece(input_ids=[1], loss_mask=[False], logprobs=[0.0]), "s") is None
    with pytest.raises(ConfigError, match="set \\[model.vlm\\]"):
        sample_images(None, ok, "s")


def test_engine_samples_images_and_the_trainer_forward_reproduces_its_logprobs(tiny_vlm: Path) -> None:
    from hpcrl.inference.engine import HFEngine
    from hpcrl.inference.errors import InvalidRequest
    from hpcrl.inference.protocol import parse_messages, parse_sampling
    from hpcrl.trainer.rl import to_packed
    from hpcrl.trainer.rl_vlm import image_token_id, split_vision
    from hpcrl.trainer.sft_vlm import forward_multimodal

    eng = HFEngine(str(tiny_vlm), max_batch_size=4, max_model_len=256)
    try:
        assert type(eng.model).__name__ == "Qwen3VLForConditionalGeneration"
        ids, mm = eng.vision_prompt(parse_messages({"messages": _conversation(1)}), None, True)
        params = parse_sampling(
            {"max_tokens": 6, "temperature": 0.7, "n": 2, "logprobs": True, "seed": 3}, chat=True
        )
        outs = eng.submit(ids, params, mm).result(timeout=60)
        assert [len(o.token_ids) for o in outs] == [6, 6] and outs[0].policy_steps == [0]
        text = eng.submit(eng.tokens.encode_text("hi"), parse_sampling({"max_tokens": 3}, chat=True)).result(
            60
        )
        assert len(text[0].token_ids) == 3  # text requests still go through the continuous batch
        # the trainer's path: a TrainBatch with a text sample and the image sample, split, forwarded
        o = outs[1]
        seq = [*ids, *o.token_ids]
        n = len(seq)
        pix, grid = mm["pixel_values"].numpy(), mm["image_grid_thw"].numpy()
        batch = TrainBatch(
            step=1, rank=0, world_size=1,
            input_ids=[1, 2, 3, *seq], position_ids=[0, 1, 2, *range(n)], seq_lens=[3, n],
            loss_mask=[False, True, True, *([False] * len(ids)), *([True] * 6)],
            advantages=np.ones(n + 3), inference_logprobs=[0, 0, 0, *([0.0] * len(ids)), *o.logprobs],
            policy_versions=[0, 0], temperatures=[1.0, 0.7], env_names=["e", "e"], example_ids=[0, 1],
            rewards=[0, 0], total_loss_tokens=8,
            images=join_images([None, (pix, grid)]),
        )  # fmt: skip
        text_part, vision = split_vision(
            to_packed(batch, torch.device("cpu")), batch, image_token_id(eng.model), torch.device("cpu")
        )
        assert text_part.seq_lens.tolist() == [3] and len(vision) == 1 and vision[0].num_tokens == n
        with torch.no_grad():
            lp = forward_multimodal(eng.model, vision[0], wanted=vision[0].loss_mask).logprobs[len(ids) :]
        assert lp.tolist() == pytest.approx(o.logprobs, abs=1e-5)  # at the sampling temperature 0.7
        vision[0].temperatures = None  # at temperature 1 they differ: the temperature is applied
        with torch.no_grad():
            lp1 = forward_multimodal(eng.model, vision[0], wanted=vision[0].loss_mask).logprobs[len(ids) :]
        assert not np.allclose(lp1.numpy(), o.logprobs, atol=1e-3)
        with pytest.raises(InvalidRequest, match="wrote 3 image placeholders for 1 images"):
            eng.vision_prompt(
                parse_messages({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "<|image_pad|><|image_pad|>"},
                    {"type": "image_url", "image_url": {"url": _conversation()[0]["content"][0]["image_url"]["url"]}},
                ]}]}),
                None,
                True,
            )  # fmt: skip
    finally:
        eng.shutdown()
    assert all(math.isfinite(x) and x <= 0 for x in o.logprobs)


def test_color_codeword_rewards_by_exact_match_and_takes_images_per_turn() -> None:
    from hpcrl.envs.base import Task
    from hpcrl.envs.builtin.color_codeword import codeword_accuracy, exact_match
    from hpcrl.envs.registry import load_environment

    env = load_environment("color-codeword", images_per_turn=2, num_examples=8, num_colours=2)
    task = env.tasks("train")[0]
    parts = task.prompt[-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert set(task.answer.split()) <= {"apple", "leaf"} and len(task.answer.split()) == 2
    t = Task(example_id=0, prompt=[], answer="apple leaf")
    reply = lambda s: [{"role": "assistant", "content": s}]  # noqa: E731
    assert exact_match(t, reply(" Apple LEAF\n"), {}) == 1.0
    assert exact_match(t, reply("apple"), {}) == 0.0
    assert codeword_accuracy(t, reply("apple ocean"), {}) == 0.5
    with pytest.raises(ValueError, match="images_per_turn"):
        load_environment("color-codeword", images_per_turn=0)


def test_a_prime_rl_taskset_field_becomes_the_builtins_arg() -> None:
    import msgspec

    from hpcrl.config.sections.orchestrator import EnvConfig
    from hpcrl.envs.sources import source_fallback

    e = EnvConfig(
        id="color-codeword", env={"taskset": {"id": "color-codeword", "images_per_turn": 2, "x": 1}}
    )
    notes: list[str] = []
    out = source_fallback(e, "orchestrator.train.env[0]", notes)
    assert out.args == {"images_per_turn": 2} and out.env == {}
    assert "as its args: images_per_turn" in notes[0] and "not read by it: x" in notes[0]
    mine = msgspec.structs.replace(e, args={"images_per_turn": 3})  # the entry's own args win
    assert source_fallback(mine, "w", []).args == {"images_per_turn": 3}


def test_a_turns_images_cross_the_env_server_wire() -> None:
    import msgspec

    from hpcrl.envs import Turn
    from hpcrl.envs.wire.messages import WTurn, from_wturn, to_wturn

    turn = Turn("t", [1, 2], [3], [-0.5], [0], images=["data:image/png;base64,AAAA"])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wturn(turn)), type=WTurn)
    assert from_wturn(wire).images == ["data:image/png;base64,AAAA"]
    short = msgspec.msgpack.encode(list(msgspec.structs.astuple(to_wturn(turn)))[:-1])  # an older peer's
    assert from_wturn(msgspec.msgpack.decode(short, type=WTurn)).images is None
