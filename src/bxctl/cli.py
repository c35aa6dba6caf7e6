"""The `bxctl` command: `chat` (live, or one turn for scripts), `status`, `context`,
`approve`, `undo`, `fork`, `rewind`, `sessions`, `log`, `export`, `stop`, and `acp` (for
editors).

Exit statuses of `bxctl chat -m`: 0 answered; 1 the turn failed (llama-server, an error, a
cancel); 2 bad usage; 3 a limit stopped the turn; 4 the session is full; 5 loopd is not
running (with --no-start), went away during the turn, or the loopd started for it did not come
up; 6 a call waits for approval (without --yes; answer it with `bxctl approve`); 128 + N
stopped by signal N (SIGTERM, SIGHUP), its turn cancelled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bxctl.exits import EXIT_OK, turn_number
from loopd import __version__

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bxctl",
        description="The terminal client of loopd.",
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--version", action="version", version=f"bxctl {__version__}")
    p.add_argument(
        "--socket",
        type=Path,
        metavar="PATH",
        help="loopd's socket (default: the one loopd's config names)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="loopd's config file (default: $LOOPD_CONFIG, else config.toml in loopd's config "
        "folder, $XDG_CONFIG_HOME/loopd or ~/.config/loopd, if there is one)",
    )
    commands = p.add_subparsers(dest="command", metavar="COMMAND")
    chat = commands.add_parser(
        "chat",
        help="talk to the model (one turn with -m or piped text)",
        description="Talk to the model through loopd, with live rendering, in a new session "
        "(--continue: the latest one). With -m TEXT, or text on stdin when it is not a "
        "terminal, run one turn, print the answer and exit.",
    )
    chat.add_argument("-m", "--message", metavar="TEXT", help="run one turn and exit")
    where = chat.add_mutually_exclusive_group()
    where.add_argument(
        "-c",
        "--continue",
        dest="session",
        action="store_const",
        const="latest",
        help="go on with the latest session (default: a new one)",
    )
    where.add_argument(
        "--session",
        metavar="ID",
        help="go on with this session (an id from `bxctl sessions`, or `latest`); on "
        "llama-server its cache comes back from its slot file, so it costs only its new tokens",
    )
    chat.add_argument(
        "--json",
        action="store_true",
        help="with -m (or text on stdin): print the turn's messages as JSON lines instead of "
        "the answer",
    )
    chat.add_argument(
        "--yes",
        action="store_true",
        help="with -m (or text on stdin): approve each call that asks, once (otherwise bxctl "
        "exits with status 6 and the call waits for `bxctl approve`)",
    )
    chat.add_argument(
        "--show-reasoning",
        action="store_true",
        help="in the live chat: keep the model's reasoning on screen once it answers",
    )
    _no_start(chat, "say so and exit with status 5")
    status = commands.add_parser(
        "status",
        help="what loopd is doing",
        description="Show a session, the model, the slots, the last request's figures, how "
        "full the context is, the calls that wait for approval and the model's plan.",
    )
    status.add_argument(
        "--in", dest="where", metavar="SESSION", default="latest", help="default: the latest"
    )
    context = commands.add_parser(
        "context",
        help="what the model sees, and how full its context is",
        description="Show what a session's model sees: its system prompt, the AGENTS.md files "
        "in it, the tools offered to it and those it finds through find_tool; and the tokens "
        "its slot holds by part (first prompt, messages, tool results, answers, past "
        "reasoning) against the context window, saying whether they are the server's exact "
        "counts.",
    )
    context.add_argument(
        "--in", dest="where", metavar="SESSION", default="latest", help="default: the latest"
    )
    context.add_argument("--json", action="store_true", help="print loopd's answer as JSON")
    approve = commands.add_parser(
        "approve",
        help="answer a call that waits for approval",
        description="Answer a tool call that waits for approval (`bxctl status` lists them).",
    )
    approve.add_argument("call", type=int, help="the call's number")
    approve.add_argument(
        "--in",
        dest="where",
        metavar="SESSION",
        default="latest",
        help="the session the call waits in (default: the latest)",
    )
    approve.add_argument(
        "--sub-agent",
        metavar="SESSION",
        help="the call is one of this sub-agent's, started from the session of --in",
    )
    decision = approve.add_mutually_exclusive_group(required=True)
    for flag, meaning in (
        ("--once", "run this call"),
        ("--session", "run it, and this tool from now on in this session without asking"),
        ("--deny", "do not run it"),
    ):
        decision.add_argument(
            flag, dest="decision", action="store_const", const=flag[2:], help=meaning
        )
    undo = commands.add_parser(
        "undo",
        help="put back the files the model changed",
        description="Put back what the last turn that changed files changed (or one call's "
        "changes), when each file still holds what the model wrote; otherwise nothing is "
        "touched and bxctl says which file changed since.",
    )
    undo.add_argument("call", type=int, nargs="?", help="only this call's changes")
    undo.add_argument(
        "--in", dest="where", metavar="SESSION", default="latest", help="default: the latest"
    )
    fork = commands.add_parser(
        "fork",
        help="fork a session: a new one with its history up to a turn",
        description="Make a new session whose history is SESSION's up to the end of turn "
        "TURN (its latest by default), SESSION left as it is, and print its id; its first "
        "turn costs only its new message (served from SESSION's cache). Go on in it with "
        "`bxctl chat --session ID`.",
    )
    fork.add_argument("session", nargs="?", default="latest", help="default: the latest")
    fork.add_argument(
        "--at", type=_turn, metavar="TURN", help="1 is the first; default: the latest"
    )
    rewind = commands.add_parser(
        "rewind",
        help="go on from an earlier turn of a session, in a fork made there",
        description="Go on from the end of turn TURN of SESSION: a new session, its fork "
        "there (SESSION's log left as it is), as `bxctl fork` makes; print its id. With "
        "--files, every file the later turns changed is put back first as it was then; "
        "where one changed since outside loopd, it is named and nothing is put back or made "
        "(exit 1).",
    )
    rewind.add_argument("session", nargs="?", default="latest", help="default: the latest")
    rewind.add_argument("--at", type=_turn, metavar="TURN", required=True, help="1 is the first")
    rewind.add_argument(
        "--files", action="store_true", help="put back the files the later turns changed too"
    )
    commands.add_parser(
        "sessions",
        help="list the sessions",
        description="List the sessions, from loopd (or the store if it is not running), the "
        "most recent first, each in a line that fits the terminal: its id, turns, last "
        "activity and title (its first message); each fork and sub-agent's session under "
        "the session it forks or works for, and the session each continues after a "
        "compaction.",
    )
    log = commands.add_parser(
        "log",
        help="print a session's transcript",
        description="Print a session's transcript from the store: messages, "
        "tool results, and the cache figures of each request. A session that continues "
        "another (a compaction) comes after the sessions it continues, oldest first.",
    )
    log.add_argument("session", nargs="?", help="a session id, or `latest` (default: the latest)")
    export = commands.add_parser(
        "export",
        help="write a session out, to read or to share",
        description="Write a session out from the store: as Markdown a person reads (every "
        "message, each tool call with its arguments and result, each sub-agent's conversation "
        "under the call that started it, where a fork came from), or as one JSON document. A "
        "session that continues another (a compaction) comes after the sessions it continues. "
        "Token ids are left out. Works with no loopd running.",
    )
    export.add_argument(
        "session", nargs="?", help="a session id, or `latest` (default: the latest)"
    )
    export.add_argument(
        "--format", choices=("markdown", "json"), default="markdown", help="default: markdown"
    )
    export.add_argument(
        "-o", "--output", type=Path, help="write it to this file (default: standard output)"
    )
    commands.add_parser(
        "stop",
        help="stop the loopd that bxctl started",
        description="Stop the loopd that `bxctl chat` or `bxctl acp` started in the background "
        "(the pid file in loopd's state folder, beside its log), and wait until it has exited: "
        "its turns end as on Ctrl-C, and its llama-server with it. A loopd started otherwise "
        "(`loopd serve`, systemd) is stopped the way it was started.",
    )
    acp = commands.add_parser(
        "acp",
        help="serve an editor: the Agent Client Protocol on stdin and stdout",
        description="Be an Agent Client Protocol agent on stdin and stdout, for an editor "
        "(Zed, JetBrains IDEs, Neovim, ...) that starts it: each ACP session is a loopd "
        "session, of the running loopd or of one this starts (stdout carries JSON-RPC alone; "
        "loopd's output goes to its log). See docs/editors.md.",
    )
    _no_start(
        acp,
        "stay up and answer each request that needs loopd with the error -32010 (loopd is "
        "not running), until one answers",
    )
    return p


def _no_start(command: argparse.ArgumentParser, instead: str) -> None:
    """`--no-start`, which does `instead` where no loopd answers."""
    command.add_argument(
        "--no-start",
        action="store_true",
        help="when no loopd answers on the socket, do not start `loopd serve` in the "
        "background (which writes its output to loopd.log in its state folder, "
        f"~/.local/state/loopd by default), but {instead}",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser().print_help()
        return EXIT_OK
    # Here, not above: `--help` and a usage error need none of what the commands import, and
    # `status` and `sessions` most often only a plain socket.
    if args.command in ("status", "sessions"):
        from bxctl.oneshot import run as plainly  # noqa: PLC0415

        if (code := plainly(args)) is not None:
            return code
    from bxctl.commands import run  # noqa: PLC0415

    return run(args)


def _turn(text: str) -> int:
    """`--at`'s type: a turn's number."""
    if (number := turn_number(text)) is None:
        raise argparse.ArgumentTypeError(f"turns are numbered from 1, not {text!r}")
    return number
