"""Read an offline W&B run (`run-<id>.wandb`) without syncing it: what did the sink log?

wandb ≥ 0.19 has no Python reader for its transaction log any more, and an offline run writes no
summary file, so this is the small reader the tests (and a curious user) use. The format is
LevelDB's log format with a 7-byte W&B header: 32 KiB blocks of records, each
`crc32 (4) | length (2) | type (1) | payload`, where FULL or FIRST/MIDDLE/LAST pieces make one
`wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_payloads(data: bytes):
    """Protobuf payloads of a `.wandb` file's bytes; stops at a torn tail."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log (bad magic)")
    pos, parts = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = chunk
        elif kind == _MIDDLE:
            parts += chunk
        elif kind == _LAST:
            yield parts + chunk
            parts = b""
        else:  # zero padding / end of a preallocated block
            break


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    resumed: bool = False
    exited: bool = False  # the run's exit record is there: finish() completed, nothing is missing
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # define_metric records


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(path: Path) -> OfflineRun:
    """Parse one `.wandb` file, or the newest one under a directory (e.g. a WANDB_DIR)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
        if not files:
            raise FileNotFoundError(f"no run-*.wandb under {path}")
        path = files[-1]
    out = OfflineRun()
    for payload in iter_payloads(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.project, out.name = rec.run.run_id, rec.run.project, rec.run.display_name
            out.resumed = bool(rec.run.resumed)
            out.config.update({_item_key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "history":
            out.history.append({_item_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            out.config.update({_item_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "exit":
            out.exited = True
        elif kind == "metric":
            out.metrics.append(
                {"name": rec.metric.name, "glob": rec.metric.glob_name, "step_metric": rec.metric.step_metric}
            )
    return out


def read_offline_runs(directory: Path) -> list[OfflineRun]:
    """Every `.wandb` file under `directory`, oldest first (a resumed run writes a second one)."""
    files = sorted(Path(directory).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
    return [read_offline_run(f) for f in files]
