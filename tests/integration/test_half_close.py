"""Raw bytes to a real hf server on 127.0.0.1, each sent twice: plainly, and followed by
`shutdown(SHUT_WR)` (what `nc -N`, some health probes and HTTP/1.0 tools do).

Whatever reaches the server as an HTTP request gets a status line either way (a parse error 400s, a
complete request reaches its route and gets that route's answer); bytes that are not HTTP at all may
instead be closed without a word. /health answers after every case (hpcrl/inference/http_protocol.py).
"""

from __future__ import annotations

import socket
import time

import pytest

H = b"Host: 127.0.0.1\r\n"


def _post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\n" + H + b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


# label -> (raw bytes, the status a complete valid-HTTP request must get, or None: any status line)
VALID: dict[str, tuple[bytes, int | None]] = {
    "health": (b"GET /health HTTP/1.1\r\n" + H + b"\r\n", 200),
    "health-http10": (b"GET /health HTTP/1.0\r\n\r\n", 200),
    "http09-style": (b"GET /health\r\n\r\n", 200),  # httptools reads it as HTTP/0.9: answered
    "health-no-host": (b"GET /health HTTP/1.1\r\n\r\n", 200),
    "health-conn-close": (b"GET /health HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n", 200),
    "unknown-route": (b"GET /nope HTTP/1.1\r\n" + H + b"\r\n", 404),
    "wrong-method": (b"DELETE /health HTTP/1.1\r\n" + H + b"\r\n", 405),
    "json-truncated": (_post(b"/v1/chat/completions", b'{"messages": ['), 400),
    "json-not-object": (_post(b"/v1/completions", b"[1, 2]"), 400),
    "json-garbage": (_post(b"/tokenize", b"\xff\xfe\x00garbage"), 400),
    "json-surrogate": (_post(b"/tokenize", b'{"prompt": "\\ud800"}'), 400),
    "bad-field": (_post(b"/v1/chat/completions", b'{"messages": 5}'), 400),
    "chunked-body": (
        b"POST /detokenize HTTP/1.1\r\n" + H + b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"tok\r\n0\r\n\r\n',
        400,
    ),
    "pipelined-two": (
        b"GET /health HTTP/1.1\r\n" + H + b"\r\n" + b"GET /nope HTTP/1.1\r\n" + H + b"\r\n",
        200,
    ),
}
MALFORMED: dict[str, bytes] = {
    "long-url": b"GET /" + b"a" * 60_000 + b" HTTP/1.1\r\n" + H + b"\r\n",
    "huge-header": b"GET /health HTTP/1.1\r\n" + H + b"X-Big: " + b"b" * 100_000 + b"\r\n\r\n",
    "many-headers": b"GET /health HTTP/1.1\r\n"
    + H
    + b"".join(b"X-%d: v\r\n" % i for i in range(9000))
    + b"\r\n",
    "http2-version": b"GET /health HTTP/2.0\r\n" + H + b"\r\n",
    "bad-method-char": b"G@T /health HTTP/1.1\r\n" + H + b"\r\n",
    "unknown-method": b"FROB /health HTTP/1.1\r\n" + H + b"\r\n",
    "bad-version": b"GET /health HTTP/9.9\r\n" + H + b"\r\n",
    "version-garbage": b"GET /health HTTX/1.1\r\n" + H + b"\r\n",
    "header-space-before-colon": b"GET /health HTTP/1.1\r\n" + H + b"X-A : b\r\n\r\n",
    "cr-in-header-value": b"GET /health HTTP/1.1\r\n" + H + b"X-A: a\rb\r\n\r\n",
    "chunk-ext-ctl": b"POST /tokenize HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\n2;\x01\r\n{}\r\n0\r\n\r\n",
    "space-in-url": b"GET /he alth HTTP/1.1\r\n" + H + b"\r\n",
    "nul-in-url": b"GET /he\x00alth HTTP/1.1\r\n" + H + b"\r\n",
    "header-no-colon": b"GET /health HTTP/1.1\r\n" + H + b"NoColonHere\r\n\r\n",
    "header-name-space": b"GET /health HTTP/1.1\r\n" + H + b"Bad Name: x\r\n\r\n",
    "header-value-nul": b"GET /health HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n",
    "content-length-neg": b"POST /tokenize HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n",
    "content-length-text": b"POST /tokenize HTTP/1.1\r\n" + H + b"Content-Length: ten\r\n\r\n",
    "content-length-twice": b"POST /tokenize HTTP/1.1\r\n"
    + H
    + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "cl-and-te": b"POST /tokenize HTTP/1.1\r\n"
    + H
    + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad-chunk-size": b"POST /tokenize HTTP/1.1\r\n"
    + H
    + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "te-not-chunked-last": b"POST /tokenize HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked, gzip\r\n\r\n{}",
    "lf-cr-mix": b"GET /health HTTP/1.1\n\rHost: x\r\n\r\n",
    "obs-fold": b"GET /health HTTP/1.1\r\n" + H + b"X-A: a\r\n b\r\n\r\n",
    "ctl-in-method": b"GE\x01T /health HTTP/1.1\r\n" + H + b"\r\n",
    "binary-line": b"\x00\x01\x02\x03 / HTTP/1.1\r\n\r\n",
}
# the status that fits, where one does better than 400 (hpcrl/inference/http_protocol.py)
FITS = {"long-url": 414, "huge-header": 431, "many-headers": 431, "http2-version": 505, "bad-version": 505}
NOT_HTTP: dict[str, bytes] = {
    "tls-hello": bytes.fromhex("160301002a0100002603035f") + b"\x00" * 38,
    "blank-lines": b"\r\n\r\n\r\n",
    "incomplete-headers": b"GET /health HTTP/1.1\r\nHost: x\r\n",
    "incomplete-body": b"POST /tokenize HTTP/1.1\r\n" + H + b'Content-Length: 100\r\n\r\n{"pro',
}


def _exchange(port: int, raw: bytes, half_close: bool, wait_s: float = 10.0) -> bytes:
    """Send `raw`, optionally shut the write side, read until a status line arrives (plain: no more
    needed; the connection may stay alive) or the server closes; b"" = closed without a word."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        got = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:  # the server closed with our bytes unread: what came before counts
                return got
            if not chunk:
                return got
            got += chunk
            if not half_close and b"\r\n\r\n" in got:
                return got
        return got + b"<no close>"


def _status(resp: bytes) -> int | None:
    if not resp.startswith(b"HTTP/1."):
        return None
    return int(resp.split(b" ", 2)[1])


def _health_ok(port: int) -> None:
    resp = _exchange(port, VALID["health"][0], half_close=True)
    assert _status(resp) == 200 and b'"status":"ok"' in resp, resp[:300]


@pytest.fixture(scope="module")
def port(inference_server) -> int:
    return inference_server.port


@pytest.mark.parametrize("half_close", [False, True], ids=["plain", "half-closed"])
@pytest.mark.parametrize("label", list(VALID))
def test_complete_request_gets_its_answer(port, label, half_close):
    raw, want = VALID[label]
    resp = _exchange(port, raw, half_close)
    assert _status(resp) == want, (label, resp[:300])
    if half_close:  # answered, then closed: the whole response arrived (the loop ended on EOF)
        assert not resp.endswith(b"<no close>"), resp[-200:]
    if label == "pipelined-two" and half_close:
        assert resp.count(b"HTTP/1.1 ") == 2 and b"404 Not Found" in resp, resp[:600]
    _health_ok(port)


@pytest.mark.parametrize("half_close", [False, True], ids=["plain", "half-closed"])
@pytest.mark.parametrize("label", list(MALFORMED))
def test_malformed_request_gets_a_status_line(port, label, half_close):
    resp = _exchange(port, MALFORMED[label], half_close)
    status = _status(resp)
    assert status is not None and 400 <= status < 600 and status != 500, (label, resp[:300])
    assert status == FITS.get(label, 400), (label, resp[:300])
    _health_ok(port)


@pytest.mark.parametrize("half_close", [False, True], ids=["plain", "half-closed"])
@pytest.mark.parametrize("label", list(NOT_HTTP))
def test_not_http_is_answered_400_or_closed(port, label, half_close):
    resp = _exchange(port, NOT_HTTP[label], half_close, wait_s=1.0 if not half_close else 10.0)
    if half_close:  # the server must not hold a half-closed connection that has nothing to answer
        assert resp == b"" or _status(resp) == 400, (label, resp[:300])
    else:  # plainly sent it may also wait for the rest (incomplete) until the client gives up
        assert resp in (b"", b"<no close>") or _status(resp) == 400, (label, resp[:300])
    _health_ok(port)


def test_case_counts():
    assert len(MALFORMED) >= 20 and len(VALID) + len(MALFORMED) + len(NOT_HTTP) >= 35
