"""The `loopd` command."""

from __future__ import annotations

import argparse
import sys

from loopd import __version__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopd",
        description="A local agent runtime for llama-server: sessions, tools, runaway limits.",
    )
    p.add_argument("--version", action="version", version=f"loopd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    parser().parse_args(sys.argv[1:] if argv is None else argv)
    parser().print_help()
    return 0
