"""Vision-language RL on the orchestrator's side: the image processor off the event loop, an LRU of
the rollouts' images, each unique image stored once on the batch wire, and the algorithms that score
token ids only refused with [model.vlm]."""

from __future__ import annotations

import asyncio
import time

import numpy as np


class _Vision:
    """SampleImages' processor stand-in: image "ref" is 2x2 patches of value len(ref); slow on demand."""

    image_id = 7

    def __init__(self, delay: float = 0.0):
        self.calls: list[str] = []
        self.delay = delay

    def encode(self, refs, where):
        import torch

        time.sleep(self.delay)
        self.calls.extend(refs)
        return {
            "pixel_values": torch.full((4, 3), float(len(refs[0]))),
            "image_grid_thw": torch.tensor([[1, 2, 2]]),
        }

    def tokens_per_image(self, grid):
        return [int(np.prod(g)) // 4 for g in np.asarray(grid)]


def test_sample_images_keeps_the_recently_used_images() -> None:
    from hpcrl.orchestrator.images import SampleImages

    vision = _Vision()
    images = SampleImages(vision, cache_size=2)
    for ref in ["a", "bb", "a", "ccc", "a"]:
        images._one(ref)
    assert vision.calls == ["a", "bb", "ccc"]  # "a" was used last: "bb" left, not the whole cache
    assert list(images.cache) == ["ccc", "a"]


def test_image_tokens_run_the_processor_off_the_event_loop() -> None:
    from hpcrl.orchestrator.chat import ConversationClient
    from hpcrl.orchestrator.images import SampleImages

    class Pool:
        def pick(self):
            return 0

    client = ConversationClient(Pool(), 64, None, lambda: 0)
    client.images = SampleImages(_Vision(delay=0.3))
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
        }
    ]
    ticks: list[float] = []

    async def ticker() -> None:
        for _ in range(20):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    span: list[float] = []

    async def main() -> int:
        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        span.append(time.monotonic())
        got = await client.image_tokens(msgs)
        span.append(time.monotonic())
        await t
        return got

    assert asyncio.run(main()) == 0  # one image of 1 merged patch: no token added to its placeholder
    # the loop kept running meanwhile: ticks (every 10 ms) while the processor took its 0.3 s; run on
    # the loop, it would have blocked them all until it returned
    assert sum(span[0] < x < span[1] for x in ticks) >= 3, (span, ticks)


def test_reference_scoring_algorithms_are_refused_with_model_vlm(tmp_path) -> None:
    import pytest

    from hpcrl.config.loader import load
    from hpcrl.errors import ConfigError
    from tests.conftest import rl_toml

    teacher = '[orchestrator.algo.teacher]\nname = "t"\nbase_url = "http://localhost:8001/v1"\n'
    cases = {
        "orchestrator.algo.type": '[orchestrator.algo]\ntype = "opd"\n' + teacher,
        "orchestrator.train.env[0].algo.type": '[orchestrator.train.env.algo]\ntype = "opsd"\n',
    }
    for i, (field, algo) in enumerate(cases.items()):
        f = tmp_path / f"cfg{i}.toml"
        f.write_text(rl_toml() + algo + "[model.vlm]\n")
        with pytest.raises(ConfigError) as e:
            load([str(f), "--output-dir", str(tmp_path / "out")])
        assert e.value.path == field and "[model.vlm]" in str(e.value) and "\n" not in str(e.value)
    f = tmp_path / "ok.toml"
    f.write_text(rl_toml() + "[model.vlm]\n")
    assert load([str(f), "--output-dir", str(tmp_path / "out")]).config.model.vlm is not None


def _sample(example: int, mm):
    from hpcrl.orchestrator.packing import Sample

    n = 8
    return Sample(
        input_ids=np.full(n, example, np.int32),
        loss_mask=np.arange(n) >= 6,
        inference_logprobs=np.zeros(n, np.float32),
        advantage=1.0,
        policy_version=0,
        example_id=example,
        env_name="e",
        temperature=1.0,
        reward=0.0,
        mm=mm,
        image_end=4,
    )


def test_a_groups_shared_image_is_stored_once_and_the_trainer_copies_it_once() -> None:
    import torch

    from hpcrl.bus.messages import TrainBatch, decode, encode
    from hpcrl.orchestrator.batch import build_batches, repack_batches
    from hpcrl.trainer.rl import to_packed
    from hpcrl.trainer.rl_vlm import split_vision

    grid = np.asarray([[1, 16, 16]], np.int32)  # 256 patches
    img = lambda v: (np.full((256, 64), v, np.float32), grid.copy())  # noqa: E731
    shared = img(1.0)
    group = [
        _sample(0, shared),
        _sample(0, shared),
        _sample(0, img(1.0)),
        _sample(0, img(1.0)),
    ]  # equal content
    distinct = [_sample(0, img(float(v))) for v in range(4)]
    text = [_sample(0, None) for _ in range(4)]
    size = {
        k: len(encode(build_batches(s, 1, 1, 8)[0][0]))
        for k, s in [("g", group), ("d", distinct), ("t", text)]
    }
    one_image = 256 * 64 * 4
    assert size["d"] - size["t"] >= 4 * one_image
    assert size["g"] - size["t"] < 1.1 * one_image  # ~1/4 of the distinct images' bytes
    back = decode(encode(build_batches(group, 1, 1, 8)[0][0]), TrainBatch)
    assert back.images.pixel_values.shape == (256, 64) and back.images.index.tolist() == [0, 0, 0, 0]
    assert [back.images.sample(i)[1].tolist() for i in range(4)] == [[[1, 16, 16]]] * 4
    assert repack_batches([back], 1, 8)[0].images.pixel_values.shape == (256, 64)  # still once after a resume
    _, vision = split_vision(to_packed(back, torch.device("cpu")), back, 7, torch.device("cpu"))
    pix = [v.mm["pixel_values"] for v in vision]
    assert len(pix) == 4 and all(p is pix[0] for p in pix)  # one tensor for the four samples
    assert pix[0].data_ptr() == back.images.pixel_values.ctypes.data  # no host copy of the decoded bytes


def test_an_image_index_outside_the_distinct_images_is_refused() -> None:
    import pytest

    from hpcrl.bus.images import ImageBatch

    pix, grid = np.zeros((4, 3), np.float32), [[1, 2, 2]]
    assert ImageBatch(
        pixel_values=pix, image_grid_thw=grid, images_per_sample=[1, 1], image_index=[0, 0]
    ).sample(1)[1].tolist() == [[1, 2, 2]]
    with pytest.raises(ValueError, match=r"image_index must be 1-D in \[0, 1\)"):
        ImageBatch(pixel_values=pix, image_grid_thw=grid, images_per_sample=[1, 1], image_index=[0, 1])
    with pytest.raises(ValueError, match="sums to 2, the samples have 1 images"):
        ImageBatch(pixel_values=pix, image_grid_thw=grid, images_per_sample=[1, 1], image_index=[0])
