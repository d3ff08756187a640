"""Wall time of `hpcrl --help` and every subcommand's `--help` (fresh process each run).

    python scripts/bench/cli.py                 # median of 5 runs per command, target 0.3 s
    python scripts/bench/cli.py --runs 3 --commands run sft --strict

Each run is a new interpreter (`python -m hpcrl.cli ...`, the repository on PYTHONPATH), so the
number includes interpreter start-up and every import the help path makes. Help must never import
torch / transformers / numpy: the table says which heavy modules a command's help pulled in.
Exit status: 0, or 1 with --strict when any command misses the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy")
# Prints the heavy modules a help invocation imported, on stderr's last line.
_PROBE = (
    "import sys, io, contextlib\n"
    "from hpcrl.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    try:\n"
    "        main(sys.argv[1:])\n"
    "    except SystemExit:\n"
    "        pass\n"
    f"print(','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
)


def commands() -> list[str]:
    sys.path.insert(0, str(REPO))
    from hpcrl.cli import COMMANDS

    return list(COMMANDS)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def time_help(command: str | None, runs: int) -> tuple[float, int]:
    """(median seconds, exit status of the last run) of `hpcrl [command] --help`."""
    argv = [sys.executable, "-m", "hpcrl.cli", *([command] if command else []), "--help"]
    times, rc = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        rc = subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=REPO
        ).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rc


def heavy_imports(command: str | None) -> str:
    argv = [sys.executable, "-c", _PROBE, *([command] if command else []), "--help"]
    p = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=REPO)
    if p.returncode != 0:
        return "error: " + (p.stderr.strip().splitlines() or ["?"])[-1][:60]
    return (p.stderr.strip().splitlines() or [""])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per command (median reported)")
    ap.add_argument("--target", type=float, default=0.3, help="seconds a help may take")
    ap.add_argument(
        "--commands", nargs="*", help="subcommands to time (default: all); '-' = bare `hpcrl --help`"
    )
    ap.add_argument("--strict", action="store_true", help="exit 1 when any command misses the target")
    args = ap.parse_args(argv)

    todo: list[str | None] = (
        [None, *commands()] if not args.commands else [None if c == "-" else c for c in args.commands]
    )
    rows, failed = [], 0
    for cmd in todo:
        median, rc = time_help(cmd, args.runs)
        heavy = heavy_imports(cmd)
        ok = median <= args.target and rc == 0 and not heavy
        failed += not ok
        rows.append(
            (f"hpcrl {cmd + ' ' if cmd else ''}--help", median, rc, heavy or "-", "pass" if ok else "FAIL")
        )

    width = max(len(r[0]) for r in rows)
    print(
        f"{'command':<{width}}  {'median':>8}  rc  {'heavy imports':<14} target {args.target:.2f}s ({args.runs} runs)"
    )
    for name, median, rc, heavy, verdict in rows:
        print(f"{name:<{width}}  {median:>7.3f}s  {rc:>2}  {heavy:<14} {verdict}")
    print(f"{len(rows) - failed}/{len(rows)} within target")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
