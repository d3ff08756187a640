"""The env host: one per env node (the SLURM `envs` component, sbatch/envs.sh, deployment.env_nodes).

    python -m hpcrl.envs.runtime.host --run-dir DIR --node-index K

It carries out the orchestrator's orders in `<run>/bus/envs/`: every `<kind>--<env>.json` whose
`node` is K names a ServerSpec (with the orchestrator's address and the restart number). The host
starts that env server here, and when it exits writes `<kind>--<env>.exit` ({connect, restarts,
code}). The orchestrator reads that report, errors the server's rollouts, and, within
orchestrator.env_server_max_restarts, orders it again with `restarts + 1`; past the limit the run
ends with EnvServerFailed naming the env. So the restart is done here, on the env's node, and the
decision (and its one counter) stays with the orchestrator, as when it starts env servers itself.

An order whose content changes (a restart, or a requeued job's new orchestrator address) replaces the
running server; an order that disappears stops it. SIGTERM (the job ending) stops every server.
The env servers are this process's children: if the host dies they stop too (their parent check),
and the srun step ends the job.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hpcrl.envs.runtime.hosting import job_tag, popen_server, write_json
from hpcrl.envs.runtime.server import describe_exit
from hpcrl.envs.wire import messages as wire

log = logging.getLogger("hpcrl.envs.runtime.host")
POLL_S = 0.3


@dataclass
class Hosted:
    order: bytes  # the order file's content this server was started from
    spec: wire.ServerSpec
    proc: subprocess.Popen
    reported: bool = False


def my_orders(specs_dir: Path, node: int, job: str) -> dict[Path, bytes]:
    """The order files addressed to env node `node` of job `job` (path -> raw content)."""
    out: dict[Path, bytes] = {}
    for f in sorted(specs_dir.glob("*.json")) if specs_dir.exists() else []:
        try:
            raw = f.read_bytes()
            doc = json.loads(raw)
            if doc.get("node") == node and doc.get("job", "") == job:
                out[f] = raw
        except (OSError, ValueError, AttributeError):
            continue  # half-visible on a slow filesystem: next round
    return out


def exit_file(order: Path) -> Path:
    return order.with_suffix(".exit")


class Host:
    def __init__(self, run_dir: Path, node: int) -> None:
        from hpcrl.paths import RunPaths

        self.paths = RunPaths(run_dir)
        self.node = node
        self.job = job_tag()
        self.running: dict[Path, Hosted] = {}
        self.stopping = False

    def run(self) -> int:
        from hpcrl.runtime import record

        record(self.paths, "env-host", self.node)
        log.info("env host %d watching %s", self.node, self.paths.env_specs_dir)
        while not self.stopping:
            self.step()
            time.sleep(POLL_S)
        self.stop_all()
        return 0

    def step(self) -> None:
        orders = my_orders(self.paths.env_specs_dir, self.node, self.job)
        for path, h in list(self.running.items()):
            if orders.get(path) != h.order:  # withdrawn or replaced
                self.stop(h)
                del self.running[path]
        for path, raw in orders.items():
            if path not in self.running:
                self.start(path, raw)
        for path, h in self.running.items():
            code = h.proc.poll()
            if code is not None and not h.reported:
                h.reported = True
                log.log(
                    logging.INFO if code == 0 else logging.ERROR,
                    "env server %s/%s (pid %d, restart %d) exited: %s",
                    h.spec.kind, h.spec.name, h.proc.pid, h.spec.restarts, describe_exit(code),
                )  # fmt: skip
                write_json(
                    exit_file(path), {"connect": h.spec.connect, "restarts": h.spec.restarts, "code": code}
                )

    def start(self, path: Path, raw: bytes) -> None:
        try:
            spec = msgspec.convert(json.loads(raw)["spec"], wire.ServerSpec)
        except (ValueError, KeyError, msgspec.ValidationError) as e:
            log.error("order %s is unreadable: %s", path.name, e)
            return
        proc = popen_server(spec)
        self.running[path] = Hosted(raw, spec, proc)
        log.info(
            "env server %s/%s started (pid %d, restart %d, %d workers)",
            spec.kind, spec.name, proc.pid, spec.restarts, spec.workers,
        )  # fmt: skip

    def stop(self, h: Hosted) -> None:
        if h.proc.poll() is None:
            h.proc.terminate()
            try:
                h.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()

    def stop_all(self) -> None:
        for h in self.running.values():
            if h.proc.poll() is None:
                h.proc.terminate()
        for h in self.running.values():
            self.stop(h)


def main(argv: list[str] | None = None) -> int:
    from hpcrl.monitor.logging import env_process_level
    from hpcrl.storage import TolerantStreamHandler, raw_stream, tolerate_std_streams

    tolerate_std_streams()  # its log full: the env servers it hosts go on
    logging.basicConfig(
        level=env_process_level(),
        format="%(asctime)s %(levelname)-7s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
        handlers=[TolerantStreamHandler(raw_stream(sys.stderr))],
    )
    p = argparse.ArgumentParser(prog="python -m hpcrl.envs.runtime.host", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--node-index", type=int, required=True, help="this env node's index (SLURM_PROCID)")
    args = p.parse_args(argv)
    host = Host(args.run_dir, args.node_index)

    def stop(*_: object) -> None:
        host.stopping = True

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)
    return host.run()


if __name__ == "__main__":
    sys.exit(main())
