"""The run-directory argument every run-inspecting command takes (status, logs, components, cancel)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcrl.paths import RunPaths


def _run_dir(args: argparse.Namespace) -> RunPaths:
    d = Path(args.output_dir)
    if not (d / "configs").is_dir():
        print(f"hpcrl: error: {d} is not an hpcrl run directory (no configs/)", file=sys.stderr)
        raise SystemExit(2)
    return RunPaths(d)


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"hpcrl {prog}")
    p.add_argument("output_dir", nargs="?", default=None, help="run directory")
    p.add_argument("--output-dir", dest="output_dir_flag", default=None, help="run directory")
    return p


def _parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = p.parse_args(argv)
    args.output_dir = args.output_dir_flag or args.output_dir
    if args.output_dir is None:
        p.error("give the run directory (positional or --output-dir)")
    return args
