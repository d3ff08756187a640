"""/init_broadcaster answers within 10 s whatever its peer does, naming the peer, and the server stays
healthy; the same request succeeds once a real peer (trainer rank 0's weight group) is up.

A dead peer is a closed port on 127.0.0.1, a silent one a socket there that accepts and never answers.
The requests leave `timeout` and `join_timeout` out: the server's default bound (server.control_timeout_s,
8 s) applies. hpcrl/inference/peers.py.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from hpcrl.weights.collective import destroy_group, init_group

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # two joins wait out the 8 s default bound on purpose


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(http: httpx.Client, port: int, **extra) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = http.post(
        "/init_broadcaster", json={"host": "127.0.0.1", "port": port, "world_size": 2, "rank": 1, **extra}
    )
    return r, time.monotonic() - t0


def _join_with_real_peer(http: httpx.Client, port: int) -> httpx.Response:
    """Trainer rank 0 hosts the group on `port` while the server joins it as rank 1 (the same request)."""
    box: dict = {}

    def trainer() -> None:
        box["group"] = init_group("127.0.0.1", port, 2, 0, backend="gloo", timeout_s=60)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    r, took = _join(http, port)
    t.join(timeout=30)
    assert "group" in box, "the trainer side never formed the group"
    destroy_group(box["group"])
    assert took < 10, took
    return r


@pytest.fixture(scope="module")
def http(tiny_model_dir, tmp_path_factory):
    from tests.conftest import InferenceServer

    s = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("control_run"))
    client = httpx.Client(base_url=s.base_url, timeout=30)
    yield client
    client.close()
    s.stop()


def _healthy(http: httpx.Client) -> None:
    t0 = time.monotonic()
    assert http.get("/health").json()["status"] == "ok"
    assert time.monotonic() - t0 < 2


def test_closed_port_is_502_naming_the_peer_then_the_same_join_succeeds(http):
    port = _free_port()
    r, took = _join(http, port)
    assert took < 10, took
    err = r.json()["error"]
    assert r.status_code == 502 and f"127.0.0.1:{port}" in err["message"], r.text
    assert "nothing accepted a TCP connection" in err["message"]
    _healthy(http)
    ok = _join_with_real_peer(http, port)
    assert ok.status_code == 200 and ok.json()["rank"] == 1, ok.text
    _healthy(http)


def test_silent_peer_is_504_naming_the_peer_then_the_same_join_succeeds(http):
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    try:
        r, took = _join(http, port)
        assert took < 10, took
        _healthy(http)
    finally:
        silent.close()  # the join stuck on it fails now, in its own thread; the server does not care
    err = r.json()["error"]
    assert r.status_code == 504 and f"127.0.0.1:{port}" in err["message"], r.text
    assert "accepted the connection" in err["message"] and err["param"] == "join_timeout"
    ok = _join_with_real_peer(http, port)
    assert ok.status_code == 200, ok.text
    _healthy(http)


def test_join_timeout_request_field_sets_the_bound(http):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        r, took = _join(http, silent.getsockname()[1], join_timeout=1.5)
    assert r.status_code == 504 and "1.5 s" in r.json()["error"]["message"], r.text
    assert took < 6, took  # 1.5 s bound, generous for a loaded machine
    bad, _ = _join(http, 1, join_timeout=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "join_timeout", bad.text
