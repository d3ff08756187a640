"""uvicorn's HTTP/1.1 protocol (httptools), answering clients that half-close.

A client that sends a complete request and then shuts down its write side (`shutdown(SHUT_WR)`: `nc -N`,
some health probes, HTTP/1.0 tools) still reads. uvicorn takes that EOF for a disconnect: asyncio
closes the transport when `eof_received` returns a false value, and the response is dropped. Here the
transport stays half-open while a request is being answered (or waits in the pipeline) and is closed
once the last response is written. EOF with no request in flight, or in the middle of one (headers or
body not complete), still closes at once: an incomplete request has nothing to answer.

A request the parser refuses gets the status that fits (with the JSON error body every route
answers with), then the close: 505 for an HTTP version
other than 1.0/1.1 (0.9's bare request line is served as uvicorn serves it), 414 for a request target
over MAX_URL_BYTES, 431 for headers over MAX_HEADER_BYTES (httptools itself has no limits), 400 for
anything else. The hot path of a kept-alive request adds a length sum per header and one attribute
test per response. Selected by passing the class as uvicorn's `http` (hf backend) or by installing it
as uvicorn's "auto" protocol (vLLM's server builds its own config).
"""

from __future__ import annotations

import json
import sys

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_URL_BYTES = 16 * 1024  # every hpcrl route takes its input in the body; h11's default is 16 KiB too
MAX_HEADER_BYTES = 64 * 1024
_REASONS = {
    400: "Invalid HTTP request received.",
    414: f"Request target longer than {MAX_URL_BYTES} bytes.",
    431: f"Request headers larger than {MAX_HEADER_BYTES} bytes.",
    505: "HTTP version not supported (use HTTP/1.1 or HTTP/1.0).",
}


def error_body(reason: str, status: int) -> bytes:
    """The JSON error every hpcrl route answers with (api.py's APIError shape), for a request that
    never became one: the parser refused it."""
    err = {"message": reason, "type": "BadRequestError" if status == 400 else "HTTPError", "param": None}
    return json.dumps({"error": {**err, "code": status}}).encode("ascii")


class _Refused(Exception):
    def __init__(self, status: int):
        self.status = status


def _status_of(exc: BaseException | None) -> int:
    """The status for the parser error being handled (uvicorn only says "400")."""
    if exc is None:
        return 400
    if isinstance(exc.__context__, _Refused):
        return exc.__context__.status
    return 505 if "HTTP version" in str(exc) else 400


class HalfCloseProtocol(HttpToolsProtocol):
    _half_closed = False
    _header_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > MAX_URL_BYTES:
            raise _Refused(414)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Refused(431)

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in ("1.1", "1.0", "0.9"):
            raise _Refused(505)
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this inside its `except HttpParserError`: answer the status that fits."""
        status = _status_of(sys.exc_info()[1])
        reason = msg if status == 400 else _REASONS[status]
        body = error_body(reason, status)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()

    def _answering(self) -> bool:
        """A complete request whose response is not finished, or a pipelined one waiting its turn."""
        cycle = self.cycle
        in_flight = cycle is not None and not cycle.response_complete and not cycle.more_body
        return in_flight or bool(self.pipeline)

    def _mid_request(self) -> bool:
        """EOF inside a request: its headers are in but not its whole body."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and cycle.more_body

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._answering() and not self._mid_request():
            self._half_closed = True
            return True  # keep the transport open for writing; closed in on_response_complete
        return None  # asyncio closes the transport: nothing complete to answer

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed and not self._answering() and not self.transport.is_closing():
            self.transport.close()


def install_as_auto() -> None:
    """Make uvicorn's "auto" HTTP protocol this one, for servers whose uvicorn config hpcrl does not
    build (vLLM's): uvicorn looks "auto" up in this module attribute when a config loads."""
    import uvicorn.protocols.http.auto as auto

    auto.AutoHTTPProtocol = HalfCloseProtocol  # type: ignore[misc]
