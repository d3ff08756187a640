"""scripts/bench/launch_cpu.py: which process is which role, sums per role, the side-by-side table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "launch_cpu.py"
_spec = importlib.util.spec_from_file_location("bench_launch_cpu", _PATH)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

PY = "/venv/bin/python -m "


def test_roles_from_command_lines() -> None:
    assert lc.role_of(PY + "hpcrl.cli run cfg.toml", True) == "launcher"
    assert lc.role_of(PY + "hpcrl.cli inference @ x/configs/inference.toml --run-dir x", False) == "inference"
    assert lc.role_of(PY + "hpcrl.cli trainer @ x/configs/trainer.toml", False) == "trainer"
    assert lc.role_of(PY + "hpcrl.cli orchestrator @ x.toml", False) == "orchestrator"
    assert lc.role_of(PY + 'hpcrl.envs.runtime.server {"env_id": "reverse-text"}', False) == "env server"
    assert (
        lc.role_of(PY + 'hpcrl.envs.runtime.worker {"env_id": "x"} tcp://127.0.0.1:1 0', False)
        == "env worker"
    )
    assert lc.role_of("", False) == "other"  # an exited process's command line is empty


def test_by_role_sums_each_processes_last_cpu() -> None:
    got = lc.by_role({10: ("trainer", 2.5), 11: ("trainer", 1.0), 12: ("inference", 4.0)})
    assert got["trainer"] == 3.5 and got["inference"] == 4.0 and got["launcher"] == 0.0
    assert list(got) == list(lc.ROLES)


def test_table_has_medians_and_new_over_base() -> None:
    def run(wall: float, total: float, trainer: float) -> tuple[float, float, dict[str, float]]:
        return wall, total, {**dict.fromkeys(lc.ROLES, 0.0), "trainer": trainer}

    text = lc.table(
        {
            "base": [run(10, 20, 4), run(12, 18, 5), run(11, 30, 6)],  # medians 11, 20, 5
            "new": [run(9, 15, 4), run(8, 16, 4), run(10, 14, 3)],  # medians 9, 15, 4
        }
    )
    rows = {line[:22].strip(): line.split()[-3:] for line in text.splitlines()[1:]}
    assert rows["wall s"] == ["11.00", "9.00", "0.82"]
    assert rows["CPU-s, total (exact)"] == ["20.00", "15.00", "0.75"]
    assert rows["trainer"] == ["5.00", "4.00", "0.80"]
    assert rows["launcher"] == ["0.00", "0.00", "-"]  # nothing to divide by
