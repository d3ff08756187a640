"""The embedded engine's requests with images (hpcrl.inference.vision): each steps once per engine
iteration beside the text rows, so a text request and a weight update never wait for a long image
request; a failing image request fails alone; the vision encoder runs once per request whatever its n;
an image request's rows count against max_batch_size; the server reads no local file a client names."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def engine(tiny_vlm: Path):
    from hpcrl.inference.engine import HFEngine

    eng = HFEngine(str(tiny_vlm), max_batch_size=4, max_model_len=256)
    yield eng
    eng.shutdown()


def _image_prompt(eng) -> tuple[list[int], dict]:
    from hpcrl.envs.builtin.color_codeword import png_data_url
    from hpcrl.inference.protocol import parse_messages

    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url((200, 10, 10), 48)}},
                {"type": "text", "text": "What is the codeword?"},
            ],
        }
    ]
    return eng.vision_prompt(parse_messages({"messages": msgs}), None, True)


def _params(**kw):
    from hpcrl.inference.protocol import parse_sampling

    return parse_sampling({"temperature": 1.0, "ignore_eos": True, **kw}, chat=True)


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_text_requests_and_weight_updates_do_not_wait_for_a_long_image_request(engine) -> None:
    ids, mm = _image_prompt(engine)
    room = engine.max_model_len - len(ids)
    prefills = engine.stats["prefills"]
    img = engine.submit(ids, _params(max_tokens=room, n=2), mm)
    _wait(lambda: engine.stats["prefills"] > prefills, "the image request's prefill")
    text = engine.submit(engine.tokens.encode_text("hi"), _params(max_tokens=3)).result(timeout=60)
    assert len(text[0].token_ids) == 3
    assert not img.done(), "the text request waited for the image request"
    # a weight update lands between two steps of the image request, not after it
    name, p = next(iter(engine.named_weights().items()))
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (engine.update_weights({name: p.detach().clone()}, step=1), done.set())
    )
    t.start()
    assert done.wait(timeout=60)
    assert not img.done(), "the weight update waited for the image request"
    outs = img.result(timeout=120)
    assert [len(o.token_ids) for o in outs] == [room, room]
    assert all(o.policy_steps == [0, 1] for o in outs)  # each token tagged with its forward's policy


def test_a_failing_image_request_fails_alone_and_names_the_cause(engine) -> None:
    from hpcrl.inference.errors import EngineFailed

    ids, mm = _image_prompt(engine)
    generated = engine.stats["generated_tokens"]
    text = engine.submit(engine.tokens.encode_text("hello"), _params(max_tokens=60))
    _wait(lambda: engine.stats["generated_tokens"] > generated, "the text request to run")
    bad = {"pixel_values": torch.zeros(4, 7), "image_grid_thw": mm["image_grid_thw"]}  # wrong width
    with pytest.raises(EngineFailed, match="RuntimeError"):
        engine.submit(ids, _params(max_tokens=4), bad).result(timeout=60)
    assert len(text.result(timeout=60)[0].token_ids) == 60  # the running text request is unharmed
    outs = engine.submit(ids, _params(max_tokens=2), mm).result(timeout=60)  # and so is the engine
    assert len(outs[0].token_ids) == 2


def test_the_vision_encoder_runs_once_per_request_and_its_rows_count_against_the_batch(engine) -> None:
    from hpcrl.inference.errors import InvalidRequest

    ids, mm = _image_prompt(engine)
    seen: list[int] = []
    hook = engine.model.model.visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        outs = engine.submit(ids, _params(max_tokens=3, n=3), mm).result(timeout=60)
    finally:
        hook.remove()
    assert seen == [mm["pixel_values"].shape[0]]  # one image's patches, not n copies
    assert len(outs) == 3 and all(len(o.token_ids) == 3 for o in outs)
    with pytest.raises(InvalidRequest, match="max_batch_size 4") as e:
        engine.submit(ids, _params(max_tokens=3, n=5), mm)
    assert e.value.param == "n"


@pytest.mark.parametrize(
    "url", ["/etc/hostname", "file:///etc/hostname", "http://example.com/a.png", "aGVsbG8="]
)
def test_the_server_takes_only_data_urls_and_touches_no_file(
    engine, tiny_vlm: Path, url: str, monkeypatch
) -> None:
    from starlette.testclient import TestClient

    from hpcrl.inference.api import ServerState, build_app

    def no_file(*a, **k):
        raise AssertionError("the server touched the filesystem for a client's image")

    client = TestClient(build_app(ServerState(engine, "m", str(tiny_vlm))))
    monkeypatch.setattr(Path, "is_file", no_file)
    monkeypatch.setattr(Path, "read_bytes", no_file)
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    r = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": content}]}
    )
    assert r.status_code == 400, r.text
    assert "messages[0].content[1].image_url" in r.json()["error"]["message"]
