"""A role's stdout/stderr on a disk that refuses writes (hpcrl.storage.tolerate_std_streams): what
anything writes there (a progress bar while a model loads, a print, an error line) is dropped and
counted, never raised; other errors (a closed pipe) still raise, and short commands still fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.storage import _TolerantStd, dropped_log_lines, raw_stream

REPO = Path(__file__).resolve().parents[2]
FULL = Path("/dev/full")  # every write(2) fails with ENOSPC, as on a full disk

pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")


def test_a_refused_write_is_dropped_and_counted_with_its_cause() -> None:
    before, _ = dropped_log_lines()
    fh = FULL.open("w", buffering=1)
    try:
        out = _TolerantStd(fh)
        assert out.write("one\ntwo\n") == 8  # as if written: the caller goes on
        out.writelines(["three\n"])
        out.flush()
        n, why = dropped_log_lines()
        assert n - before == 3
        assert why == "disk full at /dev/full (No space left on device)"
        assert raw_stream(out) is fh and out.fileno() == fh.fileno()  # the rest is the stream's own
    finally:
        try:
            fh.close()  # its buffer still holds what was refused: closing tries once more
        except OSError:
            pass


def test_a_progress_bars_redraws_are_not_lines_and_the_wrapper_behaves_as_a_stream(tmp_path: Path) -> None:
    import copy

    before, _ = dropped_log_lines()
    fh = FULL.open("w", buffering=1)
    try:
        out = _TolerantStd(fh)
        for pct in (10, 50, 100):
            out.write(f"\rLoading weights: {pct}%")  # tqdm redraws in place
        assert dropped_log_lines()[0] == before
        out.write("\n")
        assert dropped_log_lines()[0] == before + 1  # the bar, once, as one line
        assert copy.copy(out).hpcrl_raw is fh  # no recursion through __getattr__
    finally:
        try:
            fh.close()
        except OSError:
            pass
    with _TolerantStd((tmp_path / "f").open("w")) as w:
        w.write("x\n")
    assert w.closed and (tmp_path / "f").read_text() == "x\n"


def test_a_closed_pipe_still_raises() -> None:
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w", buffering=1) as fh:
        with pytest.raises(BrokenPipeError):
            _TolerantStd(fh).write("x\n")
        try:
            fh.close()
        except BrokenPipeError:
            pass


CHILD = """
import sys
from hpcrl.storage import dropped_log_lines, tolerate_std_streams
tolerate_std_streams()
for i in range(50):
    print("line", i)
sys.stderr.write("Loading weights: 100%|##########| 24/24\\n")
open(sys.argv[1], "w").write(str(dropped_log_lines()[0]))
"""


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with FULL.open("w") as out:
        return subprocess.run(args, stdout=out, stderr=out, env=env, cwd=tmp, timeout=120)


def test_a_process_whose_output_is_refused_finishes_normally(tmp_path: Path) -> None:
    res = _run([sys.executable, "-c", CHILD, str(tmp_path / "n")], tmp_path)
    assert res.returncode == 0  # without the wrapper: exit 1 (OSError) at its first line of stderr
    assert int((tmp_path / "n").read_text()) >= 1  # stdout is block-buffered: counted as it flushes


@pytest.mark.parametrize("args", [["--version"], ["status", "."], ["run", "--help"]])
def test_output_asked_for_still_fails_when_it_is_refused(tmp_path: Path, args: list[str]) -> None:
    res = _run([sys.executable, "-m", "hpcrl.cli", *args], tmp_path)
    assert res.returncode != 0  # what the user asked for was not written: not a success


def test_the_lost_lines_note_goes_through_the_roles_format(tmp_path: Path) -> None:
    """A role's handler formats `[%(role)s]`, set by its filter: the note it writes once the log
    takes lines again went around the filter and failed with a traceback into the log (KeyError)."""
    import logging

    from hpcrl.monitor.logging import _FMT, _RoleFilter
    from hpcrl.storage import TolerantStreamHandler

    fh = FULL.open("w", buffering=1)
    h = TolerantStreamHandler(fh)
    h.setFormatter(logging.Formatter(_FMT, datefmt="%H:%M:%S"))
    h.addFilter(_RoleFilter("inference"))
    log = logging.getLogger("hpcrl.test_tolerant_note")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(h)
    try:
        log.info("refused one")
        log.info("refused two")
        assert h.lost == 2
        good = (tmp_path / "log").open("w", buffering=1)
        h.stream = good  # the disk takes lines again
        log.info("through")
        good.close()
    finally:
        log.removeHandler(h)
        try:
            fh.close()
        except OSError:
            pass
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 2, lines  # no "--- Logging error ---" traceback
    assert lines[0].endswith(
        "WARNING [inference] 2 log line(s) lost: disk full at /dev/full (No space left on device)"
    )
    assert lines[1].endswith("INFO    [inference] through")
