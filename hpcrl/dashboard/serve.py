"""`hpcrl dashboard DIR [DIR ...] [--host H] [--port P] [--token T]`, and the dashboard that
`hpcrl run --dashboard` starts beside a run.

It binds 127.0.0.1 by default. Any other address serves other machines, so it needs a token
(--token, or $HPCRL_DASHBOARD_TOKEN, which keeps it out of `ps`): refused in one line without one.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from hpcrl.dashboard.runs import DashboardError, discover
from hpcrl.net import DASHBOARD_PORT

TOKEN_ENV = "HPCRL_DASHBOARD_TOKEN"
DEFAULT_PORT = DASHBOARD_PORT
PORT_TRIES = 20  # the default port taken (another dashboard): the next free one of these


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcrl dashboard",
        description="A read-only web page over run directories: overview, metrics, rollouts, logs, "
        "configs; several runs overlaid. A folder of runs (outputs/) serves every run in it.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="run directories (or folders of them)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; another needs a token)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port (default {DEFAULT_PORT}, or the next free one; 0: any free)",
    )
    p.add_argument("--token", default=None, help=f"access token (prefer ${TOKEN_ENV}: not visible in ps)")
    return p


def bind(host: str, port: int | None) -> socket.socket:
    """A listening socket: `port`, or the first free one from DEFAULT_PORT when none was asked."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    tries = [port] if port is not None else [DEFAULT_PORT + i for i in range(PORT_TRIES)]
    err: OSError | None = None
    for candidate in tries:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), candidate))
        except OSError as e:
            sock.close()
            err = e
            continue
        sock.listen(128)
        sock.set_inheritable(True)
        return sock
    raise DashboardError(
        f"--host {host} --port {tries[0] if len(tries) == 1 else f'{tries[0]}..{tries[-1]}'}: cannot bind ({err})"
    )


def urls(host: str, port: int) -> list[str]:
    """What to print: the URL, and the ssh tunnel line for reaching it from a laptop (a SLURM head
    node, any remote machine)."""
    shown = f"[{host}]" if ":" in host else host
    lines = [f"hpcrl dashboard: http://{shown}:{port}/"]
    if is_loopback(host):
        fqdn = socket.getfqdn() or socket.gethostname()
        lines.append(
            f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} {fqdn}  then http://127.0.0.1:{port}/"
        )
    else:
        lines.append("  open it once with ?token=<token>; the browser keeps it in a cookie")
    return lines


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    loopback = is_loopback(args.host)
    if not loopback and not token:
        raise DashboardError(
            f"--host {args.host} is not a loopback address: a dashboard other machines can reach needs a "
            f"token (set ${TOKEN_ENV} or --token T), or use an ssh tunnel to 127.0.0.1"
        )
    runs = discover(args.dirs)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    import uvicorn

    from hpcrl.dashboard.app import build_app

    app = build_app(runs, token=token, loopback_only=loopback)
    print("\n".join(urls(args.host, port)), flush=True)
    print(f"  runs: {', '.join(r.name for r in runs)}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0


@contextlib.contextmanager
def beside(output_dir: str | Path) -> Iterator[None]:
    """`hpcrl run --dashboard`: a dashboard process over the run's directory for as long as the
    run lasts (its URL is printed with the run's header). Its own errors never end the run."""
    cmd = [sys.executable, "-m", "hpcrl.cli", "dashboard", str(output_dir)]
    proc = None
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(
            f"hpcrl: note: the dashboard did not start ({e}); `hpcrl dashboard {output_dir}` starts it",
            flush=True,
        )
    try:
        yield
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
