"""The `loopd` command: `loopd check-config` (more commands come with the daemon)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loopd import __version__
from loopd.config import ConfigError, dump_toml, load_config

# Exit statuses a script can test.
EXIT_OK = 0
EXIT_CONFIG = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopd",
        description="A local agent runtime for llama-server: sessions, tools, runaway limits.",
    )
    p.add_argument("--version", action="version", version=f"loopd {__version__}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND")
    check = commands.add_parser(
        "check-config",
        help="validate the config and print the effective one",
        description="Validate the config file and print the effective config as TOML, every "
        "default spelled out. Exit status 2 when the file is missing or invalid.",
    )
    check.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the config file (default: $LOOPD_CONFIG, else ~/.config/loopd/config.toml if it "
        "exists, else the built-in defaults)",
    )
    return p


def check_config(config_file: Path | None) -> int:
    try:
        config, source = load_config(config_file)
    except ConfigError as e:
        print(f"loopd: invalid config:\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"# effective config: {source or 'built-in defaults (no config file)'}")
    print(dump_toml(config), end="")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "check-config":
        return check_config(args.config)
    parser().print_help()
    return EXIT_OK
