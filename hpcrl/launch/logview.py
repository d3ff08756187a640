"""`hpcrl logs DIR [-c COMPONENT | --env NAME] [-f] [--search TEXT | --regex RE] [--level L] [--since T]`,
`hpcrl logs DIR --warnings [-f]` (every role's distinct WARNING/ERROR messages with counts, as `hpcrl
run` prints them: hpcrl.launch.alerts) and `hpcrl components DIR`.

A log record is a line that starts with `HH:MM:SS LEVEL` (hpcrl's format, every role and env process)
plus the lines after it that do not (a traceback belongs to the record above it), so filters keep or
drop whole records. Several files (an env's orchestrator-side log, its server and its workers) are
merged by time, each line prefixed with its file.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from hpcrl.launch.logrecords import HEAD, LEVELS, ROLES, Record, records  # noqa: F401 (re-exported)
from hpcrl.paths import RunPaths


def parse_since(text: str, now: datetime) -> float:
    """Seconds since midnight from `10m` / `2h` / `30s` / `1d` ago, or a clock time `HH:MM[:SS]`."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        then = now - timedelta(seconds=float(m.group(1)) * unit)
        return 0.0 if then.date() < now.date() else then.hour * 3600 + then.minute * 60 + then.second
    m = re.fullmatch(r"(\d\d?):(\d\d)(?::(\d\d))?", text.strip())
    if m:
        return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3) or 0)
    raise ValueError(f"--since {text!r}: give a duration (30s, 10m, 2h, 1d) or a clock time HH:MM[:SS]")


def make_filter(
    level: str | None, search: str | None, regex: str | None, since: float | None
) -> Callable[[Record], bool]:
    floor = LEVELS[level] if level else 0
    pattern = re.compile(regex) if regex else None

    def keep(r: Record) -> bool:
        if r.level < floor or (since is not None and 0 <= r.seconds < since):
            return False
        text = "\n".join(r.lines)
        if search is not None and search.lower() not in text.lower():
            return False
        return pattern is None or pattern.search(text) is not None

    return keep


def env_files(paths: RunPaths, name: str) -> list[Path]:
    """Every log of env NAME: the orchestrator's events for it, its server's and its workers'."""
    out: list[Path] = []
    for kind in ("train", "eval"):
        out.append(paths.env_log_file(kind, name))
        d = paths.env_server_dir(kind, name)
        if d.is_dir():
            out += sorted(d.glob("*.log"))
    return [p for p in out if p.exists()]


def component_files(paths: RunPaths, component: str | None, env: str | None) -> list[Path]:
    if env is None and component and component.startswith("env:"):
        env = component[4:]
    if env is not None:
        files = env_files(paths, env)
        if not files:
            known = sorted({p.parent.name for p in paths.logs_dir.glob("envs/*/*/server.log")})
            raise SystemExit(
                f"hpcrl: error: --env {env}: no logs yet; envs with logs: {', '.join(known) or 'none'}"
            )
        return files
    component = component or "orchestrator"
    if component not in ROLES:
        raise SystemExit(
            f"hpcrl: error: -c {component}: expected {', '.join(ROLES)} or env:NAME (or --env NAME)"
        )
    main = paths.log_file(component)
    return [main, *sorted((paths.logs_dir / component).glob("rank_*.log"))]


def _label(paths: RunPaths, p: Path, many: bool) -> str:
    return f"[{p.relative_to(paths.logs_dir)}] " if many else ""


def show(paths: RunPaths, files: list[Path], keep: Callable[[Record], bool], last: int) -> dict[Path, int]:
    many = len(files) > 1
    recs: list[Record] = []
    offsets: dict[Path, int] = {}
    for p in files:
        if p.exists():
            data = p.read_text(errors="replace")
            offsets[p] = len(data.encode(errors="replace"))
            recs += [r for r in records(data.splitlines(), _label(paths, p, many)) if keep(r)]
        else:
            offsets[p] = 0
    recs.sort(key=lambda r: r.seconds)  # stable: one file's records keep their order
    lines = [r.source + line for r in recs for line in r.lines]
    for line in lines[-last:] if last else lines:
        print(line)
    return offsets


def follow(
    paths: RunPaths, files: list[Path], keep: Callable[[Record], bool], offsets: dict[Path, int]
) -> None:
    many = len(files) > 1
    while True:
        time.sleep(0.5)
        for p in files:
            if not p.exists() or p.stat().st_size <= offsets.get(p, 0):
                continue
            with open(p, "rb") as f:
                f.seek(offsets.get(p, 0))
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next round
            offsets[p] = offsets.get(p, 0) + cut
            for r in records(chunk[:cut].decode(errors="replace").splitlines(), _label(paths, p, many)):
                if keep(r):
                    sys.stdout.write("".join(r.source + line + "\n" for line in r.lines))
            sys.stdout.flush()


def logs(argv: list[str]) -> int:
    from hpcrl.launch.rundir_args import _parse, _parser, _run_dir

    p = _parser("logs")
    p.add_argument("-c", "--component", default=None, help="trainer|orchestrator|inference|launcher|env:NAME")
    p.add_argument("--env", default=None, help="an environment's logs (orchestrator side, server, workers)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=50, help="last N lines (0 = all)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--search", default=None, help="only records containing TEXT (case-insensitive)")
    g.add_argument("--regex", default=None, help="only records matching a regular expression")
    p.add_argument("--level", choices=sorted(LEVELS, key=LEVELS.get), default=None, help="minimum level")
    p.add_argument("--since", default=None, help="only records since 30s / 10m / 2h / 1d ago or HH:MM[:SS]")
    p.add_argument(
        "--warnings",
        action="store_true",
        help="every role's WARNING and ERROR messages, each distinct one once with its count (-f: as they come)",
    )
    args = _parse(p, argv)
    paths = _run_dir(args)
    try:
        since = None if args.since is None else parse_since(args.since, datetime.now())
        if args.regex is not None:
            re.compile(args.regex)
    except (ValueError, re.error) as e:
        print(f"hpcrl: error: {e if isinstance(e, ValueError) else f'--regex: {e}'}", file=sys.stderr)
        return 2
    if args.warnings:
        from hpcrl.launch.alerts import show_warnings

        return show_warnings(paths, args.follow, make_filter(None, args.search, args.regex, since))
    files = component_files(paths, args.component, args.env)
    if not any(f.exists() for f in files) and not args.follow:
        print(f"hpcrl: error: no log yet at {files[0]}", file=sys.stderr)
        return 2
    keep = make_filter(args.level, args.search, args.regex, since)
    offsets = show(paths, files, keep, args.lines)
    if args.follow:
        follow(paths, files, keep, offsets)
    return 0


def component_rows(paths: RunPaths) -> list[dict]:
    """Every process of a run: the roles' placement records and every env server and worker."""
    from hpcrl.envs.runtime.components import alive, env_rows
    from hpcrl.runtime import read_records

    rows = [
        {
            "role": f"{r.get('role')} {r.get('rank', 0)}",
            "env": "-",
            "pid": r.get("pid"),
            "node": r.get("node"),
            "state": alive(r.get("pid"), r.get("node")),
            "restarts": r.get("restart", 0),
        }
        for r in read_records(paths)
        if not str(r.get("role", "")).startswith("env-server")  # env_rows has them, workers too
    ]
    return rows + env_rows(paths.logs_dir / "envs")


def components(argv: list[str]) -> int:
    from hpcrl.launch.rundir_args import _parse, _parser, _run_dir

    p = _parser("components")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = _parse(p, argv)
    rows = component_rows(_run_dir(args))
    if args.json:
        import json

        for r in rows:
            print(json.dumps(r))
        return 0
    print("\n".join(table(rows)))
    return 0


def table(rows: list[dict]) -> list[str]:
    cols = ("role", "env", "pid", "node", "state", "restarts")
    cells = [cols] + [tuple("-" if r.get(c) is None else str(r.get(c)) for c in cols) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
