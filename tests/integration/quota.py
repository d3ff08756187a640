"""A disk quota that runs out (EDQUOT), made for real processes on a kernel without quota support.

This machine's kernel has no CONFIG_QUOTA (a tmpfs with `usrquota` and an ext4 image with `-O quota`
are refused at mount), and root ignores block quotas anyway. So tests/integration/edquot.c, compiled
here with gcc, is preloaded (LD_PRELOAD) into every process of the run under test: while the control
file exists, libc's calls that would allocate space or an inode under the directories it lists fail
with errno EDQUOT, returned to hpcrl's own write calls (Python's FileIO and os.write, safetensors'
Rust std::fs), as a quota'd Lustre returns it. Every process of the run sees the same quota, as all
of a user's processes do. Nothing is patched in Python.

    env = quota_env(tmp_path)            # None: why in quota_unavailable()
    subprocess.Popen(cmd, env={**os.environ, **env})
    with Quota(env, run_dir / "checkpoints"): ...   # over quota inside the block
    with Quota(env, run_dir / "logs", errno="EROFS"): ...   # read-only inside the block

Another errno than EDQUOT (`errno=`: ENOSPC, EROFS, EIO, EPERM, EACCES) makes the same calls fail with
it; EROFS also refuses opening an existing file for writing, rename, unlink and rmdir, as a
read-only filesystem does (one whose files are open for writing cannot be remounted `ro`: EBUSY).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("edquot.c")
CTL = "HPCRL_EDQUOT_CTL"
_why: list[str] = []


def _shim() -> Path | None:
    """The compiled shim (cached by the source's hash), or None (why in quota_unavailable())."""
    if _why:
        return None
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        _why.append("no C compiler (gcc) to build the EDQUOT shim")
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("HPCRL_CACHE") or tempfile.gettempdir()) / "edquot"
    so = cache / f"edquot-{digest}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-Wno-format-truncation", "-o", str(tmp), str(SOURCE), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            _why.append(f"the EDQUOT shim did not build: {(res.stderr or res.stdout).strip()[:300]}")
            return None
        tmp.replace(so)
    return so


def quota_unavailable() -> str | None:
    """Why a quota cannot be made here (a skip reason), or None."""
    so = _shim()
    if so is None:
        return _why[0]
    probe = Path(tempfile.mkdtemp(prefix="edquot-probe-"))
    try:
        ctl = probe / "ctl"
        ctl.write_text(str(probe / "q"))
        (probe / "q").mkdir()
        res = subprocess.run(
            ["python3", "-c", f"open({str(probe / 'q' / 'f')!r}, 'wb')"],
            env={**os.environ, "LD_PRELOAD": str(so), CTL: str(ctl)},
            capture_output=True,
            text=True,
        )
        if "Disk quota exceeded" not in res.stderr:
            _why.append(
                f"the EDQUOT shim does not take effect here (LD_PRELOAD): {res.stderr.strip()[-300:]}"
            )
            return _why[0]
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def quota_env(where: Path) -> dict[str, str] | None:
    """The environment that puts a run's processes under the quota controlled from `where` (its
    control file, absent: under quota), or None where it cannot be made (quota_unavailable())."""
    if quota_unavailable() is not None:
        return None
    preload = " ".join(x for x in (str(_shim()), os.environ.get("LD_PRELOAD", "")) if x)
    return {"LD_PRELOAD": preload, CTL: str(where / "edquot.ctl")}


ERRNOS = ("EDQUOT", "ENOSPC", "EROFS", "EIO", "EPERM", "EACCES")  # what edquot.c can return


class Quota:
    """`dirs` over quota from start() (or entering the block) until stop(): every process started
    with `env` gets EDQUOT (or `errno`, one of ERRNOS) creating or writing anything under them."""

    def __init__(self, env: dict[str, str], *dirs: Path, errno: str = "EDQUOT"):
        assert errno in ERRNOS, errno
        self.ctl, self.dirs, self.errno = Path(env[CTL]), [str(d) for d in dirs], errno

    def start(self) -> Quota:
        tmp = self.ctl.with_suffix(".tmp")
        prefix = "" if self.errno == "EDQUOT" else f"{self.errno} "  # edquot.c: `[ERRNAME ]/dir`
        tmp.write_text("".join(f"{prefix}{d}\n" for d in self.dirs))
        tmp.replace(self.ctl)  # every process sees the whole list or nothing
        return self

    def stop(self) -> None:
        self.ctl.unlink(missing_ok=True)

    def __enter__(self) -> Quota:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
