"""ZMQ doorbell: a best-effort 'look now' hint from a writer to a waiting reader.

The reader binds a PULL socket on a free port and publishes its address in
RunPaths.endpoint_file(name) (atomic JSON), so writers on any node find it through the shared
filesystem. A writer keeps one PUSH socket per reader and re-stats the endpoint file on every ring:
a restarted reader writes a new file (new inode, new nonce), the writer drops the old socket and
connects to the new address.

Correctness never depends on a ring arriving: readers wait on the socket for at most one poll
interval and then rescan the directory anyway. So a lost, duplicated, reordered or early ring costs
at most one poll interval, and a dead reader costs the writer nothing: sends are non-blocking,
bounded by SNDHWM, and closed with LINGER 0. ZMQ_IMMEDIATE is deliberately left off: each PUSH
socket has exactly one peer, and letting a ring queue on a connection that is still handshaking is
what makes the first ring after a (re)connect arrive instead of being dropped.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from hpcrl.bus.errors import CorruptMessageError
from hpcrl.bus.messages import Endpoint, Ring, decode_json, encode_json
from hpcrl.fileio import fsync_dir, write_atomic
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.bus")

_SNDHWM = 64  # rings are hints: a reader this far behind rescans anyway
_RCVHWM = 1024
_ring_encoder = msgspec.msgpack.Encoder()
_ring_decoder = msgspec.msgpack.Decoder(Ring)


def resolve_host(host: str) -> str:
    """'auto' -> an address other nodes can reach (the interface of the default route); else as is."""
    if host != "auto":
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class DoorbellReader:
    """The listening side: bind, announce the address, wait for rings."""

    def __init__(self, paths: RunPaths, name: str, host: str = "127.0.0.1"):
        self.paths = paths
        self.name = name
        self.host = resolve_host(host)
        self.endpoint_file = paths.endpoint_file(name)
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
        self.endpoint = Endpoint(
            name=name,
            address=self.address,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            nonce=secrets.token_hex(8),
        )
        write_atomic(self.endpoint_file, [encode_json(self.endpoint)])

    def wait(self, timeout: float) -> list[Ring]:
        """Block up to `timeout` seconds for rings; return every ring queued by then (maybe none)."""
        rings: list[Ring] = []
        if self._sock.poll(max(0, math.ceil(timeout * 1000))):
            while True:
                try:
                    raw = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    rings.append(_ring_decoder.decode(raw))
                except msgspec.DecodeError:
                    log.warning("doorbell %s: ignored a malformed ring (%d bytes)", self.name, len(raw))
        return rings

    def fileno(self) -> int:
        """A file descriptor an event loop can watch (``loop.add_reader``). zmq signals it when the
        socket's state may have changed; :meth:`has_rings` (or a receive) re-arms it."""
        return int(self._sock.getsockopt(zmq.FD))

    def has_rings(self) -> bool:
        """Rings are queued (also re-arms :meth:`fileno`, which zmq signals edge-style)."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def close(self) -> None:
        self._sock.close(linger=0)
        # Remove the address only if it is still ours: a successor may already have replaced it.
        try:
            current = decode_json(self.endpoint_file.read_bytes(), Endpoint)
        except (OSError, CorruptMessageError):
            return
        if current.nonce == self.endpoint.nonce:
            try:
                self.endpoint_file.unlink()
                fsync_dir(self.endpoint_file.parent)
            except FileNotFoundError:
                pass


@dataclass
class _Peer:
    signature: tuple[int, int, int]  # (inode, mtime_ns, size) of the endpoint file we connected from
    address: str
    sock: zmq.Socket


class DoorbellWriter:
    """The ringing side: never blocks, never raises for a missing or dead reader."""

    def __init__(self, paths: RunPaths):
        self.paths = paths
        self._peers: dict[str, _Peer] = {}
        self._unreadable: dict[str, tuple[int, int, int]] = {}  # parsed once per file version
        self.sent = 0
        self.dropped = 0

    def ring(self, name: str, ring: Ring) -> bool:
        """Ring reader `name`. True if the ring was queued (not that it will arrive)."""
        sock = self._socket_for(name)
        if sock is None:
            self.dropped += 1
            return False
        ring.sent_at = time.time()
        try:
            sock.send(_ring_encoder.encode(ring), zmq.NOBLOCK)
        except zmq.Again:  # HWM reached: the reader is gone or far behind; it will rescan
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def ring_all(self, ring: Ring, *, exclude: str | None = None, skip_role: str | None = None) -> int:
        """Ring every announced reader except `exclude` and the readers of role `skip_role` (endpoint
        names `<role>_<rank>`); returns how many were queued."""
        if not self.paths.endpoints_dir.is_dir():
            return 0
        skip = f"{skip_role}_" if skip_role else None
        names = sorted(p.stem for p in self.paths.endpoints_dir.glob("*.json"))
        wanted = [n for n in names if n != exclude and not (skip and n.startswith(skip))]
        return sum(self.ring(n, Ring(ring.topic, ring.step, ring.rank)) for n in wanted)

    def _socket_for(self, name: str) -> zmq.Socket | None:
        path: Path = self.paths.endpoint_file(name)
        peer = self._peers.get(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if peer is not None:  # reader closed cleanly; forget it
                self._drop(name)
            return None
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if peer is not None and peer.signature == signature:
            return peer.sock
        if self._unreadable.get(name) == signature:
            return None
        try:
            endpoint = decode_json(path.read_bytes(), Endpoint)
        except (OSError, CorruptMessageError) as e:
            # Other components keep address files here too (e.g. the weight-broadcast rendezvous).
            self._unreadable[name] = signature
            log.debug("doorbell: %s is not a doorbell endpoint (%s); not ringing it", path, e)
            return None
        if peer is not None and peer.address == endpoint.address:
            peer.signature = signature
            return peer.sock
        self._drop(name)
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.connect(endpoint.address)
        self._peers[name] = _Peer(signature, endpoint.address, sock)
        log.debug("doorbell: %s is at %s", name, endpoint.address)
        return sock

    def _drop(self, name: str, linger_ms: int = 0) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            peer.sock.close(linger=linger_ms)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket. A writer that rang just before closing (a short-lived one) passes a
        linger: rings still queued while the connection is being made are sent for that long in
        zmq's I/O thread instead of being discarded (close itself does not block)."""
        for name in list(self._peers):
            self._drop(name, linger_ms)
