"""The dashboard's starlette app: five pages, the JSON routes they poll, and a guard in front of both.

The guard (an ASGI middleware, so nothing reaches a route without passing it):
- only GET and HEAD: every route is read-only (405 otherwise);
- with a token (required when bound beyond loopback): `Authorization: Bearer T`, or the cookie that
  `?token=T` sets once (401 otherwise);
- bound to loopback without a token: only a loopback Host header (a web page cannot reach the
  dashboard through DNS rebinding);
- a Content-Security-Policy that lets a page load nothing but the dashboard's own files.

Routes never take a path: runs by index, and components, configs, steps and rows by names and
numbers the server listed (hpcrl.dashboard.runs says why).
"""

from __future__ import annotations

import contextlib
import hmac
import mimetypes
import threading
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from hpcrl.dashboard import configs, logs, overview, rollouts
from hpcrl.dashboard.runs import Run, pick
from hpcrl.dashboard.series import MetricsStore, series

STATIC = Path(__file__).parent / "static"
PAGES = {
    "/": "overview",
    "/metrics": "metrics",
    "/rollouts": "rollouts",
    "/logs": "logs",
    "/config": "config",
}
SCRIPTS = {"rollouts": ("rollout_view.js", "rollouts.js")}  # a page's own scripts (default: <page>.js)
COOKIE = "hpcrl_dashboard"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class BadRequest(Exception):
    pass


def _json(obj: Any, status: int = 200) -> Response:
    import msgspec

    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _int(req: Request, name: str, default: int | None = None, lo: int = 0, hi: int = 1 << 40) -> int:
    raw = req.query_params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadRequest(f"{name}: required")
        return default
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {raw[:40]!r}") from None
    return max(lo, min(hi, v))


def _float(req: Request, name: str, default: float, lo: float, hi: float) -> float:
    try:
        v = float(req.query_params.get(name, default))
    except ValueError:
        raise BadRequest(f"{name}: expected a number") from None
    return max(lo, min(hi, v)) if v == v else default


class Dashboard:
    def __init__(self, runs: list[Run]):
        self.runs = runs
        self.static = _static_files()

    # -- helpers ---------------------------------------------------------------------------------
    def run(self, req: Request) -> Run:
        return pick(self.runs, req.query_params.get("run"))[0]

    def store(self, run: Run) -> MetricsStore:
        store = run.cached("metrics", lambda: MetricsStore(run.paths.metrics_file))
        store.refresh()
        return store

    def warm(self) -> None:
        """Index every run's metrics once, in the background, so the first page is served warm."""

        def go() -> None:
            for r in self.runs:
                self.store(r)

        threading.Thread(target=go, name="dashboard-warm", daemon=True).start()

    # -- pages -------------------------------------------------------------------------------------
    def page(self, req: Request) -> Response:
        name = PAGES[req.url.path]
        html = self.static["page.html"][0].decode()
        tags = "\n".join(f'<script src="/static/{js}"></script>' for js in SCRIPTS.get(name, (f"{name}.js",)))
        html = (
            html.replace("{{scripts}}", tags)
            .replace("{{page}}", name)
            .replace("{{title}}", f"hpcrl · {name}")
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    def static_file(self, req: Request) -> Response:
        hit = self.static.get(req.path_params["name"])
        if hit is None:
            return Response("not found\n", status_code=404, media_type="text/plain")
        data, ctype = hit
        return Response(data, media_type=ctype, headers={"Cache-Control": "no-cache"})

    # -- JSON --------------------------------------------------------------------------------------
    def api_runs(self, req: Request) -> Response:
        return _json({"runs": [r.describe() for r in self.runs]})

    def api_overview(self, req: Request) -> Response:
        chosen = pick(self.runs, req.query_params.get("runs"), default_all=True)
        return _json({"runs": [overview.overview(r, self.store(r)) for r in chosen]})

    def api_metric_names(self, req: Request) -> Response:
        names: dict[str, set[str]] = {}
        for r in pick(self.runs, req.query_params.get("runs"), default_all=True):
            for n, roles in self.store(r).names().items():
                names.setdefault(n, set()).update(roles)
        return _json({"names": {n: sorted(v) for n, v in sorted(names.items())}})

    def api_series(self, req: Request) -> Response:
        x = req.query_params.get("x", "step")
        if x not in ("step", "elapsed", "time"):
            raise BadRequest("x: expected step, elapsed or time")
        smooth = _float(req, "smooth", 0.0, 0.0, 0.999)
        points = _int(req, "points", 600, 10, 5000)
        names = req.query_params.getlist("name")[:64]
        chosen = pick(self.runs, req.query_params.get("runs"), default_all=True)
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in chosen:
            store = self.store(r)
            for n in names:
                for s in series(store, n, x, smooth, points):
                    out[n].append({"run": r.id, **s})
        return _json({"x": x, "series": out})

    def api_log_components(self, req: Request) -> Response:
        run = self.run(req)
        comps = logs.components(run)
        return _json({"run": run.id, "components": [{"name": k, "files": len(v)} for k, v in comps.items()]})

    def api_logs(self, req: Request) -> Response:
        import json

        run = self.run(req)
        comps = logs.components(run)
        name = req.query_params.get("component") or ("orchestrator" if "orchestrator" in comps else "")
        files = comps.get(name)
        if files is None:
            return _json({"error": f"component: no logs named {name[:80]!r}", "components": list(comps)}, 404)
        try:
            keep = logs.matcher(
                req.query_params.get("q"), req.query_params.get("regex") == "1", req.query_params.get("level")
            )
        except ValueError as e:
            raise BadRequest(str(e)) from None
        limit = _int(req, "limit", 300, 1, 2000)

        def offsets(key: str) -> dict[str, int] | None:
            raw = req.query_params.get(key)
            if not raw:
                return None
            try:
                doc = json.loads(raw)
                return {str(k): int(v) for k, v in doc.items()}  # only looked up, never opened
            except (ValueError, TypeError, AttributeError):
                raise BadRequest(f"{key}: expected a JSON object of offsets") from None

        after = offsets("after")
        if after is not None:
            out = logs.follow(run, files, after, keep, limit)
        else:
            out = logs.page_back(run, files, offsets("cursor"), keep, limit)
        return _json({"run": run.id, "component": name, **out})

    def api_configs(self, req: Request) -> Response:
        run = self.run(req)
        return _json({"run": run.id, "names": list(configs.listing(run))})

    def api_config(self, req: Request) -> Response:
        run = self.run(req)
        name = req.query_params.get("name", "resolved")
        body = configs.text(run, name)
        if body is None:
            return _json(
                {"error": f"name: no config named {name[:80]!r}", "names": list(configs.listing(run))}, 404
            )
        return _json({"run": run.id, "name": name, "text": body})

    def api_config_diff(self, req: Request) -> Response:
        chosen = pick(self.runs, req.query_params.get("runs"), default_all=True)
        return _json({"runs": [r.id for r in chosen], "rows": configs.diff(chosen)})

    def api_rollout_steps(self, req: Request) -> Response:
        run = self.run(req)
        return _json({"run": run.id, **rollouts.steps(run)})

    def api_rollout_groups(self, req: Request) -> Response:
        run = self.run(req)
        step = _int(req, "step")
        out = rollouts.groups(
            run,
            step,
            req.query_params.get("split", "train"),
            _int(req, "page", 0),
            _int(req, "size", 20, 1, 200),
            req.query_params.get("env") or None,
            req.query_params.get("sort", ""),
        )
        return _json({"run": run.id, **out})

    def api_rollout_records(self, req: Request) -> Response:
        run = self.run(req)
        rows = []
        for part in req.query_params.get("rows", "").split(",")[: rollouts.MAX_RECORDS]:
            if part.strip().isdigit():
                rows.append(int(part))
        recs = rollouts.records(run, _int(req, "step"), req.query_params.get("split", "train"), rows)
        return _json({"run": run.id, "records": recs})


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every file under static/, read once: the only files a client can ask for by name."""
    out = {}
    for p in sorted(STATIC.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            rel = p.relative_to(STATIC).as_posix()
            ctype = mimetypes.guess_type(p.name)[0] or "text/plain"
            if p.suffix == ".js":
                ctype = "text/javascript"
            out[rel] = (p.read_bytes(), ctype if not ctype.startswith("text/") else ctype + "; charset=utf-8")
    return out


def _route(fn: Any) -> Any:
    def handler(req: Request) -> Response:
        try:
            return fn(req)
        except BadRequest as e:
            return _json({"error": str(e)}, 400)

    return handler


def build_app(runs: list[Run], token: str | None = None, loopback_only: bool = True) -> Any:
    d = Dashboard(runs)
    routes = [Route(path, _route(d.page)) for path in PAGES]
    routes += [
        Route("/static/{name:path}", _route(d.static_file)),
        Route("/api/runs", _route(d.api_runs)),
        Route("/api/overview", _route(d.api_overview)),
        Route("/api/metric_names", _route(d.api_metric_names)),
        Route("/api/series", _route(d.api_series)),
        Route("/api/log_components", _route(d.api_log_components)),
        Route("/api/logs", _route(d.api_logs)),
        Route("/api/configs", _route(d.api_configs)),
        Route("/api/config", _route(d.api_config)),
        Route("/api/config_diff", _route(d.api_config_diff)),
        Route("/api/rollout_steps", _route(d.api_rollout_steps)),
        Route("/api/rollout_groups", _route(d.api_rollout_groups)),
        Route("/api/rollout_records", _route(d.api_rollout_records)),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        d.warm()
        yield

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = d
    return Guard(app, token, loopback_only)


class Guard:
    """Read-only, token, Host and CSP checks in front of every route (see the module docstring)."""

    def __init__(self, app: Any, token: str | None, loopback_only: bool):
        self.app, self.token, self.loopback_only = app, token, loopback_only

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.refuse(scope, headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if self.token and "token" in query:  # the token checked by refuse(): keep it in a cookie
            rest = urlencode([(k, v) for k, v in query.items() if k != "token"])
            location = scope["path"] + (f"?{rest}" if rest else "")
            cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
            resp = Response(status_code=303, headers={"Location": location, "Set-Cookie": cookie})
            return await resp(scope, receive, send)

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def refuse(self, scope: dict, headers: dict[str, str]) -> Response | None:
        if scope["method"] not in ("GET", "HEAD"):
            return Response("the dashboard is read-only\n", status_code=405, headers={"Allow": "GET, HEAD"})
        if self.token:
            return (
                None
                if self._has_token(scope, headers)
                else Response(
                    "this dashboard needs its token: open it once with ?token=<token> (or send "
                    "Authorization: Bearer <token>)\n",
                    status_code=401,
                    media_type="text/plain",
                )
            )
        if self.loopback_only:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in LOOPBACK_HOSTS:
                return Response(
                    "this dashboard answers loopback addresses only (Host header)\n",
                    status_code=403,
                    media_type="text/plain",
                )
        return None

    def _has_token(self, scope: dict, headers: dict[str, str]) -> bool:
        assert self.token
        want = self.token.encode()
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), want):
            return True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header is no token
            return False
        if COOKIE in cookie and hmac.compare_digest(cookie[COOKIE].value.encode(), want):
            return True
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        return "token" in query and hmac.compare_digest(query["token"].encode(), want)
