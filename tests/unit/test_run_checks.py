"""`hpcrl run --dry-run` checks what seed 001's launch lines promise: `--ckpt.resume-step N` needs
checkpoint N on disk (as `hpcrl resume --dry-run` does), and a [slurm] section is said to be unused."""

from __future__ import annotations

from pathlib import Path

from hpcrl.cli import main
from tests.conftest import rl_toml


def _cfg(tmp_path: Path, extra: str = "") -> str:
    p = tmp_path / "rl.toml"
    p.write_text(rl_toml(20) + extra)
    return str(p)


def test_resume_step_without_a_checkpoint_is_refused_in_the_dry_run(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", _cfg(tmp_path), "--ckpt.resume-step", "10", "--dry-run", "--output-dir", str(out)])
    _, err = capsys.readouterr()
    assert rc != 0 and err.count("\n") == 1 and "step_10" in err, err


def test_slurm_section_is_said_to_run_locally(tmp_path, capsys):
    rc = main(
        [
            "run",
            _cfg(tmp_path, "[slurm]\npartition = 'gpu'\n"),
            "--dry-run",
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    out, _ = capsys.readouterr()
    assert rc == 0
    assert (
        "note:         [slurm] is set, but `hpcrl run` runs on this machine; `hpcrl submit` submits it" in out
    )


def test_no_note_without_slurm(tmp_path, capsys):
    assert main(["run", _cfg(tmp_path), "--dry-run", "--output-dir", str(tmp_path / "o")]) == 0
    assert "[slurm]" not in capsys.readouterr().out
