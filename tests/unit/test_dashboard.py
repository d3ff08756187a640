"""`hpcrl dashboard` without a browser: its readers (torn lines, byte offsets, downsampling, log pages
merged by time), its routes over a synthetic run, and its guard (read-only, paths, token, Host)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from hpcrl.dashboard import logs, series
from hpcrl.dashboard.app import build_app
from hpcrl.dashboard.runs import DashboardError, discover
from hpcrl.dashboard.serve import main as serve_main
from hpcrl.dashboard.tail import JsonlTail, LineIndex
from tests.dashboard_synth import make_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("dash") / "run", steps=40).root


def client(*dirs: Path, token: str | None = None, loopback_only: bool = True) -> TestClient:
    return TestClient(
        build_app(discover([str(d) for d in dirs]), token, loopback_only), base_url="http://127.0.0.1"
    )


# -- readers ---------------------------------------------------------------------------------------
def test_tail_skips_a_torn_line_and_reads_it_whole_later(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_bytes(b'{"a": 1}\nnot json\n{"a": 2}\n{"a": 3')
    t = JsonlTail(f)
    assert [r["a"] for r in t.poll()] == [1, 2]
    with open(f, "ab") as fh:
        fh.write(b'}\n{"a": 4}\n')
    assert [r["a"] for r in t.poll()] == [3, 4]
    assert t.poll() == []
    f.write_bytes(b'{"a": 9}\n')  # replaced by a fresh run: read from the start
    assert [r["a"] for r in t.poll()] == [9] and t.reset


def test_line_index_pages_by_byte_offset(tmp_path: Path) -> None:
    f = tmp_path / "x.jsonl"
    f.write_bytes(b"".join(f"line {i}\n".encode() for i in range(1000)) + b"torn")
    idx = LineIndex(f)
    assert idx.refresh() == 1000
    assert idx.read(500, 3) == [b"line 500", b"line 501", b"line 502"]
    assert idx.read(998, 10) == [b"line 998", b"line 999"]
    with open(f, "ab") as fh:
        fh.write(b" end\nline 1001\n")
    assert idx.refresh() == 1002 and idx.read(1000, 2) == [b"torn end", b"line 1001"]


def test_metrics_store_downsamples_and_keeps_spikes(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    rows = [
        {"role": "trainer", "step": s, "time": 1000.0 + s, "loss": 1.0 if s == 5000 else 0.0}
        for s in range(1, 10001)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"role": "trainer", "st')
    store = series.MetricsStore(f)
    store.refresh()
    assert store.last_step("trainer") == 10000
    (s,) = series.series(store, "loss", "step", 0.0, 300)
    assert len(s["x"]) <= 300 and max(s["hi"]) == 1.0 and max(s["y"]) < 1.0  # the spike survives in the band
    (e,) = series.series(store, "loss", "elapsed", 0.0, 5000)
    assert e["x"][0] == 0.5 and len(e["x"]) == 5000  # bucket means of 2 points, elapsed from the first


def test_resumed_steps_keep_the_newest_value_and_nulls_are_gaps(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    recs = [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, None), (4, 0.4)]  # resumed from step 1
    f.write_text(
        "".join(
            json.dumps({"role": "o", "step": s, "time": i, "r": v}) + "\n" for i, (s, v) in enumerate(recs)
        )
    )
    store = series.MetricsStore(f)
    store.refresh()
    (s,) = series.series(store, "r", "step", 0.0, 100)
    assert s["x"] == [1, 2, 3, 4] and s["y"] == [0.1, 0.25, None, 0.4]


def test_ema_is_debiased() -> None:
    out = series.ema(np.array([1.0, 1.0, float("nan"), 1.0]), 0.9)
    assert out[0] == pytest.approx(1.0) and np.isnan(out[2]) and out[3] == pytest.approx(1.0)


def test_log_pages_merge_files_by_time_and_go_back_by_offset(tmp_path: Path) -> None:
    run = discover([str(make_run(tmp_path / "r", steps=3).root)])[0]
    a = run.paths.env_server_dir("train", "calc-tools") / "server.log"
    b = run.paths.env_server_dir("train", "calc-tools") / "worker_0.log"
    a.write_text("".join(f"10:00:{s:02d} INFO    server {s}\n" for s in range(0, 60, 2)))
    b.write_text("".join(f"10:00:{s:02d} INFO    worker {s}\n  detail {s}\n" for s in range(1, 60, 2)))
    files = logs.components(run)["env:calc-tools"]
    keep = logs.matcher(None, False, None)
    seen: list[dict] = []
    cursor = None
    while True:
        page = logs.page_back(run, files, cursor, keep, 7)
        seen = page["records"] + seen
        cursor = page["cursor"]
        if not page["more"]:
            break
    ours = [
        r["t"] - 36000
        for r in seen
        if r["source"] in ("envs/train/calc-tools/server.log", "envs/train/calc-tools/worker_0.log")
    ]
    assert ours == list(range(60))  # every record once, in time order, across pages
    assert len(seen) == 60 + 4  # and the env's other files (eval server and worker, two env logs)
    detail = logs.page_back(run, [b], None, logs.matcher("detail 59", False, None), 5)["records"]
    assert detail[0]["text"] == "10:00:59 INFO    worker 59\n  detail 59"  # the record with its continuation


def test_log_follow_reads_appended_records(synth: Path) -> None:
    c = client(synth)
    first = c.get("/api/logs", params={"component": "orchestrator", "limit": 5}).json()
    assert len(first["records"]) == 5
    log = synth / "logs" / "orchestrator.log"
    with open(log, "a") as f:
        f.write("11:00:00 WARNING [orchestrator] appended now\n11:00:01 INFO    half")  # the last is torn
    new = c.get("/api/logs", params={"component": "orchestrator", "after": json.dumps(first["after"])}).json()
    assert [r["text"] for r in new["records"]] == ["11:00:00 WARNING [orchestrator] appended now"]


# -- routes ----------------------------------------------------------------------------------------
def test_overview_metrics_config_rollouts(synth: Path, tmp_path: Path) -> None:
    other = make_run(tmp_path / "other", steps=5, seed=1).root
    c = client(synth, other)
    ov = c.get("/api/overview").json()["runs"]
    assert [o["step"] for o in ov] == [40, 5] and ov[0]["job"]["state"] == "running"
    assert ov[0]["max_steps"] == 140 and ov[0]["eta_s"] == pytest.approx(100 * 5.0, rel=0.05)
    assert {r["role"] for r in ov[0]["roles"]} == {"orchestrator", "trainer_0"}
    assert ov[0]["causes"][0]["count"] == 3 and any("no answer" in p["text"] for p in ov[0]["problems"])
    names = c.get("/api/metric_names").json()["names"]
    assert "reward/calc-tools/correct/mean" in names and "eval/calc-tools/avg@4" in names
    s = c.get("/api/series", params={"name": ["reward/all/mean"], "runs": "0,1"}).json()["series"]
    assert [x["run"] for x in s["reward/all/mean"]] == [0, 1]
    diff = {r["key"]: r["values"] for r in c.get("/api/config_diff").json()["rows"]}
    assert diff["max_steps"] == ["140", "105"]
    assert "lr = 1e-5" in c.get("/api/config", params={"name": "resolved"}).json()["text"]
    steps = c.get("/api/rollout_steps").json()
    assert steps["newest"] == 40
    g = c.get("/api/rollout_groups", params={"step": 40, "split": "train", "size": 3}).json()
    assert g["rollouts"] == 16 and g["groups_total"] == 4 and g["pages"] == 2 and len(g["groups"]) == 3
    tools = next(x for x in g["groups"] if x["env"] == "calc-tools")
    recs = c.get(
        "/api/rollout_records", params={"step": 40, "rows": ",".join(str(r["row"]) for r in tools["rows"])}
    ).json()["records"]
    assert [r["group"]["index"] for r in recs] == [0, 1, 2, 3]
    assert [m["role"] for m in recs[0]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]


def test_pages_and_static_are_served(synth: Path) -> None:
    c = client(synth)
    for path in ("/", "/metrics", "/rollouts", "/logs", "/config"):
        r = c.get(path)
        assert r.status_code == 200 and "default-src 'none'" in r.headers["content-security-policy"]
        assert "uPlot.iife.min.js" in r.text
    assert (
        c.get("/static/vendor/uplot/uPlot.iife.min.js").headers["content-type"].startswith("text/javascript")
    )
    assert "uplot 1.6.32" in c.get("/static/vendor/uplot/VERSION").text


# -- the guard -------------------------------------------------------------------------------------
TRAVERSALS = [
    "/static/../../../../etc/passwd",
    "/static/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/static/..%2f..%2f..%2fetc%2fpasswd",
    "/static//etc/passwd",
    "/api/logs?component=../../../../etc/passwd",
    "/api/logs?component=env:../../../../etc",
    "/api/config?name=../../../../etc/passwd",
    "/api/config?name=/etc/passwd",
    "/api/rollout_groups?step=1&split=../../../../etc",
    "/api/rollout_records?step=1&split=../../../etc&rows=0",
    '/api/logs?component=orchestrator&cursor={"../../../../etc/passwd":4096}',
    '/api/logs?component=orchestrator&after={"/etc/passwd":0}',
    "/api/overview?runs=../../etc",
]


@pytest.mark.parametrize("url", TRAVERSALS)
def test_path_traversal_is_refused(synth: Path, url: str) -> None:
    r = client(synth).get(url)
    assert "root:" not in r.text  # /etc/passwd's first line
    assert r.status_code in (200, 400, 404)


def test_a_symlink_out_of_the_run_is_not_served(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", steps=3).root
    (root / "logs" / "launcher.log").symlink_to("/etc/passwd")
    (root / "configs" / "evil.toml").symlink_to("/etc/passwd")
    c = client(root)
    assert "launcher" not in [x["name"] for x in c.get("/api/log_components").json()["components"]]
    assert c.get("/api/logs", params={"component": "launcher"}).status_code == 404
    assert c.get("/api/config", params={"name": "evil"}).status_code == 404


def test_read_only(synth: Path) -> None:
    c = client(synth)
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert c.request(method, "/api/runs").status_code == 405


def test_loopback_only_host_header(synth: Path) -> None:
    c = client(synth)
    assert c.get("/api/runs", headers={"Host": "evil.example:8765"}).status_code == 403
    assert c.get("/api/runs", headers={"Host": "localhost:8765"}).status_code == 200


def test_token_bearer_or_cookie(synth: Path) -> None:
    c = client(synth, token="s3cret", loopback_only=False)
    assert c.get("/api/runs").status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = c.get("/?token=s3cret&runs=0", follow_redirects=False)
    assert (
        r.status_code == 303 and r.headers["location"] == "/?runs=0" and "HttpOnly" in r.headers["set-cookie"]
    )
    assert c.get("/api/runs").status_code == 200  # the cookie now


def test_non_loopback_bind_needs_a_token(synth: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCRL_DASHBOARD_TOKEN", raising=False)
    with pytest.raises(DashboardError, match="not a loopback address"):
        serve_main([str(synth), "--host", "0.0.0.0"])
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "dashboard", str(synth), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "HPCRL_DASHBOARD_TOKEN" in out.stderr


def test_discover_names_and_folders(tmp_path: Path) -> None:
    for name in ("a", "b"):
        make_run(tmp_path / "outputs" / name, steps=2)
    runs = discover([str(tmp_path / "outputs")])
    assert [r.name for r in runs] == ["a", "b"]
    with pytest.raises(DashboardError):
        discover([str(tmp_path / "missing")])


def test_static_files_ship_in_the_wheel() -> None:
    import tomllib

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "hpcrl.dashboard"
    ]
    static = REPO / "hpcrl" / "dashboard"
    shipped = {p for pat in patterns for p in static.glob(pat) if p.is_file()}
    assert {
        p for p in (static / "static").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    } <= shipped
