"""What each `bxctl` command does (the parser is `bxctl.cli`'s, which imports this only once
a command is to run)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import trio
from rich.console import Console
from rich.text import Text

from bxctl.connection import Connection, SessionRefused
from bxctl.exits import (
    EXIT_APPROVAL,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    FAILURE_EXIT,
)
from bxctl.export import ExportFormat, exported, json_document, markdown
from bxctl.oneshot import exit_for, print_sessions, sessions, status
from bxctl.requests import decided
from bxctl.start import Starter, StopFailed
from bxctl.text import approve_command, fork_line
from bxctl.view import context_lines
from loopd.config import ConfigError, load_config
from loopd.infer import Queued, Retrying
from loopd.locations import config_file
from loopd.session.records import (
    Decision,
    InstructionFile,
    Record,
    SessionHeader,
    ToolResultRecord,
)
from loopd.session.store import SessionInfo, Store, StoreError
from loopd.session.transcript import transcript
from loopd.wire import proto
from loopd.wire.events import (
    ApprovalNeeded,
    Compacting,
    MovedToServer,
    SessionContinued,
    TurnEvent,
    WaitingForServer,
)
from loopd.wire.proto import DaemonMessage, Error, Event, TurnDone, TurnFailed, Undone

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:  # noqa: PLR0911 - a status per command
    """The command `args` names, and its exit status."""
    try:
        config, _ = load_config(args.config)
    except ConfigError as e:
        print(f"bxctl: invalid loopd config:\n{e}", file=sys.stderr)
        return EXIT_USAGE
    path: Path = args.socket or config.channel.socket
    starter = None
    if args.command in ("chat", "acp") and not args.no_start:
        starter = Starter(path, config.store.directory.parent, args.config, args.socket is not None)
    try:
        if args.command == "stop":
            return _stop(Starter(path, config.store.directory.parent))
        if args.command == "chat":
            return _chat(args, path, starter)
        if args.command == "status":
            return status(path, args.where)
        if args.command in ("approve", "undo", "fork", "rewind", "context"):
            return trio.run(_asked, path, args)
        if args.command == "acp":
            from bxctl.acp import serve  # noqa: PLC0415 - the ACP package, for this command only

            trio.run(serve, path, starter)
            return EXIT_OK
        if args.command == "sessions":
            store = Store(config.store.directory)
            code = sessions(path, store.directory)
            return trio.run(_stored_sessions, store) if code is None else code
        return _stored(args, Store(config.store.directory))
    except BaseException as e:  # noqa: BLE001 - what a user meets gets one line; the rest is raised
        return exit_for(e)


def _stop(starter: Starter) -> int:
    try:
        stopped = starter.stop()
    except StopFailed as e:
        print(f"bxctl: {e}", file=sys.stderr)
        return EXIT_FAILED
    print("loopd stopped" if stopped else "no loopd started by bxctl is running")
    return EXIT_OK


def _chat(args: argparse.Namespace, path: Path, starter: Starter | None) -> int:
    text = args.message
    if text is None and not sys.stdin.isatty():
        text = sys.stdin.read()
    if text is not None and not text.strip():
        print("bxctl: nothing to send", file=sys.stderr)
        return EXIT_USAGE
    for flag, given in (("--json", args.json), ("--yes", args.yes)):
        if given and text is None:
            print(f"bxctl: {flag} needs -m TEXT or text on stdin", file=sys.stderr)
            return EXIT_USAGE
    if starter is not None:
        trio.run(starter.ensure)
    if text is not None:
        return trio.run(_once, path, text, args)
    from bxctl.chat import interactive  # noqa: PLC0415 - prompt_toolkit, for this command only

    # No markup: loopd's messages and the help name config tables (`[tools] roots`).
    console = Console(markup=False)
    config = config_file(args.config)  # the one in effect, as hints name it
    if trio.run(interactive, path, console, args.show_reasoning, args.session or "new", config):
        return EXIT_OK
    print("bxctl: loopd is not running", file=sys.stderr)
    return EXIT_UNREACHABLE


async def _once(path: Path, text: str, args: argparse.Namespace) -> int:
    connection = await Connection.open(path)
    if args.session:
        await connection.hello(args.session)
    else:  # a folder loopd refuses leaves the session without one, silently: stderr is the script's
        await connection.here(lambda cwd: connection.hello("new", cwd=cwd))
    _tell_session(connection.session, args.json)
    turn = f"bxctl-{id(connection):x}"
    await connection.send(proto.Send(id=turn, content=text))
    stopped: list[int] = []
    with trio.open_signal_receiver(*STOPPING) as interrupts:
        async with trio.open_nursery() as nursery:

            async def cancel_on_interrupt() -> None:
                async for signum in interrupts:
                    await connection.send(proto.Cancel(id=turn))
                    if signum != signal.SIGINT:  # told to go: the turn is cancelled, not awaited
                        stopped.append(signum)
                        nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_on_interrupt)
            code = await _follow(connection, turn, args.json, args.yes)
            nursery.cancel_scope.cancel()
    await connection.aclose()
    if stopped:
        print(f"\nbxctl: {signal.Signals(stopped[0]).name}: the turn is cancelled", file=sys.stderr)
        return 128 + stopped[0]
    return code


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that cancel `chat -m`'s turn: Ctrl-C, then the answer to it is awaited; a SIGTERM
(`timeout`, a CI runner) or a hang-up, then bxctl exits at once. (loopd cancels a turn that
no client follows any more too; this says so, and does not wait for loopd to notice.)"""


def _tell_session(session: str, as_json: bool) -> None:
    """Say which session the turn runs in, so that a script goes on with `--session ID`
    (`--continue` takes whichever is latest by then): on stderr, stdout being the answer's;
    with `--json`, as a line of its own."""
    if as_json:
        print(json.dumps({"type": "session", "session": session}), flush=True)
    else:
        print(f"bxctl: session {session}", file=sys.stderr, flush=True)


def _tell_continued(message: DaemonMessage, as_json: bool) -> None:
    """After a compaction, the session to go on in is the new one: say so as at the start."""
    if isinstance(message, Event) and isinstance(message.event, SessionContinued):
        _tell_session(message.event.session, as_json)


async def _follow(connection: Connection, turn: str, as_json: bool, approve: bool) -> int:
    while (message := await connection.receive()) is not None:
        if getattr(message, "id", None) != turn:
            continue
        _tell_continued(message, as_json)
        _show(message, as_json)
        if isinstance(message, Event) and isinstance(message.event, ApprovalNeeded):
            asking = message.event
            if not approve:
                print(
                    f"\nbxctl: call {asking.call} ({asking.tool}) waits for approval; answer "
                    f"it with `{approve_command(asking, connection.session)}`, or run with "
                    "--yes",
                    file=sys.stderr,
                )
                return EXIT_APPROVAL
            await connection.send(decided(asking, "once"))
        if isinstance(message, TurnDone):
            if not as_json:
                print(flush=True)
            return EXIT_OK
        if isinstance(message, TurnFailed | Error):
            what = message.kind if isinstance(message, TurnFailed) else message.code
            print(f"\nbxctl: {what}: {message.message}", file=sys.stderr)
            return FAILURE_EXIT.get(what, EXIT_FAILED)
    print("\nbxctl: loopd went away before the turn ended", file=sys.stderr)
    return EXIT_UNREACHABLE


def _show(message: DaemonMessage, as_json: bool) -> None:
    """A message of the turn as `chat -m` prints it: each as a JSON line; else the answer's
    text on stdout, and each wait on stderr."""
    if as_json:
        print(message.model_dump_json(by_alias=True), flush=True)
    elif isinstance(message, Event) and message.event.kind == "content":
        print(message.event.text, end="", flush=True)
    elif isinstance(message, Event) and (line := waiting_line(message.event)):
        print(f"bxctl: {line}", file=sys.stderr, flush=True)


def waiting_line(event: TurnEvent) -> str | None:
    """What a script's reader is told on stderr while the turn waits: for a slot, for the
    server, for a retry, for a summary (its answer alone goes to stdout); None for the rest."""
    if isinstance(event, Queued):
        return "queued: every slot of the model is busy; the turn waits for one"
    if isinstance(event, WaitingForServer | MovedToServer | Retrying):
        return event.said()
    if isinstance(event, Compacting):
        return f"the context is full: summarising session {event.session} to go on in a new one"
    return None


async def _asked(path: Path, args: argparse.Namespace) -> int:
    """A command that asks the running loopd one thing."""
    if args.command == "approve":
        return await _approve(path, args.call, args.decision, args.where, args.sub_agent)
    if args.command == "undo":
        return await _undo(path, args.call, args.where)
    if args.command == "context":
        return await _context(path, args.where, args.json)
    if args.command == "rewind":
        return await _rewind(path, args.session, args.at, args.files)
    return await _fork(path, args.session, args.at)


async def _approve(path: Path, call: int, decision: Decision, where: str, agent: str | None) -> int:
    connection = await Connection.open(path)
    await connection.hello(where)
    answer = await connection.request(proto.Approve(call=call, session=agent, decision=decision))
    await connection.aclose()
    if isinstance(answer, Error):
        print(f"bxctl: {answer.message}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


async def _context(path: Path, where: str, as_json: bool) -> int:
    connection = await Connection.open(path)
    try:
        await connection.hello(where)
        answer = await connection.request(proto.ContextRequest())
    finally:
        await connection.aclose()
    if isinstance(answer, Error):
        print(f"bxctl: {answer.message}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(answer, proto.Context):
        if as_json:
            print(answer.model_dump_json(by_alias=True))
        else:
            print("\n".join(context_lines(answer)))
    return EXIT_OK


async def _undo(path: Path, call: int | None, where: str) -> int:
    connection = await Connection.open(path)
    await connection.hello(where)
    answer = await connection.request(proto.Undo(call=call))
    await connection.aclose()
    if isinstance(answer, Error):
        print(f"bxctl: {answer.message}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(answer, Undone):
        calls = ", ".join(map(str, answer.calls))
        print(f"put back what call{'s' * (len(answer.calls) > 1)} {calls} changed:")
        for changed in answer.paths:
            print(f"  {changed}")
    return EXIT_OK


async def _fork(path: Path, session: str, at: int | None) -> int:
    connection = await Connection.open(path)
    try:
        parent = await connection.hello(session)
        fork = await connection.fork(at)
    finally:
        await connection.aclose()
    print(fork_line(fork, parent, at))
    return EXIT_OK


async def _rewind(path: Path, session: str, at: int, files: bool) -> int:
    connection = await Connection.open(path)
    try:
        parent = await connection.hello(session)
        put_back = await connection.rewind(at, files)
    except SessionRefused as e:
        if e.code != "undo_refused":
            raise
        print(f"bxctl: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await connection.aclose()
    print(fork_line(connection.session, parent, at))
    for changed in put_back:
        print(f"  put back {changed}")
    return EXIT_OK


async def _stored_sessions(store: Store) -> int:
    """The sessions as the store holds them, when no loopd answers."""
    listing = await store.listing()
    listed = [proto.SessionInfo.of(s) for s in listing.sessions]
    unreadable = [proto.Unreadable.of(u) for u in listing.unreadable]
    print_sessions(listed, unreadable, None, store.directory)
    return EXIT_OK


def _log(store: Store, session_id: str | None) -> int:
    """The session's transcript; one that continues another (a compaction) comes after the
    sessions it continues, oldest first, so the whole conversation reads in one go."""
    if session_id in (None, "latest"):
        session_id = store.latest()
    if session_id is None:
        print(f"bxctl: no sessions in {store.directory}", file=sys.stderr)
        return EXIT_FAILED
    chain: list[tuple[SessionHeader, list[Record]]] = []
    seen: set[str] = set()
    try:
        while session_id is not None and session_id not in seen:
            seen.add(session_id)
            header, records, _ = store.read(session_id)
            chain.insert(0, (header, records))
            session_id = header.continues
    except StoreError as e:
        if not chain:
            print(f"bxctl: {e}", file=sys.stderr)
            return EXIT_FAILED
        print(f"bxctl: the session it continues is not readable: {e}", file=sys.stderr)
    console = Console()
    infos = store.sessions_now()
    for header, records in chain:
        console.print(
            f"session {header.id}, created {header.created:%Y-%m-%d %H:%M} UTC", style="bold"
        )
        for file in header.instructions.files if header.instructions else ():
            console.print(_instruction_line(file), style="dim", markup=False)
        for line in _with_sub_agents(store, infos, header.id, records):
            console.print(line)
    return EXIT_OK


def _stored(args: argparse.Namespace, store: Store) -> int:
    """A command that reads the store alone: `log` or `export`."""
    if args.command == "export":
        return _export(store, args.session, args.format, args.output)
    return _log(store, args.session)


def _export(store: Store, session: str | None, how: ExportFormat, output: Path | None) -> int:
    """The session written out (`bxctl.export`), to `output` or stdout."""
    if session in (None, "latest"):
        session = store.latest()
    if session is None:
        print(f"bxctl: no sessions in {store.directory}", file=sys.stderr)
        return EXIT_FAILED
    try:
        chain = exported(store, session)
    except StoreError as e:
        print(f"bxctl: {e}", file=sys.stderr)
        return EXIT_FAILED
    text = markdown(chain) if how == "markdown" else json_document(chain) + "\n"
    if output is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        output.write_text(text)
    except OSError as e:
        print(f"bxctl: cannot write {output}: {e.strerror}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _instruction_line(file: InstructionFile) -> str:
    """One `AGENTS.md` its system prompt carries, as `bxctl log` names it."""
    cut = ""
    if file.kept < file.size:
        cut = f", {file.kept} of {file.size} bytes" if file.kept else ", left out (too long)"
    return f"instructions from {file.path} (sha256 {file.sha256[:12]}{cut})"


def _with_sub_agents(
    store: Store, infos: list[SessionInfo], session_id: str, records: list[Record]
) -> list[Text]:
    """The transcript of a session, each sub-agent's own under the result of the call that
    started it."""
    lines: list[Text] = []
    children = {}
    for info in infos:
        if info.parent == session_id:
            try:
                header, child_records, _ = store.read(info.id)
            except StoreError as e:
                lines.append(Text(f"  (sub-agent {info.id} is not readable: {e})", style="red"))
                continue
            if header.call is not None:
                children[header.call] = (info.id, child_records)
    for record in records:
        lines += transcript([record])
        if isinstance(record, ToolResultRecord) and record.call in children:
            child, child_records = children.pop(record.call)
            lines.append(Text(f"    ┌ sub-agent {child}", style="bold cyan"))
            for line in _with_sub_agents(store, infos, child, child_records):
                lines.append(Text("    │ ", style="cyan") + line)
    return lines
