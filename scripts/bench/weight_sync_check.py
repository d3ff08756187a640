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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]
GB = 1e9

# The processes and their memory (/proc sampling, the model dir, a server, a trainer rank): beside this file.
from _weight_sync_procs import (  # noqa: E402
    Server,
    Watch,
    build_model_dir,
    chat_rounds,
    drive_servers,
    in_windows,
    mem_available,
    worker,
)


# -- serve only ---------------------------------------------------------------------------------------
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
