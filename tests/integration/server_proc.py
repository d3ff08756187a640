"""One real `hpcrl inference` process on 127.0.0.1 for a test module: started, waited for (its
server file in the run directory), its base URL read. Shared by the server tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


def start_inference(
    model_dir: str | Path, run_dir: Path, key: str, max_len: int, log: Path | None = None
) -> tuple[subprocess.Popen, Path, str]:
    """(process, its log file, base URL) of a server on a free loopback port with API key `key`; its
    output goes to `log` (default: run_dir/server.log)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("HPCRL_API_KEY", None)
    cmd = [sys.executable, "-m", "hpcrl.cli", "inference", "--model.name", str(model_dir)]
    cmd += ["--server.host", "127.0.0.1", "--server.port", "0", "--server.api-key", key]
    cmd += ["--run-dir", str(run_dir), "--inference.max-model-len", str(max_len)]
    log = log or run_dir / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    info = RunPaths(run_dir).server_file(0)
    deadline = time.monotonic() + 120
    while not info.exists():
        assert proc.poll() is None and time.monotonic() < deadline, _tail(log)
        time.sleep(0.05)
    return proc, log, json.loads(info.read_text())["base_url"]


def _tail(log: Path) -> str:
    if not log.is_file():  # /dev/full reads zeros for ever
        return f"(its output went to {log})"
    try:
        return log.read_text()[-3000:]
    except OSError as e:  # /dev/full and the like: nothing to read back
        return f"({log}: {e})"
