"""The launcher's last line quotes the failed process's own ERROR line, never one that an earlier
process left in the same log (a resumed run appends to it)."""

from __future__ import annotations

from pathlib import Path

from hpcrl.launch.logrecords import last_error


def test_last_error_reads_only_what_the_process_wrote(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text(
        "04:32:47 ERROR   [trainer] trainer failed: disk full at /c/step_65 (No space left on device)\n"
    )
    since = log.stat().st_size  # a resumed trainer starts here, and is then killed by a signal
    with open(log, "a") as f:
        f.write("04:33:16 INFO    [trainer] resumed trainer state from /c/step_60\n")
    assert last_error(log, since=since) == ""
    assert last_error(log) == "trainer failed: disk full at /c/step_65 (No space left on device)"
    with open(log, "a") as f:
        f.write("04:34:00 ERROR   [trainer] trainer failed: BusTimeout: no batch 70\n")
    assert last_error(log, since=since) == "trainer failed: BusTimeout: no batch 70"


def test_a_role_with_brackets_of_its_own_is_stripped(tmp_path: Path) -> None:
    log = tmp_path / "rank_0.log"
    log.write_text("10:00:01 ERROR   [sft[0]] sft trainer failed: cannot write checkpoint step 2\n")
    assert last_error(log) == "sft trainer failed: cannot write checkpoint step 2"
