"""The processes of scripts/bench/weight_sync_check.py and their memory: /proc sampling (Watch, PeakRSS),
the model dir, one `hpcrl inference` server and its chat requests, a trainer rank publishing (the
`--worker` of weight_sync_check.py) and the driver of the servers it publishes into. The phases, the
tables and the command line are in weight_sync_check.py, which imports this module from its folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from weights_sharded import PeakRSS  # noqa: E402  (the caller puts scripts/bench on sys.path)

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
REVERSE_PROMPTS = ["apple", "tiger", "house", "cloud", "river", "light", "stone", "green"]


# -- memory of other processes ---------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int] | None:
    """VmRSS, VmHWM, RssAnon, RssFile of `pid` in bytes (None: gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key in FIELDS:
            out[key] = int(val.split()[0]) * 1024
    return out if len(out) == len(FIELDS) else None


class Watch:
    """Samples /proc/PID/status of every process `pids()` names ({label: pid}) every `every` s:
    per label the peak VmRSS and RssAnon seen, the last VmHWM read (the kernel's own peak RSS), and a
    series (every `coarse` s) of (unix time, rss, anon)."""

    def __init__(
        self,
        pids: Callable[[], dict[str, int]],
        every: float = 0.05,
        refresh: float = 1.0,
        coarse: float = 0.2,
    ):
        self.pids, self.every, self.refresh, self.coarse = pids, every, refresh, coarse
        self.peaks: dict[str, dict[str, float]] = {}
        self.series: dict[str, list[tuple[float, int, int]]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self.t0 = time.time()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def _run(self) -> None:
        known: dict[str, int] = {}
        next_refresh = 0.0
        while not self._stop.is_set():
            now = time.time()
            if now >= next_refresh:
                try:
                    known = dict(self.pids())
                except Exception:  # noqa: BLE001 - a half-written placement file: next time
                    pass
                next_refresh = now + self.refresh
            for label, pid in known.items():
                st = proc_status(pid)
                if st is None:
                    continue
                pk = self.peaks.setdefault(
                    label, {"pid": pid, "rss": 0, "anon": 0, "hwm": 0, "anon_at": 0.0, "samples": 0}
                )
                if pk["pid"] != pid:  # a restarted process: a new peak
                    pk.update(pid=pid, rss=0, anon=0, hwm=0)
                pk["rss"] = max(pk["rss"], st["VmRSS"])
                pk["hwm"] = max(pk["hwm"], st["VmHWM"])
                if st["RssAnon"] > pk["anon"]:
                    pk["anon"], pk["anon_at"] = st["RssAnon"], round(now, 2)
                pk["samples"] += 1
                ser = self.series.setdefault(label, [])
                if not ser or now - ser[-1][0] >= self.coarse:
                    ser.append((round(now, 2), st["VmRSS"], st["RssAnon"]))
            self._stop.wait(self.every)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the model ---------------------------------------------------------------------------------------
def model_config(layers: int, tokenizer: object):
    from transformers import Qwen3Config

    from hpcrl.models.tiny import _common_config

    return Qwen3Config(
        **{
            **_common_config(tokenizer),
            "vocab_size": 151_936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        }
    )


def build_model_dir(out: Path, layers: int) -> tuple[Path, int]:
    """The model + tokenizer as a Hugging Face dir (built once; seeded): (dir, parameters)."""
    marker = out / "weight_sync_check.json"
    if marker.exists() and json.loads(marker.read_text()).get("layers") == layers:
        return out, json.loads(marker.read_text())["params"]
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hpcrl.models.tiny import build_tokenizer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tok = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(layers, tok))
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id],
        pad_token_id=tok.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"layers": layers, "params": n}))
    return out, n


# -- servers -----------------------------------------------------------------------------------------
class Server:
    """One `hpcrl inference` process on 127.0.0.1 announcing itself in `run_dir` (index `index`)."""

    def __init__(self, model_dir: Path, run_dir: Path, index: int, timeout: float = 300.0):
        from hpcrl.paths import RunPaths

        RunPaths(run_dir).make_dirs()
        info = RunPaths(run_dir).server_file(index)
        info.unlink(missing_ok=True)
        self.log = run_dir / f"inference_{index}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        env.pop("HPCRL_API_KEY", None)
        cmd = [str(Path(sys.executable).parent / "hpcrl"), "inference", "--model.name", str(model_dir)]
        cmd += ["--server.port", "0", "--run-dir", str(run_dir), "--server-index", str(index)]
        cmd += ["--watchdog-s", "0"]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not info.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {index} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.base_url = json.loads(info.read_text())["base_url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def chat_rounds(url: str, rounds: int, concurrent: int) -> int:
    """`rounds` x `concurrent` reverse-text chat requests of n=4, max_tokens=8 (the run's shape)."""
    from hpcrl.inference.client import InferenceClient

    done = 0
    async with InferenceClient(url, timeout=600) as c:
        await c.wait_healthy(timeout=300)
        for r in range(rounds):
            words = [REVERSE_PROMPTS[(r * concurrent + i) % len(REVERSE_PROMPTS)] for i in range(concurrent)]
            msgs = [[{"role": "user", "content": f"Reverse the text: {w}"}] for w in words]
            outs = await asyncio.gather(*(c.chat_completion(m, n=4, max_tokens=8) for m in msgs))
            done += sum(len(o["choices"]) for o in outs)
    return done


# -- a trainer rank publishing, and the servers it publishes into ---------------------------------
def build_sharded(model_dir: str):
    """The model dir's architecture on meta, FSDP2-sharded, materialised shard by shard (random)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.models import parallelize as mp

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = mp.apply_fsdp(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=g) * 0.02)
    return model


def worker(model_dir: str, wport: int, steps: int, chunk_mb: float, dtype: str, run: str, out: str) -> None:
    import gc

    import torch

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.weights.collective import init_group

    env = par.init_distributed(torch.device("cpu"))
    t = env.world_size
    group = init_group(
        "127.0.0.1", wport, t + 2, env.rank, backend="gloo", timeout_s=900, senders=t,
        servers=((t, 1), (t + 1, 1)),
    )  # fmt: skip
    model = build_sharded(model_dir)
    paths = RunPaths(run)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    rows = []
    with Bus(paths, "trainer", env.rank, listen=False) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, "collective", keep=2, weight_group=group, bucket_mb=chunk_mb,
            dtype=dtype, sharded=True, shard_bucket_mb=chunk_mb,
        )  # fmt: skip
        for step in range(steps):
            gc.collect()
            par.barrier()
            with PeakRSS() as m:
                start = time.time()
                t0 = time.perf_counter()
                pub.publish(model, step)
                par.barrier()
                dt = time.perf_counter() - t0
            rows.append(
                {"step": step, "start": start, "s": dt, "held": m.peak - m.base, "base": m.base, "rss": m.peak,
                 "sent": pub.last_rank_bytes}
            )  # fmt: skip
    Path(out).write_text(json.dumps({"rank": env.rank, "rows": rows, "stats": group.stats}))
    par.barrier()
    par.destroy_distributed()


async def drive_servers(
    urls: list[str], wport: int, t: int, steps: int, bus_run: Path, serve_rounds: int
) -> tuple[list[dict], int]:
    """Both servers: the serve-only baseline's requests, join the weight group, --steps collective
    updates on both at once (each answer's checksum must equal the PolicyReady the trainer announced),
    the same requests again. Returns the updates and the completions served."""
    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.inference.client import InferenceClient
    from hpcrl.paths import RunPaths

    clients = [InferenceClient(u, timeout=1800) for u in urls]
    try:
        served = sum(await asyncio.gather(*(chat_rounds(u, serve_rounds, 4) for u in urls)))
        await asyncio.gather(
            *(
                c.init_broadcaster("127.0.0.1", wport, t + 2, t + i, timeout=900, join_timeout=600)
                for i, c in enumerate(clients)
            )
        )
        rows = []
        for step in range(steps):

            async def one(c: InferenceClient, step: int = step) -> tuple[dict, float, float]:
                t0 = time.time()
                r = await c.update_weights(step, collective=True)
                return r, t0, time.time()

            got = await asyncio.gather(*(one(c) for c in clients))
            msg = read_message(RunPaths(bus_run).policy_file(step), PolicyReady)
            rows.append(
                {
                    "step": step,
                    "windows": [(a, b) for _, a, b in got],
                    "server_s": [r["seconds"] for r, _, _ in got],
                    "checksums": [r["checksum"] for r, _, _ in got],
                    "policy_checksum": msg.checksum,
                    "verified": all(r["checksum"] == msg.checksum for r, _, _ in got),
                }
            )
        served += sum(await asyncio.gather(*(chat_rounds(u, serve_rounds, 4) for u in urls)))
        return rows, served
    finally:
        for c in clients:
            await c.aclose()


def in_windows(series: list, windows: list[tuple[float, float]], margin: float = 0.0) -> dict:
    """What a process's (time, rss, anon) series says of some windows (a sync each): per window the
    VmRSS / RssAnon of the last sample before it, the peaks inside it, and the rises (peak inside -
    before: what the sync added, give or take what else the process did meanwhile)."""
    out: dict[str, list] = {k: [] for k in ("rss_before", "anon_before", "rss_peak", "anon_peak")}
    for a, b in windows:
        before = [x for x in series if x[0] < a - margin]
        inside = [x for x in series if a - margin <= x[0] <= b + margin]
        if not inside:
            continue
        ref = before[-1] if before else inside[0]
        out["rss_before"].append(ref[1])
        out["anon_before"].append(ref[2])
        out["rss_peak"].append(max(x[1] for x in inside))
        out["anon_peak"].append(max(x[2] for x in inside))
    out["rss_rise"] = [p - b for p, b in zip(out["rss_peak"], out["rss_before"], strict=True)]
    out["anon_rise"] = [p - b for p, b in zip(out["anon_peak"], out["anon_before"], strict=True)]
    return out
