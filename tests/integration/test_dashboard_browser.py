"""`hpcrl dashboard` in a real browser: Debian's chromium driven by Playwright (executable_path, no
browser download). Every request to a host other than 127.0.0.1 is blocked and counted (must be 0),
and a page may log no console error. Screenshots go to docs/img/ with HPCRL_UPDATE_SCREENSHOTS=1
(docs/dashboard.md shows them), else to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hpcrl.monitor import rollout_files as rf
from tests.dashboard_synth import make_run, metrics_records

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="Debian's chromium is not installed (apt-get install -y chromium; scripts/setup.sh does it as root, as in CI)",
)
URL_LINE = re.compile(r"hpcrl dashboard: (http://127\.0\.0\.1:\d+)/")


class Dashboard:
    """`python -m hpcrl.dashboard DIRS --port 0` in a subprocess; `url` once it listens."""

    def __init__(self, *dirs: Path, token: str | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("HPCRL_DASHBOARD_TOKEN", None)
        if token:
            env["HPCRL_DASHBOARD_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpcrl.dashboard", *map(str, dirs), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = URL_LINE.search(line)
        assert m, f"no URL line from the dashboard: {line!r}"
        self.url = m.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Browser:
    """One page; every non-127.0.0.1 request aborted and recorded; console errors recorded."""

    def __init__(self, browser, shots: Path):
        self.ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        self.foreign: list[str] = []
        self.errors: list[str] = []
        self.shots = shots
        self.ctx.route("**/*", self._guard)
        self.page = self.ctx.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _guard(self, route, request) -> None:
        if urlsplit(request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.foreign.append(request.url)
            route.abort()

    def shot(self, name: str, height: int = 900) -> None:
        self.page.set_viewport_size({"width": 1280, "height": height})
        self.page.wait_for_timeout(400)  # charts follow the new size
        self.page.screenshot(path=str(self.shots / f"dashboard_{name}.png"))

    def check_clean(self) -> None:
        assert self.foreign == [], f"requests beyond 127.0.0.1: {self.foreign}"
        assert self.errors == [], f"console errors: {self.errors}"
        self.ctx.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    if os.environ.get("HPCRL_UPDATE_SCREENSHOTS") == "1":
        (REPO / "docs" / "img").mkdir(parents=True, exist_ok=True)
        return REPO / "docs" / "img"
    return tmp_path


# Pixels of a chart's canvas in the line colour of run 0 (#2563eb): the curve itself, not the axes.
COLOURED = """(sel) => [...document.querySelectorAll(sel)].map((cv) => {
  const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (d[i + 3] > 128 && Math.abs(d[i] - 37) < 40 && Math.abs(d[i + 1] - 99) < 40 && Math.abs(d[i + 2] - 235) < 40) n++;
  return n; })"""


def until(page, js: str, timeout: float = 30.0) -> None:
    """Wait until the JS expression is true, polled from here: page.wait_for_function evaluates its
    predicate with eval, which the dashboard's Content-Security-Policy forbids (kept on in tests)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(f"() => {{ try {{ return Boolean({js}); }} catch (e) {{ return false; }} }}"):
        assert time.monotonic() < deadline, f"timed out waiting for {js}"
        page.wait_for_timeout(100)


def _charts_drawn(page, at_least: int) -> list[int]:
    until(page, f"document.querySelectorAll('.chart canvas').length >= {at_least}")
    page.wait_for_timeout(300)
    return page.evaluate(COLOURED, ".chart canvas")


@pytest.mark.slow
def test_overview_draws_a_real_demo_run(browser, shots: Path, tmp_path: Path) -> None:
    """A real `hpcrl run --dashboard` of the CPU demo config; then every page over its directory."""
    out = tmp_path / "demo-rl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "run",
            "configs/demo/rl.toml",
            "--dashboard",
            "--output-dir",
            str(out),
            "--max-steps",
            "4",
            "--orchestrator.batch-size",
            "32",
            "--orchestrator.eval.num-examples",
            "8",
            "--orchestrator.eval.interval",
            "2",
            "--log.console-interval",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "hpcrl dashboard: http://127.0.0.1:" in run.stdout  # --dashboard served it beside the run
    d = Dashboard(out)
    try:
        b = Browser(browser, shots)
        b.page.goto(d.url + "/")
        until(b.page, "document.body.innerText.includes('4 / 4')")
        drawn = _charts_drawn(b.page, 3)
        assert len(drawn) >= 3 and all(n > 50 for n in drawn[:3]), drawn  # reward, eval, loss: curves drawn
        assert "finished" in b.page.inner_text("#cards")
        b.shot("overview")
        b.page.goto(d.url + "/metrics")
        assert min(_charts_drawn(b.page, 4)[:4]) > 50
        b.shot("metrics")
        b.page.goto(d.url + "/logs")
        b.page.wait_for_selector(".logs .rec")
        b.shot("logs")
        b.page.goto(d.url + "/config")
        until(
            b.page,
            "document.querySelector('pre.config') && document.querySelector('pre.config').textContent.includes('max_steps')",
        )
        b.shot("config")
        newest = rf.steps(out)
        if newest:  # the run saved its rollouts (orchestrator.save_rollouts): the newest step opens
            b.page.goto(d.url + "/rollouts")
            until(b.page, f"document.getElementById('pageinfo').textContent.startsWith('step {newest[-1]}:')")
            b.page.wait_for_selector(".rollout .msg.assistant")
        b.check_clean()
    finally:
        d.stop()


def test_rollouts_newest_step_and_a_multi_turn_tool_rollout_in_full(
    browser, shots: Path, tmp_path: Path
) -> None:
    root = make_run(tmp_path / "run", steps=12).root
    d = Dashboard(root)
    try:
        b = Browser(browser, shots)
        b.page.goto(d.url + "/rollouts")
        until(
            b.page,
            "document.getElementById('pageinfo').textContent.startsWith('step 12: 16 rollouts in 4 groups')",
        )
        assert b.page.input_value("#stepin") == "12"
        b.page.wait_for_selector(".rollout")  # the first rollout opens by itself
        group = b.page.locator(".group", has_text="calc-tools").first
        group.locator(".chip").nth(1).click()
        view = group.locator(".rollout")
        view.wait_for()
        roles = view.locator(".msg .who").all_inner_texts()
        assert len(roles) == 7, roles  # system, user, assistant, tool, assistant, tool, assistant
        text = view.text_content()
        for part in (
            "add",
            "multiply",
            '"b": 17',
            "result of call_1_0",
            "result of call_1_1",
            "The answer is",
        ):
            assert part in text, part
        assert view.locator(".tok").count() > 10  # sampled tokens coloured by logprob
        assert "correct" in text and "format" in text  # each rubric function's score and weight
        b.shot("rollouts", 1250)
        assert b.page.locator("#split option[value=eval]").is_disabled()  # no eval at step 12
        b.page.fill("#stepin", "10")
        b.page.dispatch_event("#stepin", "change")
        until(b.page, "document.getElementById('pageinfo').textContent.startsWith('step 10: 16 rollouts')")
        assert not b.page.is_checked("#newest")  # a step picked by hand is no longer followed
        b.page.select_option("#split", "eval")
        until(b.page, "document.getElementById('pageinfo').textContent.startsWith('step 10: 8 rollouts')")
        b.check_clean()
    finally:
        d.stop()


def test_a_live_run_moves_forward(browser, tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", steps=5).root
    d = Dashboard(root)
    try:
        b = Browser(browser, tmp_path)
        b.page.goto(d.url + "/")
        until(b.page, "document.body.innerText.includes('5 / 105')")
        before = _charts_drawn(b.page, 3)
        import random

        rng = random.Random(7)
        with open(root / "metrics.jsonl", "a") as f:
            for s in range(6, 31):
                for rec in metrics_records(s, time.time(), rng):
                    f.write(json.dumps(rec) + "\n")
            f.write('{"role": "trainer", "step": 31, "ti')  # a torn last line, being written
        until(b.page, "document.body.innerText.includes('30 / 105')", 20)
        b.page.wait_for_timeout(500)
        after = b.page.evaluate(COLOURED, ".chart canvas")
        assert after[0] != before[0]  # the reward curve was redrawn with the new steps
        b.check_clean()
    finally:
        d.stop()


def test_runs_compared_logs_searched_config_diffed(browser, shots: Path, tmp_path: Path) -> None:
    a = make_run(tmp_path / "lr-1e-5", steps=60).root
    c = make_run(tmp_path / "lr-3e-5", steps=45, seed=3).root
    d = Dashboard(a, c)
    try:
        b = Browser(browser, shots)
        b.page.goto(d.url + "/metrics?q=reward/")
        until(b.page, "document.querySelectorAll('.chart canvas').length >= 1")
        legend = b.page.locator(".chart .u-legend").first.inner_text()
        assert "lr-1e-5" in legend and "lr-3e-5" in legend  # both runs overlaid
        b.shot("compare")
        b.page.goto(d.url + "/logs?run=0")
        b.page.wait_for_selector(".logs .rec")
        b.page.fill("#search", "no answer")
        b.page.wait_for_selector(".logs .rec mark")
        assert b.page.locator(".logs .rec").count() == 1
        b.page.select_option("#component", "env:calc-tools")
        b.page.fill("#search", "")
        until(b.page, "document.querySelectorAll('.logs .rec .src').length >= 4")  # files merged
        b.page.goto(d.url + "/config")
        b.page.wait_for_selector("table")
        assert "max_steps" in b.page.inner_text("main")
        b.check_clean()
    finally:
        d.stop()


def test_token_refusals_and_path_traversal(browser, tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", steps=3).root
    env = {k: v for k, v in os.environ.items() if k != "HPCRL_DASHBOARD_TOKEN"}
    refused = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "dashboard", str(root), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert refused.returncode == 2 and "needs a token" in refused.stderr and refused.stderr.count("\n") == 1
    d = Dashboard(root, token="t0ken")
    try:
        b = Browser(browser, tmp_path)
        assert b.page.goto(d.url + "/").status == 401
        b.errors.clear()  # the 401 itself is logged by the browser as a failed load
        assert b.page.goto(d.url + "/?token=t0ken").status == 200  # redirected, the token now a cookie
        until(b.page, "document.body.innerText.includes('3 / 103')")
        for raw in (
            "/static/../../../../etc/passwd",
            "/static/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
            "/api/config?name=../../../../etc/passwd",
            "/api/logs?component=../../../../etc/passwd",
        ):
            status, body = _raw_get(d.url, raw, cookie="hpcrl_dashboard=t0ken")
            assert status in (400, 404) and "root:" not in body, (raw, status, body[:200])
        b.check_clean()
    finally:
        d.stop()


def _raw_get(base: str, path: str, cookie: str) -> tuple[int, str]:
    """GET with the path sent byte for byte (an HTTP client would normalise the dots away)."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")
