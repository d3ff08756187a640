"""The quota the fault matrix makes (tests/integration/quota.py, edquot.c): EDQUOT from libc's own
calls in a real process while the control file lists a directory, nothing otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env
from tests.integration.quota import Quota, quota_env, quota_unavailable

TRY = """
import errno, os, sys
def try_(what, f):
    try:
        f()
        print(what, "ok")
    except OSError as e:
        print(what, errno.errorcode[e.errno])
"""  # each probe's calls, one line each: the call, then ok or its errno's name

PROBE = (
    TRY
    + """
d = sys.argv[1]
fd = os.open(os.path.join(d, "old"), os.O_WRONLY)
try_("create", lambda: open(os.path.join(d, "new"), "wb"))
try_("mkdir", lambda: os.mkdir(os.path.join(d, "sub")))
try_("open existing", lambda: os.close(os.open(os.path.join(d, "old"), os.O_WRONLY | os.O_CREAT)))
try_("write", lambda: os.write(fd, b"x"))
try_("elsewhere", lambda: open(os.path.join(sys.argv[2], "f"), "wb").close())
"""
)


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


ERRNO_PROBE = (
    TRY
    + """
d, ctl, lines = sys.argv[1], sys.argv[2], sys.argv[3]
fd = os.open(os.path.join(d, "old"), os.O_WRONLY | os.O_APPEND)  # open before: a log held open
with open(ctl + ".tmp", "w") as f:  # the refusal starts now
    f.write(lines)
os.replace(ctl + ".tmp", ctl)
try_("create", lambda: open(os.path.join(d, "new"), "wb"))
try_("mkdir", lambda: os.mkdir(os.path.join(d, "sub")))
try_("open append", lambda: os.close(os.open(os.path.join(d, "old"), os.O_WRONLY | os.O_APPEND)))
try_("open read", lambda: os.close(os.open(os.path.join(d, "old"), os.O_RDONLY)))
try_("write", lambda: os.write(fd, b"x"))
try_("rename", lambda: os.replace(os.path.join(d, "a"), os.path.join(d, "b")))
try_("unlink", lambda: os.unlink(os.path.join(d, "c")))
os.unlink(ctl)
"""
)


@pytest.mark.parametrize(("errno", "existing"), [("ENOSPC", "ok"), ("EIO", "ok"), ("EROFS", "EROFS")])
def test_a_control_line_names_its_errno_and_erofs_refuses_what_a_read_only_fs_does(
    tmp_path: Path, errno: str, existing: str
) -> None:
    """`ERRNAME /dir` in the control file (Quota(errno=...)): the same calls fail with that errno;
    EROFS also refuses opening an existing file for writing, a write on a file opened before, rename
    and unlink, as a filesystem remounted `ro` does. A directory listed beside it keeps EDQUOT."""
    if quota_unavailable():
        pytest.skip(f"no quota can be made here: {quota_unavailable()}")
    env = quota_env(tmp_path)
    assert env is not None
    d, other = tmp_path / "d", tmp_path / "other"
    q = Quota(env, d, errno=errno)
    lines = f"{other}\n{errno} {d}\n"  # what Quota(env, other) and Quota(env, d, errno=...) write
    assert q.start().ctl.read_text() == f"{errno} {d}\n"
    q.stop()

    def probe(where: Path) -> dict[str, str]:
        where.mkdir(exist_ok=True)
        for name in ("old", "a", "c"):
            (where / name).write_bytes(b"")
        cmd = [sys.executable, "-c", ERRNO_PROBE, str(where), env["HPCRL_EDQUOT_CTL"], lines]
        res = subprocess.run(cmd, env=child_env(**env), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())

    want = {"create": errno, "mkdir": errno, "write": errno, "open read": "ok"}
    want.update({"open append": existing, "rename": existing, "unlink": existing})
    assert probe(d) == want
    beside = {"create": "EDQUOT", "mkdir": "EDQUOT", "write": "EDQUOT", "open read": "ok"}
    assert probe(other) == {**beside, "open append": "ok", "rename": "ok", "unlink": "ok"}
