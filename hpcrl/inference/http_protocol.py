"""uvicorn's HTTP/1.1 protocol (httptools), answering clients that half-close.

A client that sends a complete request and then shuts down its write side (`shutdown(SHUT_WR)`: `nc -N`,
some health probes, HTTP/1.0 tools) still reads. uvicorn takes that EOF for a disconnect: asyncio
closes the transport when `eof_received` returns a false value, and the response is dropped. Here the
transport stays half-open while a request is being answered (or waits in the pipeline) and is closed
once the last response is written. EOF with no request in flight, or in the middle of one (headers or
body not complete), still closes at once: an incomplete request has nothing to answer.

Parse errors are unchanged (uvicorn writes a 400 and closes); the hot path of a kept-alive request is
unchanged too (one attribute test per response). Selected by passing the class as uvicorn's `http`
(hf backend) or by installing it as uvicorn's "auto" protocol (vLLM's server builds its own config).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HalfCloseProtocol(HttpToolsProtocol):
    _half_closed = False

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
