"""Lossless resume under SIGKILL (issue 7): kill a random role at a random moment of a short CPU run,
`hpcrl resume --step -1`, and check that the run completes, that the sequence of training prompts
equals an uninterrupted run's (none skipped, none repeated), and — deterministic mode — that the final
weights are bitwise identical.

How: chained trials. Start-up dominates a trial's cost — every `hpcrl run` or `hpcrl resume` starts
five processes that import torch (~17 CPU-seconds), a training step of this tiny run costs ~0.35 — so
the resume that ends one trial is the next trial's run. A chain (one test item; pytest-xdist spreads
the chains over its workers) starts `hpcrl run`, waits for a complete checkpoint, sleeps a random
delay (within about one step, measured on the reference run), SIGKILLs the trial's role (or the
launcher) and reaps; then checks what the kill left: a complete checkpoint not older than the one it
awaited, and the prompt log (each step once, in order) and the weights up to it
equal to the uninterrupted reference run's. It then starts `hpcrl resume --step -1`, which is the next
trial's run: the next trial waits for a checkpoint newer than the one resumed from, kills, checks,
resumes. After the chain's last kill the resume runs to the end, and the whole run is checked: exit
code 0, the full prompt sequence, bitwise-equal final weights. Every trial is a real SIGKILL of a
live role at a random moment, followed by a real `hpcrl resume --step -1` whose outcome is checked
(by the next trial's checks, or as a completed run), except where nothing needs resuming:

a killed inference server. The launcher restarts it in place (deployment.
max_server_restarts) and the run goes on, so there is nothing to resume; the next trial kills the same
launch and checks it up to a newer checkpoint (as the chain's last trial, the run must end by itself,
complete and equal to the reference). A launch that ends before its kill lands does not lose the
trial: it must have finished cleanly (exit 0, final state equal to the reference's), and the chain
goes on with a fresh `hpcrl run` in a new output directory.

HPCRL_RELIABILITY_TRIALS sets the number of trials (default 20), in chains of PER_CHAIN (the last one
may be shorter).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml

TRIALS = int(os.environ.get("HPCRL_RELIABILITY_TRIALS", "20"))
PER_CHAIN = 5
CHAINS = -(-TRIALS // PER_CHAIN)
# Room for PER_CHAIN kills (~1-2 steps each) and the run after the last one; a step costs ~0.35
# CPU-seconds, a fresh launch when a chain runs out of steps ~17.
MAX_STEPS = 20
ROLES = ("trainer", "orchestrator", "inference", "launcher")
# A kill lands within this many (reference) steps after the checkpoint a trial waits for.
KILL_WINDOW_STEPS = 1.2

# The reference run keeps every checkpoint (and so every step's weights: retention removes a step's
# weights with its checkpoint); the trials keep 2. Nothing else differs.
CONFIG = rl_toml(
    "{max_steps}",
    seq_len=64,
    max_tokens=8,
    top="deterministic = true\nseed = 11\n",
    orchestrator="max_async_level = 1\n",
    tables="[trainer.optim]\nlr = 3e-3\n[ckpt]\ninterval = 1\nkeep_last = {keep_last}\n",
)


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _weights(out: Path, step: int) -> dict[str, bytes]:
    """The weights of step `step` of run `out` (weights/step_N), bytes per tensor."""
    from safetensors.torch import load_file

    weights = load_file(str(RunPaths(out).weights_dir(step) / "model.safetensors"))
    return {k: v.numpy().tobytes() for k, v in sorted(weights.items())}


def _final_state(out: Path, max_steps: int = MAX_STEPS) -> tuple[dict[str, bytes], list[list[int]]]:
    """The final weights (bytes per tensor) and each step's training prompt ids of a finished run."""
    raw = _weights(out, max_steps)
    prompts = [json.loads(line) for line in RunPaths(out).prompts_log.read_text().splitlines()]
    by_step = {p["step"]: p["example_ids"] for p in prompts}
    assert sorted(by_step) == list(range(1, max_steps + 1)), f"prompt log steps: {sorted(by_step)}"
    return raw, [by_step[s] for s in range(1, max_steps + 1)]


def _prompt_log(out: Path) -> list[tuple[int, list[int]]]:
    """(step, example_ids) of every line of the prompt log, in file order; a torn last line (a kill
    in the middle of a write) is left out: a resume drops it."""
    lines = RunPaths(out).prompts_log.read_text().splitlines()
    entries = []
    for i, line in enumerate(lines):
        try:
            p = json.loads(line)
        except ValueError:
            assert i == len(lines) - 1, f"{out.name}: line {i + 1} of the prompt log is corrupt: {line!r}"
            continue
        entries.append((p["step"], p["example_ids"]))
    return entries


def _sigkill(pids: list[int]) -> int:
    """SIGKILL each of `pids`; how many were still there to signal."""
    signalled = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            signalled += 1
        except ProcessLookupError:
            pass
    return signalled


def kill_and_reap(victims: list[int], launcher: subprocess.Popen, out: Path, what: str) -> int:
    """SIGKILL `victims`, wait for the launcher, and check no role process of run `out` outlived it.
    Returns how many victims were there to signal."""
    signalled = _sigkill(victims)
    launcher.wait(timeout=120)
    time.sleep(0.5)
    assert not any(_role_pids(out, r) for r in ROLES[:3]), what
    return signalled


def resume_run(out: Path) -> subprocess.CompletedProcess:
    """`hpcrl resume --step -1` on run `out`, waited for, output captured."""
    return subprocess.run(
        _hpcrl("resume", "--step", "-1", "--output-dir", str(out)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _role_pids(out: Path, role: str) -> list[int]:
    """Processes of this run that play `role` (found through /proc, like `pgrep -f`)."""
    marker = str(out)
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "hpcrl.cli" in args and role in args and marker.encode() in env:
            pids.append(int(d.name))
    return pids


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    """`hpcrl <args>` in the background, its output in `log`."""
    with open(log, "w") as fh:
        return subprocess.Popen(_hpcrl(*args), env=_env(), stdout=fh, stderr=subprocess.STDOUT)


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.is_file() else f"({log} missing)"


def _await_checkpoint(
    out: Path, proc: subprocess.Popen, newer_than: int | None, log: Path, timeout: float = 300
) -> int | None:
    """The first complete checkpoint of run `out` newer than `newer_than` (any, if None), as soon as
    it exists; None if `proc` exited first. Polls by stat (checkpoint.newest_intact), not by hashing."""
    paths = RunPaths(out)
    seen: dict[int, tuple[int, str | None]] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        step = checkpoint.newest_intact(paths, seen)
        if step is not None and (newer_than is None or step > newer_than):
            return step
        assert time.monotonic() < deadline, (
            f"no checkpoint newer than {newer_than} in {timeout:.0f}s:\n{_tail(log)}"
        )
        time.sleep(0.05)
    return None


class Reference(NamedTuple):
    cfg: Path  # the trials' config
    out: Path  # the uninterrupted run: every step's checkpoint and weights kept
    weights: dict[str, bytes]  # its final weights
    prompts: list[list[int]]  # each step's training prompt ids
    step_s: float  # seconds per training step, measured between its checkpoints


def _run_reference(root: Path) -> tuple[Path, float]:
    """Run the uninterrupted reference under `root`; its output dir and seconds per step (measured, so
    kills land a step or so after the checkpoint a trial awaits however fast this machine is)."""
    cfg = root / "reference.toml"
    cfg.write_text(CONFIG.format(max_steps=MAX_STEPS, keep_last=MAX_STEPS))
    out = Path(tempfile.mkdtemp(prefix="reference_", dir=root))  # a fresh one if an attempt failed
    log = out.with_suffix(".log")
    proc = _launch(["run", str(cfg), "--output-dir", str(out)], log)
    paths = RunPaths(out)
    seen: dict[int, tuple[int, str | None]] = {}
    seen_at: dict[int, float] = {}  # step -> when its checkpoint was first seen complete
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        step = checkpoint.newest_intact(paths, seen)
        if step is not None and step not in seen_at:
            seen_at[step] = time.monotonic()
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    assert proc.wait() == 0, _tail(log)
    first, last = min(seen_at), max(seen_at)
    assert last > first, f"checkpoints seen: {sorted(seen_at)}"
    return out, (seen_at[last] - seen_at[first]) / (last - first)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run. Under pytest-xdist the workers of this session share one (a file lock:
    the first runs it, the other waits and reads its result)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "reliability"  # this session's, every worker's
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("reliability")
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "reference.json"
        if not done.is_file():
            out, step_s = _run_reference(root)
            done.write_text(json.dumps({"out": str(out), "step_s": step_s}))
        meta = json.loads(done.read_text())
        cfg = root / "cfg.toml"
        if not cfg.is_file():
            cfg.write_text(CONFIG.format(max_steps=MAX_STEPS, keep_last=2))
    out = Path(meta["out"])
    weights, prompts = _final_state(out)
    return Reference(cfg, out, weights, prompts, meta["step_s"])


def _check_prompts_and_weights(ref: Reference, out: Path, step: int, what: str) -> None:
    """Run `out`'s prompt log holds steps 1..`step` once each, in order, with the reference's prompts
    (later steps may be there too: they are generated again after a resume), and its weights of
    `step` are the reference's, bitwise."""
    entries = [(s, ids) for s, ids in _prompt_log(out) if s <= step]
    assert [s for s, _ in entries] == list(range(1, step + 1)), (
        f"{what}: prompt log steps up to {step}: {[s for s, _ in entries]}"
    )
    assert [ids for _, ids in entries] == ref.prompts[:step], (
        f"{what}: prompt sequence differs up to step {step}"
    )
    weights, expected = _weights(out, step), _weights(ref.out, step)
    assert weights.keys() == expected.keys(), f"{what}: tensors of step {step} differ"
    assert all(weights[k] == expected[k] for k in weights), f"{what}: weights of step {step} differ"


def _check_after_kill(ref: Reference, out: Path, awaited: int, what: str) -> int:
    """What a kill left: a complete checkpoint (the newest, returned) not older than `awaited`, the one
    seen complete before the kill, and the run up to it equal to the reference. (A resume that left
    the dead launch's newer step directories in place once broke this: the resumed trainer's part of
    such a step was finalized with the dead launch's orchestrator part, a checkpoint that the next
    resume trusted and a prompt went missing; hpcrl.checkpoint.clear_after.)"""
    step = checkpoint.latest_complete(RunPaths(out))
    assert step is not None and step >= awaited, (
        f"{what}: newest complete checkpoint {step}, but {awaited} was complete before the kill"
    )
    _check_prompts_and_weights(ref, out, step, what)
    return step


def _check_finished(ref: Reference, out: Path, rc: int | None, output: str, what: str) -> None:
    """A launch that ran to the end: exit code 0, every step's prompts and the final weights."""
    detail = f"{what}: {output}"
    assert rc == 0, detail
    weights, prompts = _final_state(out)
    assert prompts == ref.prompts, f"{detail}\nprompt sequence differs"
    assert weights.keys() == ref.weights.keys()
    assert all(weights[k] == ref.weights[k] for k in weights), f"{detail}\nfinal weights differ"
    _check_prompts_and_weights(ref, out, MAX_STEPS, what)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("chain", range(CHAINS))
def test_sigkill_random_role_then_resume_is_lossless(
    reference: Reference, tmp_path: Path, chain: int
) -> None:
    """Trials k = chain * PER_CHAIN + i, chained (module doc). The first four trials kill each role in
    turn, the others a random one, each at a random moment within KILL_WINDOW_STEPS steps after the
    checkpoint it awaits."""
    ref = reference
    trials = range(chain * PER_CHAIN, min(TRIALS, (chain + 1) * PER_CHAIN))
    launches: list[str] = []  # "run" / "resume", one per launch
    kills: list[str] = []  # per trial: "k role: awaited checkpoint -> newest complete one after the kill"

    def start(*args: str) -> tuple[subprocess.Popen, Path]:
        launches.append(args[0])
        log = tmp_path / f"launch_{len(launches):02d}_{args[0]}.log"
        return _launch(list(args), log), log

    def fresh_run() -> tuple[Path, subprocess.Popen, Path, int | None]:
        out = tmp_path / f"run_{launches.count('run') + 1}"
        proc, log = start("run", str(ref.cfg), "--output-dir", str(out))
        return out, proc, log, None

    out, proc, log, base = fresh_run()  # base: the checkpoint `proc` resumed from (None: a fresh run)
    for k in trials:
        rng = random.Random(1234 + k)
        role = ROLES[k] if k < len(ROLES) else rng.choice(ROLES)
        delay = rng.uniform(0.0, KILL_WINDOW_STEPS * ref.step_s)
        missed = 0  # fresh runs that ended before this trial's kill landed
        while True:
            what = f"chain {chain}, trial {k} (kill {role}, {log.name})"
            awaited = _await_checkpoint(out, proc, base, log)
            signalled, in_place = 0, False
            if awaited is not None:
                # A moment after a checkpoint newer than the one resumed from (before the first
                # checkpoint there is nothing to resume: a rerun from scratch is the answer).
                time.sleep(0.0 if missed else delay)
                victims = [proc.pid] if role == "launcher" else _role_pids(out, role)
                alive = proc.poll() is None  # never signal a launcher pid that was reaped (reused)
                if role == "inference":
                    in_place = alive and _sigkill(victims) > 0
                else:
                    signalled = kill_and_reap(
                        victims if alive else [], proc, out, f"{what}: processes outlived the launcher"
                    )
            if in_place:
                break
            rc = proc.wait(timeout=600)
            landed = rc == -signal.SIGKILL if role == "launcher" else signalled > 0 and rc != 0
            if landed:
                break
            # Ended by itself before the kill: cleanly, and complete (a resume: the previous trial's).
            _check_finished(ref, out, rc, _tail(log), f"{what}: ended before the kill")
            if base is None:
                missed += 1
                assert missed < 2, f"{what}: the run ended before {role} could be killed, twice"
            out, proc, log, base = fresh_run()
        assert awaited is not None  # a kill lands only after a checkpoint
        if in_place:
            # The launcher restarts a killed inference server in place and the run goes on: nothing to
            # resume. The next trial kills this same launch (and checks it up to a newer checkpoint);
            # as the chain's last, the run must end by itself, complete and equal to the reference.
            kills.append(f"{k} inference: {awaited}->restarted in place")
            base = awaited
            if k == trials[-1]:
                _check_finished(ref, out, proc.wait(timeout=600), _tail(log), f"{what}: after the kill")
            continue
        step = _check_after_kill(ref, out, awaited, what)
        kills.append(f"{k} {role}: {awaited}->{step}")
        base = step
        if k == trials[-1]:
            launches.append("resume")
            resumed = resume_run(out)
            _check_finished(
                ref,
                out,
                resumed.returncode,
                f"{resumed.stdout[-1500:]}{resumed.stderr[-1500:]}",
                f"{what}: resume",
            )
        else:
            proc, log = start("resume", "--step", "-1", "--output-dir", str(out))
    assert len(kills) == len(trials), f"chain {chain}: {len(kills)} kills for {len(trials)} trials"
    resumed_kills = [x for x in kills if "restarted in place" not in x]
    assert launches.count("resume") == len(resumed_kills), f"chain {chain}: launches {launches}"
    print(f"chain {chain}: killed {kills}; launches {launches}")
