"""An env server: one process per train/eval environment, owning N worker processes.

    orchestrator (ROUTER) ◀──▶ workers × N     Run / Chat / ChatReply / Done
                          ◀──▶ env server      Hello / WorkerDied / Kill / Stop

The ROUTER binds 127.0.0.1, or the orchestrator node's address when the servers run on env nodes
of their own (deployment.env_nodes, hpcrl.envs.runtime.host).

The server loads the environment once to answer `Hello` (tasks of every split, tools, turn limit),
starts the workers (each connects to the orchestrator itself, so a rollout's messages take one hop),
and then only watches them. It never runs rollout code, so it notices at once when a worker exits
(segfault, os._exit, a raise at import) and says so (`WorkerDied`: the orchestrator errors that
worker's rollouts); when the orchestrator sees a rollout overrun `rollout_timeout_s` in env code it
asks for the worker to be killed (`Kill`). Either way a fresh worker, with a new identity, takes its
place (`restarts` counts them). The orchestrator restarts a whole server that dies
(hpcrl.orchestrator.remote_env). `status_file` always says who is running (hpcrl components).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hpcrl.envs.runtime.components import stopped
from hpcrl.envs.wire import messages as wire

log = logging.getLogger("hpcrl.envs.runtime.server")
POLL_MS = 100
WORKER_ID_VAR = "HPCRL_ENV_WORKER_ID"
PARENT_VAR = (
    "HPCRL_ENV_SERVER_PID"  # a worker dies with this process (hpcrl.envs.runtime.lifeline.die_with_parent)
)
RESTART_GAP_S = 0.5  # a worker that dies at start-up is restarted at most this often
FROZEN_CHECK_S = 1.0  # how often the workers' process state is read (/proc/<pid>/stat)


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen | None = None
    ident: bytes = b""
    restarts: int = 0
    started: float = 0.0
    stopped_since: float | None = None  # when it was first seen stopped (SIGSTOP): frozen_s applies


def worker_log(spec: wire.ServerSpec, index: int) -> Path:
    return Path(spec.log_dir) / f"worker_{index}.log"


def server_log(log_dir: str | Path) -> Path:
    return Path(log_dir) / "server.log"


def server_ident(restarts: int) -> bytes:
    return f"server-{restarts}".encode()


def worker_ident(server_restarts: int, index: int, restarts: int) -> bytes:
    """Unique over the run: a message from a replaced worker can never reach its successor's rollouts."""
    return f"w{server_restarts}.{index}.{restarts}".encode()


def describe_exit(code: int) -> str:
    return f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"


class EnvServer:
    def __init__(self, spec: wire.ServerSpec):
        import zmq

        self.spec = spec
        self.told_lost = 0  # log lines dropped that a Pong already told the orchestrator of
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.up = self.ctx.socket(zmq.DEALER)
        self.up.setsockopt(
            zmq.LINGER, 1000
        )  # a LoadFailed / WorkerDied sent just before exiting still arrives
        self.up.setsockopt(zmq.IDENTITY, server_ident(spec.restarts))
        self.up.connect(spec.connect)
        self.workers = [Worker(i) for i in range(spec.workers)]
        self.parent = os.getppid()
        self.checked = 0.0

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
        while True:
            if self.up.poll(POLL_MS) and not all(map(self.from_orchestrator, wire.decode(self.up.recv()))):
                break
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
        if isinstance(msg, wire.Ping):
            from hpcrl.storage import dropped_log_lines

            n, why = dropped_log_lines()
            lost = f"{n - self.told_lost} log line(s) lost: {why}" if n > self.told_lost else ""
            self.told_lost = n
            self.up.send(wire.encode(wire.Pong(msg.seq, lost)))
        elif isinstance(msg, wire.Kill):
            w = next((w for w in self.workers if w.ident.decode() == msg.ident), None)
            if w is not None and w.proc is not None:  # else: already replaced
                w.proc.kill()
                w.proc.wait()
                self.replace(w, msg.why)
        return not isinstance(msg, wire.Stop)

    # -- workers --------------------------------------------------------------------------------
    def start(self, w: Worker) -> None:
        w.ident = worker_ident(self.spec.restarts, w.index, w.restarts)
        w.started = time.monotonic()
        from hpcrl.storage import open_log

        with open_log(worker_log(self.spec, w.index), f"env worker {w.index}") as out:
            w.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hpcrl.envs.runtime.worker",
                    msgspec.json.encode(self.spec).decode(),
                    self.spec.connect,
                    str(w.index),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # the orchestrator's ROUTER knows a worker by the identity it connects with
                env={**os.environ, WORKER_ID_VAR: w.ident.decode(), PARENT_VAR: str(os.getpid())},
            )
        log.info("worker %d started (pid %d, restart %d)", w.index, w.proc.pid, w.restarts)

    def supervise(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            assert w.proc is not None
            code = w.proc.poll()
            if code is not None and now - w.started >= RESTART_GAP_S:
                self.replace(w, f"env worker {w.index} (pid {w.proc.pid}) died: {describe_exit(code)}")
        if self.spec.frozen_s > 0 and now - self.checked >= FROZEN_CHECK_S:
            self.checked = now
            for w in self.workers:
                self.check_frozen(w, now)

    def check_frozen(self, w: Worker, now: float) -> None:
        """A worker stopped for longer than spec.frozen_s is killed and replaced like a dead one (a
        slow one is not: rollout_timeout_s bounds the time a rollout spends in env code)."""
        assert w.proc is not None
        if w.proc.poll() is not None or not stopped(w.proc.pid):
            w.stopped_since = None
            return
        if w.stopped_since is None:
            w.stopped_since = now
            log.warning("env worker %d (pid %d) is stopped (frozen)", w.index, w.proc.pid)
        elif now - w.stopped_since > self.spec.frozen_s:
            pid, frozen = w.proc.pid, now - w.stopped_since
            w.proc.kill()
            w.proc.wait()
            w.stopped_since = None
            self.replace(
                w,
                f"env worker {w.index} (pid {pid}) frozen (process stopped) for {frozen:.0f} s "
                f"(> {self.spec.frozen_s:g} s, 2x stall_warning_s): killed",
            )

    def replace(self, w: Worker, why: str) -> None:
        """Tell the orchestrator (it errors the worker's rollouts), then start its successor."""
        log.error("%s; restarting it", why)
        self.up.send(wire.encode(wire.WorkerDied(w.ident.decode(), why)))
        w.restarts += 1
        self.start(w)
        self.write_status()

    def record_placement(self) -> None:
        """logs/placement.jsonl: role env-server-<kind>, rank = the env's index, the env named."""
        if not self.spec.run_dir:
            return
        from hpcrl.paths import RunPaths
        from hpcrl.runtime import record

        extra = {"env": self.spec.name, "workers": [w.proc.pid for w in self.workers if w.proc is not None]}
        record(RunPaths(self.spec.run_dir), f"env-server-{self.spec.kind}", self.spec.index, extra=extra)

    def write_status(self) -> None:
        if not self.spec.status_file:
            return
        from hpcrl.envs.runtime.components import server_status
        from hpcrl.fileio import write_atomic
        from hpcrl.storage import describe, dropped_log_lines

        data = server_status(self.spec, os.getpid(), self.workers)
        data["server"]["log_lines_lost"] = dropped_log_lines()[0]  # `hpcrl status` shows it
        try:
            write_atomic(Path(self.spec.status_file), [json.dumps(data).encode()], durable=False)
        except OSError as e:  # beside the logs, on the same disk: a full or quota'd one never ends the env
            why = describe(e, self.spec.status_file)
            if why is None:
                raise
            log.warning("env server: cannot write its status file (hpcrl components): %s", why)

    def shutdown(self) -> None:
        for w in self.workers:  # they get Stop from the orchestrator; SIGTERM for the rest
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
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
        self.ctx.term()


def main(argv: list[str]) -> int:
    from hpcrl.monitor.logging import env_process_level
    from hpcrl.storage import TolerantStreamHandler, raw_stream, tolerate_std_streams

    tolerate_std_streams()  # whatever else writes its output (an env's import, a print)
    logging.basicConfig(
        level=env_process_level(),
        format="%(asctime)s %(levelname)-7s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
        handlers=[TolerantStreamHandler(raw_stream(sys.stderr))],  # a log the disk refuses never ends the env
    )
    spec = msgspec.json.decode(argv[0].encode(), type=wire.ServerSpec)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # a checkpoint-and-stop is the orchestrator's, not ours
    # In a session of its own (hosting.popen_server) no group signal reaches it: it ends with its
    # parent (the orchestrator, or an env node's host) whatever it is doing, a slow env load included.
    from hpcrl.envs.runtime.lifeline import die_with_parent

    die_with_parent(os.getppid(), grace_s=5.0)
    return EnvServer(spec).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
