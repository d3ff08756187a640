"""Issue 49 check: the collective weight sync (protocol 4, rounds) on this machine, 4 CPU trainer ranks.

    python scripts/bench/weight_sync_check.py --json outputs/bench_weight_sync/result.json   # 11.5 min
    python scripts/bench/weight_sync_check.py --table outputs/bench_weight_sync/result.json  # print it again

Measured on the 2-core / 24 GiB machine (shared, other tests running), 313 M parameters, chunk_mb 32, 3 steps:
- real `hpcrl run` (4 CPU trainer ranks, 2 hf servers, collective): exit 0 in 194 s; policies 0-3 each
  "loaded on 2 server(s) (checksum verified)"; 39 rounds per sync; publish 3.1-8.0 s, load 3.3-7.2 s.
- servers vs one serving the same model alone (VmHWM 3.11 GB, peak RssAnon 1.58 GB, 96 completions):
  VmHWM 0.61x / 1.23x in the run (the 1.23x peak is generation at 16:23:27, outside every sync window;
  its syncs added <= +0.14 GB VmRSS) and 0.75-1.00x in the publish phase (same requests + 3 syncs);
  peak RssAnon 1.07x / 2.28x in the run, 1.34-1.82x in the publish phase. Why anon misses 1.15x: a
  serve-only server's weights are a private mmap of model.safetensors (rw-p, 1193 MB of RssFile, 0.33 GB
  RssAnon at start); the first update's copy_ into them copies every page on write: +1.27..+1.41 GB
  RssAnon while VmRSS rises only +0.04..+0.22 GB. Later syncs add +0.00..+0.09 GB (fp32 policy) and
  <= +0.13 GB (bf16 into fp32 parameters) of either. Generation alone moves RssAnon by ~0.5 GB between
  identical servers (0.76-1.27 GB after the same 24 requests), so anon ratios are +-0.3x noise.
- trainer ranks, publish alone (1 vs 4 ranks): largest peak RSS 0.34x (fp32 policy: 0.82 vs 2.39 GB)
  and 0.33x (bf16: 0.91 vs 2.74 GB). Held by publish: bf16 0.35x (0.140 vs 0.401 GB first publish,
  0.078 vs 0.314 later: the cast embedding shard vs the whole one); fp32 2.51x of nearly nothing (0.059
  vs 0.024 GB, first publish only: 0.000 both later; an fp32 policy of fp32 weights is sent straight
  from the parameters). Seconds per sync (publish start -> both servers answered, verified): fp32
  6.9/4.9/5.8 (1 rank), 4.3/3.2/3.1 (4 ranks); bf16 7.4/5.0/6.3, 8.6/6.0/5.0.

Model: Qwen3-style, built locally (no hub): hidden 1024, intermediate 3072, --layers 10, 16 heads
(8 KV, head_dim 128), vocab 151,936, tied embeddings: 313 M parameters, fp32 (1.25 GB), saved with
hpcrl's byte-level BPE tokenizer (hpcrl.models.tiny.build_tokenizer; ids past its 400 decode to
nothing). The same architecture as scripts/bench/weights_sharded.py.

Phases (--phases, all by default, one after the other: this machine has 2 shared cores):

serve    one `hpcrl inference` server alone on the model dir (OMP_NUM_THREADS=1, as `hpcrl run` gives
         each of its 6 compute processes on 2 cores), a few rounds of reverse-text chat requests (the
         run's shape: n=4, max_tokens=8); its VmHWM, peak VmRSS and peak RssAnon (/proc/PID/status
         sampled every 50 ms): the baseline of a server that serves and never loads a policy.
run      a real `hpcrl run`: 4 trainer ranks (FSDP over gloo), 2 embedded hf servers, the built-in
         reverse-text env, trainer.broadcast.transport = "collective", chunk_mb = 32, --steps steps.
         The same sampler watches every process logs/placement/ names; every policy must be logged
         "loaded on 2 server(s) (checksum verified" by the orchestrator (PolicySync compares each
         server's checksum of what landed with the trainer's PolicyReady checksum).
publish  the publish alone, for each of --publish-ranks (1 and 4) trainer-rank processes (FSDP2
         shards of the same model, random weights) running `PolicyPublisher.publish` (collective,
         sharded, chunk_mb, --dtypes) for --steps policies into 2 real `hpcrl inference` servers joined
         to the weight group by hand (POST /init_broadcaster, then /update_weights {"transport":
         "collective"} per policy: api._receive_and_load -> engine.update_weights_streamed, bucket by
         bucket into the parameters). Per rank: "held by publish" = peak RSS (5 ms sampling) above the
         RSS before the publish, and that peak RSS; seconds per sync = publish start to both servers'
         /update_weights answer; each server's answer checksum must equal PolicyReady's. The servers'
         memory is sampled too (a second measure of (1) without training in the way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GB = 1e9
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


def _rss_self() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS of this process while the block runs (a 5 ms sampling thread)."""

    def __enter__(self) -> PeakRSS:
        self.base = _rss_self()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_self())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_self())


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


def phase_serve(model_dir: Path, work: Path, rounds: int) -> dict:
    run = work / "serve_only"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.time()
    srv = Server(model_dir, run, 0)
    try:
        with Watch(lambda: {"server": srv.proc.pid}) as w:
            n = asyncio.run(chat_rounds(srv.base_url, rounds, concurrent=4))
            time.sleep(0.3)
    finally:
        srv.stop()
    return {
        "completions": n,
        "seconds": round(time.time() - t0, 1),
        **w.peaks["server"],
        "series": w.series["server"],
    }


# -- the real run ------------------------------------------------------------------------------------
RUN_TOML = """\
max_steps = {steps}
seq_len = 64
output_dir = "{out}"

[log]
plots = false

[model]
name = "{model}"

[deployment]
num_trainer_ranks = {ranks}
num_inference_servers = 2

[orchestrator]
batch_size = {batch}
rollouts_per_example = 4
max_async_level = 1

[orchestrator.train.sampling]
max_tokens = 8

[[orchestrator.train.env]]
id = "reverse-text"

[trainer]
micro_batch_tokens = 256  # the batch is ~8 x 40 tokens: no 4096-token rows of 151,936 logits

[orchestrator.advantage]
zero_advantage = "keep"  # a random model's groups all score 0: no 16 rounds of regeneration per step

[trainer.broadcast]
transport = "collective"
chunk_mb = {chunk}
"""


def placement_pids(run: Path) -> dict[str, int]:
    out = {}
    for f in (run / "logs" / "placement").glob("*.json"):
        rec = json.loads(f.read_text())
        if rec.get("role") in ("trainer", "inference", "orchestrator"):
            out[f"{rec['role']}{rec['rank']}"] = int(rec["pid"])
    return out


def phase_run(model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "run.toml"
    cfg.write_text(
        RUN_TOML.format(
            steps=args.steps, out=run, model=model_dir, ranks=4, batch=args.batch, chunk=args.chunk_mb
        )
    )
    cmd = [str(Path(sys.executable).parent / "hpcrl"), "run", str(cfg)]
    t0 = time.time()
    with Watch(lambda: placement_pids(run), coarse=0.0) as w, open(work / "run.out", "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        why = ""
        while proc.poll() is None and not why:
            time.sleep(0.5)
            if time.time() - t0 > args.run_timeout:
                why = f"stopped after {args.run_timeout:.0f} s"
            elif mem_available() < args.min_free_gb * GB:  # the machine is shared: never run it out
                why = f"stopped: MemAvailable fell below {args.min_free_gb} GB"
        if why:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
        rc = proc.wait()
    wall = time.time() - t0
    logs = run / "logs"
    text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")) if p.is_file())
    day = time.strftime("%Y-%m-%d ", time.localtime(t0))

    def at(hms: str) -> float:  # a log line's HH:MM:SS (truncated) as unix time
        return time.mktime(time.strptime(day + hms, "%Y-%m-%d %H:%M:%S"))

    loaded = [
        (int(m.group(2)), int(m.group(3)), float(m.group(4)), at(m.group(1)))
        for m in re.finditer(
            r"(\d\d:\d\d:\d\d) INFO +\[orchestrator\] policy (\d+) loaded on (\d+) server\(s\) "
            r"\(checksum verified, ([\d.]+)s\)",
            text,
        )
    ]
    published = [
        (int(m.group(2)), int(m.group(3)), int(m.group(4)), float(m.group(5)), at(m.group(1)))
        for m in re.finditer(
            r"(\d\d:\d\d:\d\d) INFO +\[trainer\] policy (\d+) published \(collective, (\d+) rank\(s\) "
            r"sending at once in (\d+) round\(s\), [\d.]+ MB, ([\d.]+)s",
            text,
        )
    ]
    # A sync's window: from the earlier of the publish's and the load's start to a second past the later
    # end (the log's times are whole seconds).
    ends = {s: (ts, dt) for s, _, _, dt, ts in published}
    windows = []
    for s, _, load_s, ts in loaded:
        a, b = ts - load_s, ts + 1.0
        if s in ends:
            a, b = min(a, ends[s][0] - ends[s][1]), max(b, ends[s][0] + 1.0)
        windows.append((a - 0.2, b))
    sync = {label: in_windows(ser, windows) for label, ser in w.series.items()}
    coarse = {label: [x for i, x in enumerate(ser) if i % 10 == 0] for label, ser in w.series.items()}
    return {
        "rc": rc,
        "stopped": why,
        "seconds": round(wall, 1),
        "loaded": loaded,
        "published": published,
        "windows": windows,
        "peaks": w.peaks,
        "sync": sync,
        "series": coarse,
        "out_tail": (work / "run.out").read_text(errors="replace")[-3000:],
    }


# -- the publish alone ---------------------------------------------------------------------------------
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


def publish_one(model_dir: Path, work: Path, t: int, dtype: str, args: argparse.Namespace) -> dict:
    from hpcrl.net import free_port
    from hpcrl.runtime import rank_env

    tag = f"publish_{dtype}_w{t}"
    run = work / tag
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    t0 = time.time()
    servers = [Server(model_dir, run / f"srv{i}", 0) for i in range(2)]
    procs: list[subprocess.Popen] = []
    try:
        pids = {f"server{i}": s.proc.pid for i, s in enumerate(servers)}
        with Watch(lambda: pids, coarse=0.0) as w:
            port, wport = free_port(), free_port()
            outs = [run / f"r{r}.json" for r in range(t)]
            for r in range(t):
                env = {**os.environ, **rank_env(r, t, "127.0.0.1", port), "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, __file__, "--worker", str(model_dir), str(wport), str(args.steps)]
                cmd += [str(args.chunk_mb), dtype, str(run / "bus"), str(outs[r])]
                procs.append(subprocess.Popen(cmd, env=env))
            got, served = asyncio.run(
                drive_servers(
                    [s.base_url for s in servers], wport, t, args.steps, run / "bus", args.serve_rounds
                )
            )
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"{tag}: a trainer rank exited {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for s in servers:
            s.stop()
    ranks = [json.loads(o.read_text()) for o in outs]
    sync = [max(b for _, b in g["windows"]) - ranks[0]["rows"][g["step"]]["start"] for g in got]
    srv = {}
    for i in range(2):
        key = f"server{i}"
        win = in_windows(w.series[key], [g["windows"][i] for g in got])
        srv[key] = {**w.peaks[key], "sync": win}
    return {
        "ranks": t,
        "dtype": dtype,
        "seconds": round(time.time() - t0, 1),
        "completions": served,
        "held": [max(row["held"] for row in r["rows"]) for r in ranks],
        "held_later": [max((row["held"] for row in r["rows"][1:]), default=0) for r in ranks],
        "peak_rss": [max(row["rss"] for row in r["rows"]) for r in ranks],
        "base_rss": [min(row["base"] for row in r["rows"]) for r in ranks],
        "publish_s": [r["rows"][s]["s"] for r in ranks[:1] for s in range(args.steps)],
        "sync_s": sync,
        "server_s": [g["server_s"] for g in got],
        "sent": [r["rows"][-1]["sent"] for r in ranks],
        "verified": [g["verified"] for g in got],
        "updates": got,
        "servers": srv,
    }


# -- output -----------------------------------------------------------------------------------------
def table(res: dict) -> list[str]:
    base = res.get("serve")

    def gb(x: float) -> str:
        return f"{x / GB:.2f}"

    def vs(x: float, key: str) -> str:
        return f"{gb(x)} ({x / base[key]:.2f}x)" if base else gb(x)

    def rises(v: list[int]) -> str:
        return " / ".join(f"{x / GB:+.2f}" for x in v)

    lines = [
        "Servers (hf engine, OMP 1 thread): peaks over the whole life, and per sync the RssAnon / VmRSS rise",
        "(peak inside the sync's window - the last sample before it)",
        "| where | server | VmHWM GB (vs serve-only) | peak RssAnon GB (vs serve-only) | RssAnon before 1st sync "
        "| RssAnon rise per sync GB | VmRSS rise per sync GB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    if base:
        lines.append(
            f"| serve only ({base['completions']} completions) | 0 | {gb(base['hwm'])} | {gb(base['anon'])} | - | - | - |"
        )
    run = res.get("run")
    srv_rows = []
    if run:
        srv_rows += [(f"hpcrl run ({len(run['windows'])} syncs)", k, run["peaks"][k], run["sync"].get(k)) for k in
                     sorted(run["peaks"]) if k.startswith("inference")]  # fmt: skip
    for p in res.get("publish", []):
        where = f"publish {p['ranks']} rank(s) {p['dtype']} (+{p['completions']} completions)"
        srv_rows += [(where, k, v, v["sync"]) for k, v in sorted(p["servers"].items())]
    for where, k, pk, sync in srv_rows:
        sync = sync or {"anon_before": [0], "anon_rise": [], "rss_rise": []}
        lines.append(
            f"| {where} | {k} | {vs(pk['hwm'], 'hwm')} | {vs(pk['anon'], 'anon')} "
            f"| {gb(sync['anon_before'][0]) if sync['anon_before'] else '-'} | {rises(sync['anon_rise'])} "
            f"| {rises(sync['rss_rise'])} |"
        )
    lines.append("")
    pubs = res.get("publish", [])
    if pubs:
        one = {p["dtype"]: p for p in pubs if p["ranks"] == 1}
        lines += [
            "Trainer ranks, the publish alone (PolicyPublisher.publish, collective, sharded; into the 2 servers)",
            "| ranks | policy dtype | held by publish per rank GB | held by publishes 2.. GB | peak RSS per rank GB "
            "| largest held / 1 rank | largest peak RSS / 1 rank | s per sync (publish start -> both servers "
            "answered) | verified |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in pubs:
            ref = one.get(p["dtype"], p)
            lines.append(
                f"| {p['ranks']} | {p['dtype']} | {' / '.join(f'{h / GB:.3f}' for h in p['held'])} "
                f"| {' / '.join(f'{h / GB:.3f}' for h in p.get('held_later', []))} "
                f"| {' / '.join(gb(h) for h in p['peak_rss'])} "
                f"| {max(p['held']) / max(ref['held']):.2f}x | {max(p['peak_rss']) / max(ref['peak_rss']):.2f}x "
                f"| {' / '.join(f'{s:.1f}' for s in p['sync_s'])} | {all(p['verified'])} |"
            )
        lines.append("")
    if run:
        verified = [s for s, n, _, _ in run["loaded"] if n == 2]
        lines += [
            f"hpcrl run: exit {run['rc']} {run['stopped']}, {run['seconds']:.0f} s; policies loaded on 2 servers "
            f"with the trainer's checksum (orchestrator log): {verified}",
            f"  publish s (trainer rank 0) {[p[3] for p in run['published']]}, "
            f"{run['published'][0][2] if run['published'] else '?'} rounds; "
            f"load s (orchestrator, both servers) {[x[2] for x in run['loaded']]}",
            "| process | VmHWM GB | peak RssAnon GB | VmRSS rise per sync GB | RssAnon rise per sync GB |",
            "| --- | --- | --- | --- | --- |",
        ]
        for k, pk in sorted(run["peaks"].items()):
            sync = run["sync"].get(k) or {"rss_rise": [], "anon_rise": []}
            lines.append(
                f"| {k} | {gb(pk['hwm'])} | {gb(pk['anon'])} | {rises(sync['rss_rise'])} | {rises(sync['anon_rise'])} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="serve,run,publish")
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (10: 313 M parameters)")
    ap.add_argument("--steps", type=int, default=3, help="policies published (and loaded)")
    ap.add_argument("--chunk-mb", type=int, default=32, help="trainer.broadcast.chunk_mb")
    ap.add_argument("--batch", type=int, default=8, help="run: orchestrator.batch_size (4 rollouts a prompt)")
    ap.add_argument("--serve-rounds", type=int, default=6, help="serve: rounds of 4 chat requests (n=4)")
    ap.add_argument("--publish-ranks", default="1,4")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="publish: policy dtypes (the run's on CPU: float32; on GPU bf16 from fp32 master weights)",
    )
    ap.add_argument("--run-timeout", type=float, default=1500)
    ap.add_argument("--min-free-gb", type=float, default=1.5, help="run: stopped below this MemAvailable")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench_weight_sync")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="print the tables of an earlier --json and exit")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        return print("\n".join(table(json.loads(args.table.read_text()))))
    if args.worker:
        m, wport, steps, chunk, dtype, run, out = args.worker
        return worker(m, int(wport), int(steps), float(chunk), dtype, run, out)
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir, n = build_model_dir(args.dir / f"model_L{args.layers}", args.layers)
    res: dict = {"params": n, "layers": args.layers, "chunk_mb": args.chunk_mb, "steps": args.steps}
    print(f"model: {n / 1e6:.1f} M parameters in {model_dir} ({time.time() - t0:.0f} s)", flush=True)

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1))

    phases = args.phases.split(",")
    if "serve" in phases:
        res["serve"] = phase_serve(model_dir, args.dir, args.serve_rounds)
        print("serve:", json.dumps(res["serve"]), flush=True)
        save()
    if "run" in phases:
        res["run"] = phase_run(model_dir, args.dir, args)
        print("run:", json.dumps({k: v for k, v in res["run"].items() if k != "series"}), flush=True)
        save()
    if "publish" in phases:
        res["publish"] = []
        for dtype in args.dtypes.split(","):
            for t in (int(x) for x in args.publish_ranks.split(",")):
                res["publish"].append(publish_one(model_dir, args.dir, t, dtype, args))
                print("publish:", json.dumps({k: v for k, v in res["publish"][-1].items() if k != "updates"}),
                      flush=True)  # fmt: skip
                save()
    res["seconds"] = round(time.time() - t0, 1)
    save()
    print("\n".join(table(res)))
    print(f"total {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
