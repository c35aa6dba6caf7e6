"""The `loopd` command: `serve`, `sessions`, `replay`, `check-config`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import trio
from rich.console import Console

from loopd import __version__
from loopd.actors import AGENTS
from loopd.canonical import canonical
from loopd.channel import BadActivation, DaemonRunning, UnsafeSocket
from loopd.config import Config, ConfigError, McpServer, ToolsConfig, dump_toml, load_config
from loopd.daemon import StartupError, Unusable, check_servers, launch_spec, serve
from loopd.groups import innermost
from loopd.session.baseline import messages
from loopd.session.records import conversation_problems
from loopd.session.store import Store, StoreError
from loopd.session.transcript import transcript
from loopd.tools import (
    builtin_entries,
    delegate_entry,
    policy_for,
    process_bound,
    reached_at,
    sandbox_missing,
    token_missing,
)

# Exit statuses a script can test.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_RUNNING = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopd",
        description="A local agent runtime for llama-server, vLLM and any OpenAI-compatible "
        "server: sessions, tools, runaway limits. bxctl is its client.",
    )
    p.add_argument("--version", action="version", version=f"loopd {__version__}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=description)
        sub.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            help="the config file (default: $LOOPD_CONFIG, else config.toml in loopd's config "
            "folder, $XDG_CONFIG_HOME/loopd or ~/.config/loopd, if it exists, else the built-in "
            "defaults)",
        )
        return sub

    run = command(
        "serve",
        "run the daemon",
        "Run the daemon until SIGINT or SIGTERM: it serves every session to its clients "
        "(bxctl, editors through bxctl acp) on the Unix socket, or on the one systemd passes "
        "when it starts loopd. The model is the server's at [server] url (llama-server, vLLM "
        "or any OpenAI-compatible server; several urls join one pool); with none, loopd "
        "starts a llama-server of its own ([server.managed] binary, else $LOOPD_LLAMA_SERVER, "
        "else llama-server on PATH; [server.managed] model, else $LOOPD_MODEL) and starts it "
        "again if it dies.",
    )
    run.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="the socket (default: [channel] socket, $XDG_RUNTIME_DIR/loopd/loopd.sock)",
    )
    run.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="log lines for people (text) or machines (json), on stderr",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    run.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    command("sessions", "list the sessions", "List the sessions in the store, oldest first.")
    replay = command(
        "replay",
        "print a session and check that it replays",
        "Print the conversation of a session, and check that its log replays to "
        "the same messages and is a valid conversation (exit 1 when not).",
    )
    replay.add_argument(
        "session", help="the session id (or 'latest': the newest that is not a sub-agent's)"
    )
    command(
        "check-config",
        "validate the config and print the effective one",
        "Validate the config file and print the effective config as TOML, every default "
        "spelled out, then which tools run without asking, and what was found of the servers "
        "and programs loopd would start or reach. Exit status 2 when the file is missing or "
        "invalid, 1 when a server cannot be used or a program or model is missing.",
    )
    return p


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def _logging(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S")
        )
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "mcp"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser().print_help()
        return EXIT_OK
    try:
        config, source = load_config(args.config)
    except ConfigError as e:
        print(f"loopd: invalid config:\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check-config":
        print(f"# effective config: {source or 'built-in defaults (no config file)'}")
        print(dump_toml(config), end="")
        lines = _without_asking(config.tools, delegates=config.agents.depth > 0)
        servers, usable = trio.run(check_servers, config)
        programs, found = _programs(config)
        print("\n".join(["", *lines, *_sandbox(config.tools), "", *servers, *programs]))
        return EXIT_OK if usable and found else EXIT_FAILED
    if args.command == "serve":
        return _serve(config, args, source)
    if args.command == "sessions":
        return _sessions(config)
    return _replay(config, args.session)


def _without_asking(tools: ToolsConfig, *, delegates: bool) -> list[str]:
    """Comment lines: each tool's effective action, and for those that run without asking the
    table that lets them. An MCP server's tool names are known only once it runs."""
    entries = builtin_entries(tools) + ([delegate_entry(tools, AGENTS)] if delegates else [])
    rows = [(e.name, e.name, e.source) for e in entries]  # shown, name, source
    for server in tools.mcp:
        # A tool named as its source picks the source's table, as each of its tools does.
        rows.append((f"every tool of server {server}:", server, server))
        rows += [(name, name, server) for name in tools.policies if name.startswith(f"{server}.")]
    width = max(len(shown) for shown, _, _ in rows)
    lines = ["# Which tools run without asking (each tool's effective action):"]
    for shown, name, source in rows:
        action = policy_for(tools, name, source).action
        line = f"#   {shown:<{width}}  {action}"
        if action == "allow":
            line += f"  (runs without asking: {_policy_table(tools, name, source)})"
        lines.append(line)
    return lines


def _policy_table(tools: ToolsConfig, name: str, source: str) -> str:
    """Where a tool's `allow` comes from: the first table `policy_for` reads that sets
    `action`. (`[tools] class_actions` only makes an action stricter, and the tools that ask
    by default are allowed only by a table of their own.)"""
    tables = [
        (f"[tools.policies.{_toml_key(key)}]", tools.policies.get(key)) for key in (name, source)
    ]
    if source in tools.mcp:
        tables.append((f"[tools.mcp.{_toml_key(source)}] policy", tools.mcp[source].policy))
    for table, policy in tables:
        if policy is not None and "action" in policy.model_fields_set:
            return table
    return "the default"


def _sandbox(tools: ToolsConfig) -> list[str]:
    """Comment lines: what run_command's sandbox can be here."""
    if not tools.roots:
        return []
    if tools.run.sandbox == "none":
        return ['# run_command: unsandboxed ([tools.run] sandbox = "none")']
    why = sandbox_missing()
    if why is not None:
        return [f"# run_command: refused here: {why}"]
    return [f"# run_command: sandboxed by bubblewrap; {process_bound(tools.run)}"]


def _programs(config: Config) -> tuple[list[str], bool]:
    """Comment lines: the programs loopd would start that cannot run (the embedded
    llama-server's binary, found but not executable; each MCP server's, not found as its
    start would look for it), each MCP server's that can; and whether all of them can."""
    lines, ok = [], True
    if not config.server.urls:
        try:
            binary = launch_spec(config.server.managed, config.server.slots, Path()).binary
        except StartupError:
            binary = None  # check_servers has said why
        if binary is not None and not os.access(binary, os.X_OK):
            lines.append(f"# server: the llama-server {binary} is not executable")
            ok = False
    for name, server in config.tools.mcp.items():
        line, usable = _mcp_server(name, server)
        lines.append(f"# MCP server {name}: {line}")
        ok = ok and usable
    return lines, ok


def _mcp_server(name: str, server: McpServer) -> tuple[str, bool]:
    """Where the MCP server `name` is (its program found, or its URL, never a header or the
    token), or why it cannot start; and whether it can."""
    if server.command is None:
        missing = token_missing(name, server)
        if missing is not None:
            return f"cannot connect: {missing}", False
        return reached_at(server), True
    program = server.command[0]
    # Started with loopd's environment and the server's `env` over it, PATH included.
    path = server.env.get("PATH", os.environ.get("PATH", os.defpath))
    found = shutil.which(program, path=path)
    if found is not None:
        return found, True
    if "/" not in program:
        why = f"{program} is not found on PATH"
    elif Path(program).exists():
        why = f"{program} is not an executable file"
    else:
        why = f"{program} does not exist"
    if program.startswith("~"):
        why += " (a ~ is not expanded in a command)"
    return f"cannot start: {why}", False


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _serve(config: Config, args: argparse.Namespace, source: Path | None) -> int:
    _logging(args)
    socket_path = args.socket or config.channel.socket
    try:
        trio.run(serve, config, socket_path, source)
    except BaseException as e:
        error = innermost(e)
        if not isinstance(
            error,
            (
                BadActivation,
                DaemonRunning,
                StartupError,
                StoreError,
                Unusable,
                UnsafeSocket,
                OSError,
            ),
        ):
            raise
        print(f"loopd: {error}", file=sys.stderr)
        return EXIT_RUNNING if isinstance(error, DaemonRunning) else EXIT_FAILED
    return EXIT_OK


def _sessions(config: Config) -> int:
    store = Store(config.store.directory)
    listing = trio.run(store.listing)
    if not listing.sessions and not listing.unreadable:
        print(f"no sessions in {store.directory}")
    for s in listing.sessions:
        line = f"{s.id}  {s.turns:4d} turns  last {s.last_activity:%Y-%m-%d %H:%M}"
        if s.continues:
            line += f"  continues {s.continues}"
        if s.parent:
            line += f"  sub-agent of {s.parent}"
        print(line)
    for bad in listing.unreadable:
        print(f"{bad.id}  does not read: {bad.reason}")
    return EXIT_OK


def _replay(config: Config, session_id: str) -> int:
    store = Store(config.store.directory)
    if session_id == "latest":
        session_id = store.latest() or ""
    try:
        header, records, torn = store.read(session_id)
    except StoreError as e:
        print(f"loopd: {e}", file=sys.stderr)
        return EXIT_FAILED
    console = Console(soft_wrap=True)
    for line in transcript(records):
        console.print(line)
    problems = conversation_problems(records)
    if torn:
        problems.append(f"a torn last line of {torn} bytes (the next open cuts it off)")
    first = canonical(messages(header.baseline, records))
    if canonical(messages(header.baseline, store.read(session_id)[1])) != first:
        problems.append("the log does not replay to the same messages")
    for problem in problems:
        print(f"loopd: {problem}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK
