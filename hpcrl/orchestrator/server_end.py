"""Ending an inference server frozen past orchestrator.server_down_timeout_s, so that its supervisor
restarts it as it restarts a dead one (hpcrl.orchestrator.stalls decides when; this says how).

`way` picks one of three from where the server runs (its ServerInfo) and where this process runs:

- "slurm": it announced a SLURM task (ServerInfo.slurm, from its environment) on another node of
  the job this process runs in: it is ended through SLURM (`slurm_command`). hpcrl runs every
  server of a hetjob as one task of one shared step, under a supervisor in the same task
  (hpcrl.launch.keepalive): ending the step would end every server and every supervisor, so the
  task's pid is killed on its node instead,
  `srun --jobid J --het-group G --overlap -N1 -n1 -w NODE kill -9 PID`. Only a server alone in its
  step with no supervisor there has its step ended (`scancel --signal=KILL <step>`).
- "local": it runs on this host (and, under SLURM, on this node): SIGKILL.
- "order": anywhere else, and whenever SLURM refuses: a kill order that its keepalive on that node
  carries out (RunPaths.kill_order_file), as before SLURM could be asked.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
from collections.abc import Mapping

from hpcrl.bus.messages import ServerInfo, SlurmTask
from hpcrl.fileio import write_text
from hpcrl.paths import RunPaths

SRUN_TIMEOUT_S = 30.0  # a step launch on a live allocation takes well under a second


def way(info: ServerInfo, env: Mapping[str, str], hostnames: tuple[str, ...], srun: bool) -> str:
    """'slurm', 'local' or 'order' for the server `info` seen from a process with environment `env`
    on a host called one of `hostnames`; `srun`: whether srun is on this PATH."""
    task = info.slurm
    if task is not None and srun and env.get("SLURM_JOB_ID") == task.job_id:
        if env.get("SLURMD_NODENAME") != task.node:
            return "slurm"
        return "local"  # the same node: one kernel, its pid is ours to signal
    if info.host in ("127.0.0.1", "localhost", *hostnames):
        return "local"
    return "order"


def slurm_command(task: SlurmTask, pid: int) -> list[str]:
    """The command that ends the process `pid` of `task` from anywhere in its job."""
    if task.step_tasks == 1 and not task.supervised:
        return ["scancel", "--signal=KILL", task.step]
    group = [f"--het-group={task.het_group}"] if task.het_group is not None else []
    return [
        "srun", f"--jobid={task.job_id}", *group, "--overlap", "--nodes=1", "--ntasks=1",
        f"--nodelist={task.node}", "--quiet", "kill", "-9", str(pid),
    ]  # fmt: skip


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the SLURM_* variables of this process's own step (its task count, CPUs, GPUs
    would shape the new step); SLURM_CONF stays."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


async def run_slurm(cmd: list[str], timeout: float = SRUN_TIMEOUT_S) -> tuple[int, str]:
    """(exit code, its output's last line) of `cmd`; 124 when it ran past `timeout`."""
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=slurm_env(os.environ),
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, f"no answer within {timeout:.0f} s"
    lines = out.decode(errors="replace").strip().splitlines()
    return proc.returncode or 0, lines[-1] if lines else ""


async def end(paths: RunPaths, info: ServerInfo) -> str:
    """End the frozen server `info`; what was done, for the log line that names it."""
    how = way(info, os.environ, (socket.gethostname(), socket.getfqdn()), shutil.which("srun") is not None)
    slurm_failed = ""
    if how == "slurm":
        assert info.slurm is not None
        cmd = slurm_command(info.slurm, info.pid)
        rc, out = await run_slurm(cmd)
        where = f"it runs on {info.slurm.node} (SLURM step {info.slurm.step})"
        if rc == 0:
            return f"{where}: ended pid {info.pid} through SLURM ({shlex.join(cmd)}) so that its supervisor restarts it"
        slurm_failed = f"{where}; SLURM refused to end it ({shlex.join(cmd)}: exit {rc}: {out}); "
    elif how == "local":
        try:
            os.kill(info.pid, signal.SIGKILL)
            return f"killed pid {info.pid} so that its supervisor restarts it"
        except OSError as e:
            return f"could not kill pid {info.pid} ({e})"
    # its keepalive on that node carries the order out (hpcrl.launch.keepalive)
    order = paths.kill_order_file(info.index)
    try:
        write_text(order, f"{info.pid}\n")
        return f"{slurm_failed}it runs on {info.host}: ordered its keepalive there to kill pid {info.pid} ({order})"
    except OSError as e:
        return f"{slurm_failed}it runs on {info.host} and the kill order could not be written ({e})"
