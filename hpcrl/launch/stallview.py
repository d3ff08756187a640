"""What `hpcrl status` shows of a run's health: each role's progress report (running, stalled,
unresponsive: its report stopped being refreshed), whom a stalled role waits on, the state of each
inference server as the orchestrator sees it, and the top causes of errored rollouts."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.monitor.progress import STALE_S, read_progress
from hpcrl.paths import RunPaths


def health_lines(paths: RunPaths, running: bool) -> list[str]:
    lines: list[str] = []
    rows = read_progress(paths.progress_dir)
    if rows:
        lines.append("progress:")
        width = max(len(str(r.get("role"))) for r in rows)
        for r in rows:
            state = r.get("state", "?")
            if r["age_s"] > STALE_S:
                state = "unresponsive" if running else "exited"
            step = "-" if r.get("step") is None else r["step"]
            text = (
                f"  {str(r.get('role')).ljust(width)}  {state:<12} step {step}, last: {r.get('last')} "
                f"({r.get('idle_s', 0):.0f} s ago, reported {r['age_s']:.0f} s ago)"
            )
            if state in ("stalled", "unresponsive") and r.get("stall"):
                text += f"\n    {r['stall']}"
            elif r.get("waiting_on"):
                text += f"\n    waiting on {r['waiting_on']} for {r.get('waiting_s') or 0:.0f} s"
            for on, secs in r.get("refused") or []:  # a write still retried behind another wait
                text += f"\n    waiting on {on} for {secs:.0f} s"
            lines.append(text)
            for name, server_state in (r.get("servers") or {}).items():
                n, age = (r.get("inflight") or {}).get(name, (0, 0))
                lost = (r.get("servers_log_lost") or {}).get(name)
                lines.append(
                    f"    {name}: {server_state}{f' ({lost} log line(s) lost)' if lost else ''}, "
                    f"{n} request(s) in flight, oldest unanswered {age} s"
                )
    causes = read_causes(paths.causes_file)
    if causes:
        lines.append("errored rollouts (top causes):")
        lines += [f"  {env}  {n:>6}  {cause}" for env, cause, n in causes[:5]]
    return lines


def read_causes(path: Path) -> list[tuple[str, str, int]]:
    """(env, cause, count) from logs/causes.json (hpcrl.orchestrator.causes), most frequent first."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    rows = [(env, c, int(n)) for env, d in doc.items() for c, n in (d.get("causes") or {}).items()]
    return sorted(rows, key=lambda r: -r[2])
