"""The `bxctl` command."""

from __future__ import annotations

import argparse
import sys

from loopd import __version__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bxctl", description="The terminal client of loopd.")
    p.add_argument("--version", action="version", version=f"bxctl {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    parser().parse_args(sys.argv[1:] if argv is None else argv)
    parser().print_help()
    return 0
