"""Time to name a stall under the default bound (stall_warning_s = 60), issue 40's must-show:
a frozen-then-resumed inference server and a frozen-then-resumed trainer are named within 90 s in
the orchestrator's log and in `hpcrl status`, and both runs finish with exit 0.

    python scripts/bench/stall_naming.py [--steps 400] [--out /tmp/stall_naming]

Each case: `hpcrl run` of the tiny RL config (tests/integration/tiny_run.py), SIGSTOP of the
component once 5 batches are published, SIGCONT as soon as the log names it; prints the seconds
from SIGSTOP to the WARNING and to `hpcrl status` showing it, the line itself, and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.tiny_run import TINY_RL  # noqa: E402

CASES = {  # component -> (placement role, what the orchestrator's stall line must say)
    "inference server": ("inference", ["inference server 0", "/health unanswered", "requests"]),
    "trainer": ("trainer", ["waiting on policy", "trainer_0 unresponsive"]),
}


def hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def one(case: str, root: Path, steps: int) -> dict:
    role, needles = CASES[case]
    out = root / role
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "cfg.toml").write_text(TINY_RL.format(steps=steps))
    run = out / "run"
    proc = subprocess.Popen(
        hpcrl("run", str(out / "cfg.toml"), "--output-dir", str(run)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prompts, olog = run / "logs" / "prompts.jsonl", run / "logs" / "orchestrator.log"
    while not (prompts.exists() and len(prompts.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    pid = json.loads((run / "logs" / "placement" / f"{role}_0.json").read_text())["pid"]
    mark = len(olog.read_text())
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    named = status_s = None
    line = ""
    try:
        while time.monotonic() - t0 < 150:
            new = olog.read_text()[mark:]
            hit = [x for x in new.splitlines() if "no progress for" in x and all(n in x for n in needles)]
            if hit and named is None:
                named, line = time.monotonic() - t0, hit[0]
            if named is not None and status_s is None:
                st = subprocess.run(hpcrl("status", str(run)), capture_output=True, text=True).stdout
                if ("stalled" in st or "unresponsive" in st) and all(n in st for n in needles[:2]):
                    status_s = time.monotonic() - t0
                    status = [x for x in st.splitlines() if "stalled" in x or "unresponsive" in x]
            if named is not None and status_s is not None:
                break
            time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=900)
    return {
        "component": case,
        "named_s": None if named is None else round(named, 1),
        "status_s": None if status_s is None else round(status_s, 1),
        "line": line.split("] ", 1)[-1],
        "status": status if status_s is not None else [],
        "exit": proc.returncode,
        "last": (err.strip().splitlines() or [""])[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("/tmp/stall_naming"))
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    args = ap.parse_args()
    for case in args.case or list(CASES):
        r = one(case, args.out, args.steps)
        print(json.dumps(r, indent=1), flush=True)


if __name__ == "__main__":
    main()
