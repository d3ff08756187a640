"""Dry-run every TOML config of a prime-rl checkout through the hpcrl command that matches prime-rl's.

    python scripts/prime_rl_configs.py /path/to/prime-rl            # configs/, examples/, k8s/
    python scripts/prime_rl_configs.py /path/to/prime-rl -v         # every file's last line

prime-rl's command for a file is read from its shape (as prime-rl's own docs run them): a `[data]`
table is `sft`; k8s's split role files `train.toml` / `orch.toml` / `infer.toml` (and
`infer/*.toml`) are `trainer` / `orchestrator` / `inference`; examples/evals/ is `evals`; the rest is
`rl`. Each maps to hpcrl's (`rl` -> `hpcrl run`, `sft`, `trainer`, `orchestrator`, `inference`,
`evals` -> `hpcrl eval`), run in this process with `--dry-run` and a scratch `--output-dir`. The
table counts what passes, what stops on an environment package not installed here, what is
refused as prime-rl refuses it too ("refused (correct)": CORRECT_REFUSALS, with the reason), and
what else is refused (with the first line of the refusal). Set HF_HUB_OFFLINE=1 / HF_HOME to a cache of tiny
stand-ins to check models too (docs/prime-rl.md).

A measurement, not a test: tests/integration/test_prime_rl_shapes.py holds hpcrl's own prime-rl-shaped
configs of every kind and runs in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FOLDERS = ("configs", "examples", "k8s")
ROLE_FILES = {"train.toml": "trainer", "orch.toml": "orchestrator", "infer.toml": "inference"}


def prime_command(path: Path, root: Path) -> str:
    """prime-rl's command for one of its config files (see the module doc)."""
    import tomllib

    rel = path.relative_to(root).as_posix()
    if rel.startswith("k8s/") and path.name in ROLE_FILES:
        return ROLE_FILES[path.name]
    if path.parent.name == "infer":
        return "inference"
    if rel.startswith("examples/evals/"):
        return "evals"
    if path.parent.name == "fake" and path.stem == "rl":
        return (
            "trainer"  # the trainer alone on fake batches (prime-rl: `trainer @ configs/debug/fake/rl.toml`)
        )
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return "rl"
    sft_named = "sft" in path.stem and "orchestrator" not in data  # slim_sft.toml: SFT without [data]
    return "sft" if isinstance(data.get("data"), dict) or sft_named else "rl"


HPCRL_COMMAND = {"rl": "run", "evals": "eval"}


def dry_run(command: str, path: Path, out: Path) -> tuple[int, str]:
    """(exit code, everything printed) of `hpcrl <command> @ path --dry-run --output-dir out`."""
    from hpcrl.cli import main

    argv = [HPCRL_COMMAND.get(command, command), "@", str(path), "--dry-run"]
    if command in ("rl", "sft"):
        argv += ["--output-dir", str(out)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse-style exits
            rc = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001 - a traceback is a bug: counted, not fatal to the table
            rc = 99
            print(f"TRACEBACK {type(e).__name__}: {e}")
    return rc, buf.getvalue()


# Refusals prime-rl makes too (the file cannot run there either): (what hpcrl says, why it is right)
CORRECT_REFUSALS = (
    (
        "at least one training environment is required",
        "prime-rl too: 'TrainSource needs at least one train env' at start (orchestrator/train_source.py)",
    ),
    (
        "is not usable: no COMPLETE manifest",
        "a resume config without its checkpoint: prime-rl's ckpt.py raises 'Checkpoint not found' too",
    ),
)


def verdict(rc: int, text: str) -> tuple[str, str]:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
    if rc == 0:
        return "pass", lines[-1] if lines else ""
    if rc == 99:
        return "TRACEBACK", last
    if "not installed" in text or "No module named" in text or "pip install" in text:
        return "env missing", last
    for said, why in CORRECT_REFUSALS:
        if said in text:
            return "refused (correct)", f"{why}: {last}"
    return "refused", last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prime_rl", type=Path, help="a prime-rl checkout (or its configs/examples/k8s)")
    ap.add_argument("-v", "--verbose", action="store_true", help="every file's line, passes too")
    args = ap.parse_args()
    root = args.prime_rl.resolve()
    files = sorted(p for f in FOLDERS for p in (root / f).rglob("*.toml"))
    if not files:
        print(f"no TOML files under {root}/{{{','.join(FOLDERS)}}}")
        return 2
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(files):
            command = prime_command(path, root)
            rc, text = dry_run(command, path, Path(tmp) / f"run{i}")
            kind, line = verdict(rc, text)
            counts[kind] = counts.get(kind, 0) + 1
            if args.verbose or kind != "pass":
                rel = path.relative_to(root)
                print(f"{kind:17s} {command:12s} {rel}\n{'':30s} {line[:200]}")
    total = len(files)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f"  (of {total})")
    return 0 if counts.get("TRACEBACK", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
