"""`hpcrl plot`: panels carry the logged data, PNGs are valid and not blank, missing data is fine."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.monitor.metrics import Metrics
from hpcrl.monitor.plots import main, panels, write_plots
from hpcrl.paths import RunPaths

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PANELS = ["reward", "loss", "entropy", "mismatch_kl", "throughput", "policy_lag"]


def _fake_run(paths: RunPaths, steps: int = 6) -> None:
    tr, orch = Metrics(paths, "trainer"), Metrics(paths, "orchestrator")
    for s in range(1, steps + 1):
        orch.log(
            s,
            {
                "reward/all/mean": 0.1 * s,
                "reward/rev/mean": 0.1 * s,
                "reward/sort/mean": 0.05 * s,
                "off_policy/mean": 1.0 if s > 1 else float("nan"),
                "perf/samples_per_s": 10.0 + s,
            },
        )
        tr.log(
            s,
            {
                "loss/mean": 1.0 / s,
                "entropy/mean": 2.0 - 0.1 * s,
                "mismatch_kl/mean": 0.001 * s,
                "perf/throughput": 1000.0 * s,
            },
        )
    orch.log(3, {"eval/rev/avg@4": 0.5, "eval/rev/pass@4": 1.0})
    orch.log(6, {"eval/rev/avg@4": 0.7, "eval/rev/pass@4": 1.0})
    tr.log(6, {"loss/mean": 0.123})  # a resumed run redoes step 6: the later value wins
    tr.close()
    orch.close()


def _image(path: Path):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    return mpimg.imread(path)


def test_panels_hold_the_logged_series(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    _fake_run(paths)
    from hpcrl.monitor.metrics import read_metrics

    by_name = {p.name: p for p in panels(read_metrics(paths.metrics_file))}
    assert list(by_name) == PANELS and all(p.has_data for p in by_name.values())
    reward = {s.label: s for s in by_name["reward"].series}
    assert reward["train reward/all/mean"].steps == [1, 2, 3, 4, 5, 6]
    assert reward["train reward/all/mean"].values == pytest.approx([0.1 * s for s in range(1, 7)])
    assert "reward/rev/mean" in reward and "reward/sort/mean" in reward
    assert reward["eval rev/avg@4"].steps == [3, 6] and reward["eval rev/avg@4"].values == [0.5, 0.7]
    assert by_name["loss"].series[0].values[-1] == 0.123
    assert by_name["policy_lag"].series[0].steps == [2, 3, 4, 5, 6]  # NaN (null) points are skipped
    axes = {s.label: s.axis for s in by_name["throughput"].series}
    assert axes == {"trainer perf/throughput (tok/s)": 0, "orchestrator perf/samples_per_s": 1}


def test_write_plots_valid_pngs_with_content(run_dir: Path) -> None:
    np = pytest.importorskip("numpy")
    paths = RunPaths(run_dir)
    _fake_run(paths)
    files = write_plots(paths)
    assert [f.name for f in files] == [f"{p}.png" for p in PANELS]
    assert all(f.parent == paths.plots_dir for f in files)
    for f in files:
        img = _image(f)
        assert img.shape[0] > 100 and img.shape[1] > 100
        rgb = (img[..., :3] * 255).astype(np.uint32)
        colors = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])
        assert colors.size > 20, f  # lines, text and antialiasing: not a blank canvas
    assert not list(paths.plots_dir.glob("*.tmp*"))


def test_missing_metrics_say_no_data(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    m = Metrics(paths, "trainer")
    m.log(1, {"loss/mean": 0.5})
    m.close()
    with open(paths.metrics_file, "ab") as f:
        f.write(b'{"role":"trainer","step":2,"loss')  # torn tail
    files = write_plots(paths)
    by_name = {p.name: p for p in panels([{"role": "trainer", "step": 1, "loss/mean": 0.5}])}
    assert by_name["loss"].has_data and not by_name["reward"].has_data and not by_name["throughput"].has_data
    assert len(files) == len(PANELS) and all(f.read_bytes()[:8] == PNG_MAGIC for f in files)
    assert panels([]) and not any(p.has_data for p in panels([]))


def test_cli_main(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = RunPaths(run_dir)
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"hpcrl plot: {tmp_path / 'nope' / 'metrics.jsonl'} does not exist (is {tmp_path / 'nope'} a run directory?)\n"
    )
    _fake_run(paths, steps=2)
    out_dir = tmp_path / "elsewhere"
    assert main([str(run_dir), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert str(out_dir) in out and "reward.png" in out and (out_dir / "loss.png").is_file()


def test_help_is_fast_and_lazy() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from hpcrl.cli import main\n"
        "try: main(['plot', '--help'])\nexcept SystemExit: pass\n"
        "assert 'matplotlib' not in sys.modules and 'wandb' not in sys.modules, 'heavy import'\n"
        "print(time.perf_counter() - t)"
    )
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "OUTPUT_DIR" in r.stdout
    assert float(r.stdout.strip().splitlines()[-1]) < 3.0 and time.perf_counter() - t0 < 15
