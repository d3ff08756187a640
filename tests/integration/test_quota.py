"""The quota the fault matrix makes (tests/integration/quota.py, edquot.c): EDQUOT from libc's own
calls in a real process while the control file lists a directory, nothing otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env
from tests.integration.quota import Quota, quota_env, quota_unavailable

PROBE = """
import errno, os, sys
d = sys.argv[1]
def try_(what, f):
    try:
        f()
        print(what, "ok")
    except OSError as e:
        print(what, errno.errorcode[e.errno])
fd = os.open(os.path.join(d, "old"), os.O_WRONLY)
try_("create", lambda: open(os.path.join(d, "new"), "wb"))
try_("mkdir", lambda: os.mkdir(os.path.join(d, "sub")))
try_("open existing", lambda: os.close(os.open(os.path.join(d, "old"), os.O_WRONLY | os.O_CREAT)))
try_("write", lambda: os.write(fd, b"x"))
try_("elsewhere", lambda: open(os.path.join(sys.argv[2], "f"), "wb").close())
"""


def test_the_quota_refuses_new_entries_and_writes_under_its_dirs_only(tmp_path: Path) -> None:
    if quota_unavailable():
        pytest.skip(f"no quota can be made here: {quota_unavailable()}")
    env = quota_env(tmp_path)
    assert env is not None
    quota, other = tmp_path / "quota", tmp_path / "other"
    quota.mkdir()
    other.mkdir()
    (quota / "old").write_bytes(b"")

    def probe() -> dict[str, str]:
        cmd = [sys.executable, "-c", PROBE, str(quota), str(other)]
        res = subprocess.run(cmd, env=child_env(**env), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())

    with Quota(env, quota):
        got = probe()
    want = {"create": "EDQUOT", "mkdir": "EDQUOT", "open existing": "ok", "write": "EDQUOT"}
    assert got == {**want, "elsewhere": "ok"}, got
    assert set(probe().values()) == {"ok"}  # cleared: nothing refused
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import safetensors.numpy as s, sys; s.save_file({}, sys.argv[1])",
            str(quota / "t"),
        ],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    with Quota(env, quota):
        res = subprocess.run(
            [
                sys.executable,
                "-c",
                "import safetensors.numpy as s, sys; s.save_file({}, sys.argv[1])",
                str(quota / "u"),
            ],
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert "Disk quota exceeded (os error 122)" in res.stderr, res.stderr  # Rust's std::fs, through libc
