"""An env server: one process per train/eval environment, owning N worker processes.

    orchestrator (DEALER, binds) ◀──▶ server (DEALER up; ROUTER down, 127.0.0.1) ◀──▶ workers × N

The server loads the environment once to answer `Hello` (tasks of every split, tools, turn limit),
then only routes: a `Run` goes to the ready worker with the fewest rollouts in flight, `Chat` goes
up, `ChatReply` down, `Done` up. It never runs rollout code, so it notices at once when a worker:
- exits (segfault, os._exit, a raise at import): its rollouts are answered `Done(error=...)`;
- keeps a rollout in env code (not waiting for a model turn) past `rollout_timeout_s`: it is killed
  and its rollouts errored;
and either way a fresh worker takes its place (`restarts` counts them). The orchestrator restarts a
whole server that dies (hpcrl.envs.remote). `status_file` always says who is running (hpcrl components).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from hpcrl.envs import wire

log = logging.getLogger("hpcrl.envs.server")
POLL_MS = 100
WORKER_ID_VAR = "HPCRL_ENV_WORKER_ID"
RESTART_GAP_S = 0.5  # a worker that dies at start-up is restarted at most this often


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen | None = None
    ident: bytes = b""
    ready: bool = False
    restarts: int = 0
    started: float = 0.0
    rids: set[int] = field(default_factory=set)


@dataclass
class Rollout:
    worker: int
    in_env_since: float | None  # None while it waits for a model turn


def worker_log(spec: wire.ServerSpec, index: int) -> Path:
    return Path(spec.log_dir) / f"worker_{index}.log"


def server_log(log_dir: str | Path) -> Path:
    return Path(log_dir) / "server.log"


def pick_worker(workers: list[Worker]) -> Worker | None:
    """The ready worker with the fewest rollouts in flight (lowest index on a tie), or None."""
    ready = [w for w in workers if w.ready]
    return min(ready, key=lambda w: (len(w.rids), w.index)) if ready else None


def overdue(rollouts: dict[int, Rollout], now: float, timeout_s: float) -> list[int]:
    """Rollouts that have been in env code (not waiting on a model turn) longer than `timeout_s`."""
    return [
        rid for rid, r in rollouts.items() if r.in_env_since is not None and now - r.in_env_since > timeout_s
    ]


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"


class EnvServer:
    def __init__(self, spec: wire.ServerSpec):
        import zmq

        self.spec = spec
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.up = self.ctx.socket(zmq.DEALER)
        self.up.setsockopt(zmq.LINGER, 0)
        self.up.connect(spec.connect)
        self.down = self.ctx.socket(zmq.ROUTER)
        self.down.setsockopt(zmq.LINGER, 0)
        port = self.down.bind_to_random_port("tcp://127.0.0.1")
        self.down_addr = f"tcp://127.0.0.1:{port}"
        self.workers = [Worker(i) for i in range(spec.workers)]
        self.rollouts: dict[int, Rollout] = {}
        self.backlog: list[wire.Run] = []
        self.parent = os.getppid()

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        hello = self.hello()
        if hello is None:
            return 2
        for w in self.workers:
            self.start(w)
        hello.workers = [w.proc.pid for w in self.workers if w.proc is not None]
        self.up.send(wire.encode(hello))
        self.record_placement()
        self.write_status()
        poller = self.zmq.Poller()
        poller.register(self.up, self.zmq.POLLIN)
        poller.register(self.down, self.zmq.POLLIN)
        while True:
            events = dict(poller.poll(POLL_MS))
            if self.up in events and not self.from_orchestrator(wire.decode(self.up.recv())):
                break
            if self.down in events:
                ident, data = self.down.recv_multipart()
                self.from_worker(ident, wire.decode(data))
            self.supervise()
            if os.getppid() != self.parent:
                log.warning("orchestrator (pid %d) is gone: stopping", self.parent)
                break
        self.shutdown()
        return 0

    def hello(self) -> wire.Hello | None:
        from hpcrl.envs.registry import load_environment

        try:
            env = load_environment(self.spec.env_id, **self.spec.args)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which names the env
            log.error("loading %s failed: %s: %s", self.spec.env_id, type(e).__name__, e)
            self.up.send(wire.encode(wire.LoadFailed(f"{e}")))
            return None
        env.name = self.spec.name
        tasks: dict[str, list[wire.WTask]] = {}
        errors: dict[str, str] = {}
        for split in ("train", "eval", "val"):
            try:
                tasks[split] = [wire.to_wtask(t) for t in env.tasks(split)]
            except (ValueError, NotImplementedError, KeyError) as e:
                errors[split] = f"{type(e).__name__}: {e}"
        return wire.Hello(
            name=self.spec.name,
            max_turns=env.max_turns,
            tools=env.tools,
            group_scored=env.group_scored,
            shares_first_turn=env.shares_first_turn,
            tasks=tasks,
            task_errors=errors,
            pid=os.getpid(),
            workers=[],
        )

    # -- messages -------------------------------------------------------------------------------
    def from_orchestrator(self, msg: wire.Msg) -> bool:
        if isinstance(msg, wire.Run):
            self.dispatch(msg)
        elif isinstance(msg, wire.ChatReply):
            r = self.rollouts.get(msg.rid)
            if r is not None:  # else: its worker died meanwhile; the rollout was already errored
                r.in_env_since = time.monotonic()
                self.down.send_multipart([self.workers[r.worker].ident, wire.encode(msg)])
        elif isinstance(msg, wire.Stop):
            return False
        return True

    def dispatch(self, msg: wire.Run) -> None:
        w = pick_worker(self.workers)
        if w is None:  # every worker is (re)starting: send when one says Ready
            self.backlog.append(msg)
            return
        w.rids.add(msg.rid)
        self.rollouts[msg.rid] = Rollout(w.index, time.monotonic())
        self.down.send_multipart([w.ident, wire.encode(msg)])

    def from_worker(self, ident: bytes, msg: wire.Msg) -> None:
        w = next((w for w in self.workers if w.ident == ident), None)
        if w is None:  # a message from a worker we already replaced
            return
        if isinstance(msg, wire.Ready):
            w.ready = True
            self.write_status()
            backlog, self.backlog = self.backlog, []
            for run in backlog:
                self.dispatch(run)
        elif isinstance(msg, wire.Chat):
            r = self.rollouts.get(msg.rid)
            if r is not None:
                r.in_env_since = None
                self.up.send(wire.encode(msg))
        elif isinstance(msg, wire.Done) and self.rollouts.pop(msg.rid, None) is not None:
            w.rids.discard(msg.rid)
            self.up.send(wire.encode(msg))

    # -- workers --------------------------------------------------------------------------------
    def start(self, w: Worker) -> None:
        w.ident = f"w{w.index}-{w.restarts}".encode()
        w.ready, w.started = False, time.monotonic()
        path = worker_log(self.spec, w.index)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as out:
            w.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hpcrl.envs.worker",
                    msgspec.json.encode(self.spec).decode(),
                    self.down_addr,
                    str(w.index),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # the ROUTER knows a worker by the identity it connects with
                env={**os.environ, WORKER_ID_VAR: w.ident.decode()},
            )
        log.info("worker %d started (pid %d, restart %d)", w.index, w.proc.pid, w.restarts)

    def supervise(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            assert w.proc is not None
            code = w.proc.poll()
            if code is not None and now - w.started >= RESTART_GAP_S:
                self.replace(w, f"env worker {w.index} (pid {w.proc.pid}) died: {_describe_exit(code)}")
        for rid in overdue(self.rollouts, now, self.spec.rollout_timeout_s):
            r = self.rollouts.get(rid)
            if r is None:
                continue
            w = self.workers[r.worker]
            assert w.proc is not None
            w.proc.kill()
            w.proc.wait()
            self.replace(
                w,
                f"env worker {w.index} (pid {w.proc.pid}) killed: a rollout spent more than "
                f"rollout_timeout_s={self.spec.rollout_timeout_s:g} s in env code",
            )

    def replace(self, w: Worker, why: str) -> None:
        """Error every rollout the worker held, then start its successor."""
        log.error("%s; %d rollout(s) errored; restarting it", why, len(w.rids))
        for rid in sorted(w.rids):
            self.rollouts.pop(rid, None)
            self.up.send(wire.encode(wire.Done(rid, error=why)))
        w.rids.clear()
        w.restarts += 1
        self.start(w)
        self.write_status()

    def record_placement(self) -> None:
        """logs/placement.jsonl: role env-server-<kind>, rank = the env's index, the env named."""
        if not self.spec.run_dir:
            return
        from hpcrl.launch.placement import record
        from hpcrl.paths import RunPaths

        extra = {"env": self.spec.name, "workers": [w.proc.pid for w in self.workers if w.proc is not None]}
        record(RunPaths(self.spec.run_dir), f"env-server-{self.spec.kind}", self.spec.index, extra=extra)

    def write_status(self) -> None:
        if not self.spec.status_file:
            return
        from hpcrl.envs.components import server_status
        from hpcrl.fileio import write_atomic

        data = server_status(self.spec, os.getpid(), self.workers)
        write_atomic(Path(self.spec.status_file), [json.dumps(data).encode()], durable=False)

    def shutdown(self) -> None:
        for w in self.workers:
            if w.ident:
                self.down.send_multipart([w.ident, wire.encode(wire.Stop())])
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        self.up.close()
        self.down.close()
        self.ctx.term()


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)-7s [%(name)s] %(message)s", datefmt="%H:%M:%S"
    )
    spec = msgspec.json.decode(argv[0].encode(), type=wire.ServerSpec)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return EnvServer(spec).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
