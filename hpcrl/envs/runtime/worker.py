"""An env worker process: loads one environment and runs its rollouts, many at once on one event loop.

Started by its env server (hpcrl.envs.runtime.server) as `python -m hpcrl.envs.runtime.worker SPEC_JSON ADDR INDEX`;
its stdout/stderr are the worker's log file. Every model turn an env asks for goes back up the socket
(`Chat`) and the orchestrator answers it (`ChatReply`): the worker never talks to inference itself, so
token ids, logprobs and policy versions stay exactly the orchestrator's. A crash here (segfault,
os._exit, a hang) costs only this worker's rollouts: the server errors them and starts a new worker.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from hpcrl.envs.runtime.lifeline import die_with_parent
from hpcrl.envs.wire import messages as wire
from hpcrl.envs.wire.frames import Outbox, drain

log = logging.getLogger("hpcrl.envs.runtime.worker")


class WorkerChat:
    """The ChatClient an env sees inside a worker: each call is one Chat/ChatReply round trip."""

    def __init__(self, rid: int, send: Any, pending: dict[tuple[int, int], asyncio.Future]):
        # send: puts one message in the worker's outbox (hpcrl.envs.wire.frames), it never blocks
        self.rid, self.send, self.pending, self.seq = rid, send, pending, 0

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, sampling: Mapping[str, Any]
    ) -> Any:
        self.seq += 1
        key = (self.rid, self.seq)
        fut = asyncio.get_running_loop().create_future()
        self.pending[key] = fut
        try:
            self.send(wire.Chat(self.rid, self.seq, messages, tools, dict(sampling)))
            reply: wire.ChatReply = await fut
        finally:
            self.pending.pop(key, None)
        if reply.error is not None or reply.turn is None:
            raise RuntimeError(reply.error or "no turn")
        return wire.from_wturn(reply.turn)


async def run_one(env: Any, base_prompt: str | None, msg: wire.Run, client: WorkerChat) -> wire.Done:
    task = wire.from_wtask(msg.task)
    # Read by initial_messages before the rollout's first await, so concurrent runs see their own.
    env.system_prompt_override = msg.system_prompt if msg.system_prompt is not None else base_prompt
    try:
        if msg.group:
            trajs = await env.rollout_group(task, client, msg.sampling, msg.n)
        else:
            trajs = [await env.rollout(task, client, msg.sampling)]
        return wire.Done(msg.rid, [wire.to_wtraj(env.with_weights(t)) for t in trajs])
    except Exception as e:  # noqa: BLE001 - an env bug errors its rollouts; the worker goes on
        log.warning("rollout %d (example %s) raised %s: %s", msg.rid, task.example_id, type(e).__name__, e)
        return wire.Done(msg.rid, error=f"{type(e).__name__}: {e}"[:500])


async def serve(spec: wire.ServerSpec, addr: str, index: int) -> int:
    import zmq
    import zmq.asyncio

    from hpcrl.envs.registry import load_environment

    env = load_environment(spec.env_id, **spec.args)
    env.name = spec.name
    base_prompt = env.system_prompt_override
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, os.environ["HPCRL_ENV_WORKER_ID"].encode())  # set by the server
    sock.connect(addr)
    send = Outbox(sock, routed=False).put
    pending: dict[tuple[int, int], asyncio.Future] = {}
    running: set[asyncio.Task] = set()

    async def run(msg: wire.Run) -> None:
        send(await run_one(env, base_prompt, msg, WorkerChat(msg.rid, send, pending)))

    def on(msg: wire.Msg) -> bool:
        """False: stop."""
        if isinstance(msg, wire.Run):
            t = asyncio.ensure_future(run(msg))
            running.add(t)
            t.add_done_callback(running.discard)
        elif isinstance(msg, wire.ChatReply):
            fut = pending.get((msg.rid, msg.seq))
            if fut is not None and not fut.done():
                fut.set_result(msg)
        return not isinstance(msg, wire.Stop)

    send(wire.Ready(os.getpid()))
    log.info("worker %d (pid %d) serving %s", index, os.getpid(), spec.name)
    serving = True
    while serving:
        for (data,) in drain(sock, await sock.recv_multipart()):
            serving = serving and all(on(m) for m in wire.decode(data))
    for t in running:
        t.cancel()
    sock.close()
    ctx.term()
    return 0


def main(argv: list[str]) -> int:
    faulthandler.enable()  # a segfault in env code leaves its traceback in the worker log
    from hpcrl.monitor.logging import env_process_level
    from hpcrl.storage import TolerantStreamHandler, raw_stream, tolerate_std_streams

    tolerate_std_streams()  # env code's prints and progress bars: a full log never fails a rollout
    logging.basicConfig(
        level=env_process_level(),
        format="%(asctime)s %(levelname)-7s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
        handlers=[TolerantStreamHandler(raw_stream(sys.stderr))],  # its own lost-lines note
    )
    from hpcrl.envs.runtime.server import PARENT_VAR

    # first, before the env loads: a server killed while its worker starts must not leave it behind,
    # nor one whose worker blocks its event loop in env code (a hung rollout)
    die_with_parent(int(os.environ.get(PARENT_VAR) or os.getppid()))
    spec = msgspec.json.decode(argv[0].encode(), type=wire.ServerSpec)
    return asyncio.run(serve(spec, argv[1], int(argv[2])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
