"""`bxctl chat` on a terminal: prompt_toolkit for the input line (in a worker thread, so it
never fights trio), rich `Live` for the turn, refreshed from a trio task at a steady rate
(no auto-refresh thread). Finished turns are printed above the prompt, so a long answer is
printed once, whole, and never flickers or repeats.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import get_args

import platformdirs
import trio
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory
from prompt_toolkit.key_binding import KeyBindings
from rich.console import Console
from rich.live import Live
from rich.text import Text

from bxctl import rewind
from bxctl.connection import Connection, SessionRefused, Unreachable
from bxctl.exits import turn_number
from bxctl.keys import can_read_keys, cbreak, read_key
from bxctl.oneshot import plan_lines
from bxctl.requests import APPROVE_USAGE, UNDO_USAGE, approve_of, decided, undo_of
from bxctl.text import (
    context_line,
    fork_line,
    recent_tree,
    session_lines,
    turn_lines,
    turns_text,
    unreadable_line,
)
from bxctl.user_commands import UserCommand, expand, find_commands
from bxctl.view import (
    APPROVAL_KEYS,
    DEMO_MODELS,
    TurnView,
    approval_panel,
    context_lines,
    demo_note,
    instructions_line,
)
from loopd.backoff import RECONNECT
from loopd.config import user_commands
from loopd.locations import config_file
from loopd.session.records import RECORD, Mode
from loopd.session.transcript import transcript
from loopd.wire.events import ApprovalNeeded
from loopd.wire.proto import (
    Cancel,
    ClientMessage,
    Compact,
    Context,
    ContextRequest,
    Error,
    History,
    HistoryRequest,
    ModeChanged,
    ModeSet,
    Send,
    SessionFailed,
    Sessions,
    SessionsRequest,
    SetMode,
    Status,
    StatusRequest,
    TurnFailed,
    Undone,
)

__all__ = ["Settings", "interactive", "live_turn"]

REFRESH = 1 / 12
CHANGES = 0.02
"""Seconds to read what loopd said unasked, between prompts: what it sent is there already."""
HELP = """Enter sends; Alt-Enter (or Esc, Enter) starts a new line. Ctrl-C cancels a running turn;
at the prompt, Ctrl-C or Ctrl-D quits. A call that needs your approval is shown with its
arguments: y runs it, n does not, a runs it and every later call of that tool in this session.
  /new        start a fresh session, in this folder (the old one stays on disk)
  /sessions   list the sessions, numbered
  /resume N   go on with session N of that list (or an id, or `latest`), its cache restored
  /compact    go on in a new session that starts from the model's summary of this one
              (loopd does it by itself when the context is full)
  /status     what loopd is doing, and the calls that wait for approval
  /context    what the model sees (system prompt, AGENTS.md files, tools) and how full its
              context is, by part
  /fork [N]   go on in a new session with this one's history up to turn N (the latest
              by default), this one left as it is; it costs only your next message
  /rewind [N] [files]   go on from the end of turn N (alone: the turns to pick from), in a
              fork made there; with files, the files the later turns changed are put back
  /undo [N]    put back the files the last turn (or call N) changed
  /mode [ask|accept_edits|read_only]   what this session's calls may do: ask before
              each change (the default), write and edit without asking, or change nothing;
              kept in the session's log (/mode alone: the mode now, and whether turns think)
  /approve N once|session|deny [SESSION]   answer call N, which waits for approval (of
              the sub-agent SESSION, when the prompt names one)
  /think off  let the model answer without reasoning first (/think on: with; /think alone:
              which it is); kept in the session's log, as /mode is
  /model [NAME]   the model this session runs on, of loopd's [models.NAME] (/model alone:
              which it is, and which loopd serves); kept in the session's log
  /help       this text, and your own commands (.loopd/commands/NAME.md in this folder or
              one above it, commands/NAME.md in loopd's config folder): /NAME args sends
              the file's text, $ARGUMENTS replaced by args
  /quit       leave"""


class Lost(Exception):
    """The daemon closed the connection."""


def _prompt_session() -> PromptSession[str]:
    state = platformdirs.user_state_path("bxctl")
    state.mkdir(parents=True, exist_ok=True)
    keys = KeyBindings()

    @keys.add("enter")
    def _submit(event: object) -> None:
        event.current_buffer.validate_and_handle()  # type: ignore[attr-defined]

    @keys.add("escape", "enter")
    def _newline(event: object) -> None:
        event.current_buffer.insert_text("\n")  # type: ignore[attr-defined]

    return PromptSession(
        history=FileHistory(str(state / "history")), multiline=True, key_bindings=keys
    )


async def interactive(
    path: Path,
    console: Console,
    show_reasoning: bool,
    session: str = "new",
    config: Path | None = None,
) -> bool:
    """The chat until the user leaves (True), or gives up on a daemon that went away (False),
    in session `session` (an id, `latest`, or `new`); `config`: the config file in effect, as
    hints name it (by default the one loopd reads when none is named)."""
    connection = await Connection.open(path)
    note = None
    if session == "new":
        # A chat's session is made to talk in now: it goes if the chat leaves it empty.
        session, note = await connection.here(
            lambda cwd: connection.hello("new", cwd=cwd, discard_if_empty=True)
        )
    else:
        session = await connection.hello(session)
    console.print(
        Text.assemble(("loopd ", "bold"), f"session {session}", ("  /help for help", "dim"))
    )
    if note:
        console.print(note, style="yellow")
    if connection.instructions:
        console.print(instructions_line(connection.instructions))
    await _recent(connection, console)
    await _joined(connection, console, config or config_file())
    prompt = _prompt_session()
    turns = itertools.count(1)
    settings = Settings(show_reasoning)
    while True:
        await _changes(connection, console)
        try:
            text = await trio.to_thread.run_sync(partial(prompt.prompt, "> "))
        except (EOFError, KeyboardInterrupt):
            break
        await _changes(connection, console)  # made while the prompt was up
        if not text.strip():
            continue
        try:
            if not await _take(text, connection, console, settings, turns):
                break
        except (Lost, trio.BrokenResourceError, trio.ClosedResourceError):
            back = await _reconnect(path, console, connection.session)
            if back is None:
                return False
            connection = back
            console.print("(that message got no answer; send it again)", style="yellow")
    await connection.aclose()
    return True


async def _take(
    text: str,
    connection: Connection,
    console: Console,
    settings: Settings,
    turns: Iterator[int],
) -> bool:
    """Do what a line typed at the prompt says; False to quit."""
    if text.strip() == "/compact":
        await live_turn(connection, Compact(id=f"t{next(turns)}"), console, settings)
    elif text.startswith("/") and (own := await _own_command(text, connection)) is not None:
        console.print(f"({own[0]}: the text of {own[1]})", style="dim")
        sent = Send(id=f"t{next(turns)}", content=own[2])
        await live_turn(connection, sent, console, settings)
    elif text.startswith("/"):
        return await _command(text.strip(), connection, console)
    else:
        await live_turn(connection, Send(id=f"t{next(turns)}", content=text), console, settings)
    return True


async def _reconnect(path: Path, console: Console, session: str) -> Connection | None:
    """A new connection, in `session`, once loopd answers again; None when the user gives up
    (Ctrl-C)."""
    console.print("loopd went away; reconnecting (Ctrl-C to quit)…", style="yellow")
    with trio.open_signal_receiver(signal.SIGINT) as interrupts:
        for attempt in itertools.count(start=1):
            try:
                connection = await Connection.open(path)
                session = await connection.hello(session)
            except Unreachable:
                with trio.move_on_after(RECONNECT.delay(attempt)):
                    async for _ in interrupts:
                        return None
                continue
            console.print(f"reconnected to loopd, session {session}", style="green")
            return connection
    raise AssertionError  # unreachable: the loop only returns


async def _changes(connection: Connection, console: Console) -> None:
    """What loopd said since, unasked: another client's change of the session's mode, thinking
    or model, each as a line (the rest answers nothing asked)."""
    while True:
        with trio.move_on_after(CHANGES):
            message = await connection.receive()
            if isinstance(message, ModeChanged):
                console.print(changed_line(message), style="yellow")
            if message is not None:
                continue
        return


def changed_line(change: ModeChanged) -> str:
    """Another client's change of the session's settings, as the chat says it."""
    model = f", model {change.model}" if change.model else ""
    thinking = "on" if change.thinking else "off"
    return f"(another client set this session's mode {change.mode}, thinking {thinking}{model})"


async def _recent(connection: Connection, console: Console) -> None:
    history = await connection.request(HistoryRequest(start=-12))
    if isinstance(history, History) and history.records:
        records = [RECORD.validate_python(r) for r in history.records]
        for line in transcript(records):
            console.print(line)


async def _joined(connection: Connection, console: Console, config: Path) -> None:
    """What to know on joining: a demonstration model is one (and where to name another:
    `config`), and calls of another client's turn that wait for approval, with how to answer
    them."""
    status = await connection.request(StatusRequest())
    if not isinstance(status, Status):
        return
    if status.model in DEMO_MODELS:
        console.print(demo_note(config), style="yellow", markup=False)
    for line in status.pending:
        if isinstance(asking := line.event, ApprovalNeeded):
            console.print(approval_panel(asking))
            of = f" {asking.session}" if asking.session else ""
            console.print(
                f"answer with /approve {asking.call} once|session|deny{of}", style="yellow"
            )


async def _approve(words: list[str], connection: Connection, console: Console) -> None:
    if (message := approve_of(words)) is None:
        console.print(APPROVE_USAGE, style="red")
        return
    answer = await connection.request(message)
    if isinstance(answer, Error):
        console.print(answer.message, style="red")
    else:
        console.print(f"call {words[0]}: {words[1]}", style="dim")


async def _command(text: str, connection: Connection, console: Console) -> bool:
    """Run a /command; False to quit."""
    name, *words = text.split()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        console.print(HELP)
        for command in (await _own_commands(connection)).values():
            hint = f" {command.hint}" if command.hint else ""
            console.print(f"  /{command.name}{hint}   {command.description}  ({command.path})")
    elif (run := _LOCAL.get(name)) is not None:
        await run(words, connection, console)
    elif (handler := _COMMANDS.get(name)) is None:
        console.print(f"unknown command {name}; /help lists them", style="red")
    else:
        request, show = handler
        answer = await connection.request(request)
        if isinstance(answer, Error):
            console.print(answer.message, style="red")
        else:
            console.print(show(answer))
    return True


async def _set_mode(
    key: str, value: object, connection: Connection, console: Console
) -> ModeSet | None:
    """Set one of the session's settings (`set_mode`: `key` to `value`; None sets nothing, and
    asks what they are); what they are now, or None where loopd refused (it said why)."""
    message = SetMode.model_validate({} if value is None else {key: value})
    answer = await connection.request(message)
    if isinstance(answer, Error):
        console.print(answer.message, style="red")
    return answer if isinstance(answer, ModeSet) else None


async def _think(words: list[str], connection: Connection, console: Console) -> None:
    """`/think on|off`: whether the session's turns think, set as its mode is (`set_mode`):
    kept in its log, so it holds when the session is opened again, as an editor's thought
    level does; `/think` alone: whether they do now."""
    if len(words) > 1 or (words and words[0] not in ("on", "off")):
        console.print("/think on, /think off, or /think alone (whether turns think)", style="red")
        return
    if answer := await _set_mode(
        "thinking", words[0] == "on" if words else None, connection, console
    ):
        thinking = "on" if answer.thinking else "off"
        console.print(f"thinking: {thinking} (mode {answer.mode})", style="green")


async def _model(words: list[str], connection: Connection, console: Console) -> None:
    """`/model [NAME]`: the model the session's turns run on (`set_mode`), kept in its log;
    `/model` alone: which it is, and which loopd serves."""
    if len(words) > 1:
        console.print("/model alone, or /model NAME", style="red")
        return
    answer = await _set_mode("model", words[0] if words else None, connection, console)
    if answer is not None and answer.model is None:
        console.print("loopd serves one model ([models.NAME] tables serve several)")
    elif answer is not None:
        console.print(f"model: {answer.model} (of {', '.join(answer.models)})", style="green")


async def _new(_: list[str], connection: Connection, console: Console) -> None:
    """`/new`: a fresh session, in the folder bxctl runs in where loopd allows it."""
    try:
        session, note = await connection.here(
            lambda cwd: connection.new_session(cwd, discard_if_empty=True)
        )
    except SessionRefused as e:
        console.print(str(e), style="red")
        return
    console.print(Text(f"new session {session}", style="green"))
    if note:
        console.print(note, style="yellow")
    if connection.instructions:
        console.print(instructions_line(connection.instructions))


async def _mode(words: list[str], connection: Connection, console: Console) -> None:
    """`/mode [MODE]`: set the session's mode, or show it."""
    modes = get_args(Mode)
    if len(words) > 1 or (words and words[0] not in modes):
        console.print(f"/mode alone, or /mode {'|'.join(modes)}", style="red")
        return
    if answer := await _set_mode("mode", words[0] if words else None, connection, console):
        thinking = "on" if answer.thinking else "off"
        console.print(f"mode: {answer.mode} (thinking {thinking})", style="green")


async def _fork(words: list[str], connection: Connection, console: Console) -> None:
    """`/fork [N]`: go on in a fork of this session at the end of turn N (the latest)."""
    at = turn_number(words[0]) if len(words) == 1 else None
    if len(words) > 1 or (words and at is None):
        console.print(
            "/fork, or /fork N to go on from the end of turn N (1 is the first)", style="red"
        )
        return
    parent = connection.session
    try:
        await connection.fork(at)
    except SessionRefused as e:
        console.print(str(e), style="red")
        return
    console.print(Text(fork_line(connection.session, parent, at), "green"))


async def _rewind(words: list[str], connection: Connection, console: Console) -> None:
    """`/rewind`: the turns to go back to; `/rewind N [files]`: go on from the end of turn N
    in a fork made there, with `files` every file the later turns changed put back."""
    if not words:
        for line in turn_lines(await rewind.said(connection.request)):
            console.print(line, markup=False)
        console.print(rewind.HELP)
        return
    if (asked := rewind.parse(words)) is None:
        console.print(rewind.USAGE, style="red")
        return
    parent, (at, files) = connection.session, asked
    try:
        put_back = await connection.rewind(at, files)
    except SessionRefused as e:
        console.print(str(e), style="red")
        return
    console.print(Text(fork_line(connection.session, parent, at), "green"))
    if put_back:
        console.print(f"put back: {', '.join(put_back)}", markup=False)


class _Numbered:
    """The sessions as `/sessions` last numbered them, for `/resume N`: the same session
    whatever was made or active since."""

    shown: list[str] | None = None


async def _list_sessions(_: list[str], connection: Connection, console: Console) -> None:
    """The sessions, the most recent first, numbered for `/resume N`, with their titles."""
    answer = await connection.request(SessionsRequest())
    if not isinstance(answer, Sessions):
        return
    width = console.width - len("123. ")
    lines = session_lines(answer.sessions, answer.current, width)
    for number, (_listed, line) in enumerate(lines, start=1):
        console.print(f"{number:3d}. {line}", markup=False)
    _Numbered.shown = [listed.id for listed, _line in lines]
    for bad in answer.unreadable:
        line = unreadable_line(bad.id, bad.reason)  # whole: why matters more than width
        console.print(f"     {line}", markup=False, style="red")


async def _resume(words: list[str], connection: Connection, console: Console) -> None:
    if len(words) != 1:
        console.print("/resume N (from /sessions), /resume ID or /resume latest", style="red")
        return
    choice = words[0]
    if choice.isdigit():
        ids = _Numbered.shown
        if ids is None:  # not listed yet: numbered as /sessions would number them now
            answer = await connection.request(SessionsRequest())
            listed = recent_tree(answer.sessions) if isinstance(answer, Sessions) else []
            ids = [s.id for _, s in listed]
        if not 1 <= int(choice) <= len(ids):
            console.print(f"no session {choice}: /sessions lists {len(ids)}", style="red")
            return
        choice = ids[int(choice) - 1]
    try:
        session = await connection.open_session(choice)
    except SessionRefused as e:
        console.print(str(e), style="red")
        return
    console.print(Text(f"session {session}", style="green"))
    await _recent(connection, console)


def _status(answer: object) -> Text:
    if not isinstance(answer, Status):
        return Text("")
    text = (
        f"session {answer.session} ({turns_text(answer.turns)}), {answer.server}, "
        f"model {answer.model}, slot {answer.slot}"
    )
    if answer.session_model:
        text += f"\nruns on model {answer.session_model}"
    if answer.context is not None:
        said = context_line(answer.context, answer.past_reasoning, answer.context_size)
        text += f"\ncontext: {said}"
    for line in answer.pending:
        if isinstance(asking := line.event, ApprovalNeeded):
            text += f"\nwaiting for approval: call {asking.call}, {asking.tool}"
            if asking.session:
                text += f" (sub-agent {asking.session})"
    if answer.plan is not None:
        text += "\nplan:" + "".join(f"\n  {line}" for line in plan_lines(answer.plan))
    return Text(text)


async def _undo(words: list[str], connection: Connection, console: Console) -> None:
    if (message := undo_of(words)) is None:
        console.print(UNDO_USAGE, style="red")
        return
    answer = await connection.request(message)
    if isinstance(answer, Error):
        console.print(answer.message, style="red")
    elif isinstance(answer, Undone):
        calls = ", ".join(map(str, answer.calls))
        console.print(f"put back what call {calls} changed: {', '.join(answer.paths)}")


_LOCAL = {
    "/approve": _approve,
    "/new": _new,
    "/mode": _mode,
    "/think": _think,
    "/model": _model,
    "/fork": _fork,
    "/rewind": _rewind,
    "/sessions": _list_sessions,
    "/resume": _resume,
    "/undo": _undo,
}


def _context(answer: object) -> Text:
    return Text("\n".join(context_lines(answer)) if isinstance(answer, Context) else "")


_COMMANDS: dict[str, tuple[ClientMessage, Callable[[object], Text]]] = {
    "/status": (StatusRequest(), _status),
    "/context": (ContextRequest(), _context),
}
BUILT_IN = frozenset(
    name.removeprefix("/") for name in [*_LOCAL, *_COMMANDS, "/help", "/quit", "/exit", "/compact"]
)
"""The chat's own commands: a user's command of the same name is not offered."""


async def _own_commands(connection: Connection) -> dict[str, UserCommand]:
    """The user's and the project's commands (`bxctl.user_commands`), read anew: from the
    session's own folder up, else from the folder bxctl runs in."""
    folder = Path(connection.cwd) if connection.cwd else Path.cwd()
    return await trio.to_thread.run_sync(find_commands, folder, user_commands(), BUILT_IN)


async def _own_command(text: str, connection: Connection) -> tuple[str, Path, str] | None:
    """`/NAME args` as one of the user's commands: its name, its file and the message it
    sends; None where NAME is none of them."""
    name, _, arguments = text.strip()[1:].partition(" ")
    command = (await _own_commands(connection)).get(name)
    if command is None:
        return None
    return f"/{name}", command.path, expand(command, arguments.strip())


@dataclass
class Settings:
    """What the chat's commands and flags set for the turns that follow."""

    show_reasoning: bool = True


async def live_turn(
    connection: Connection, request: Send | Compact, console: Console, settings: Settings
) -> None:
    """Send a message that runs as a turn (`send`, `compact`), show the turn live, and print
    it whole when it ends."""
    view = TurnView(show_reasoning=settings.show_reasoning)
    turn = request.id
    await connection.send(request)
    lost = False
    with Live(console=console, auto_refresh=False, transient=True) as live:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_refresh, live, view, console)
            nursery.start_soon(_cancel_on_interrupt, connection, turn)
            if can_read_keys():
                nursery.start_soon(_answer_approvals, connection, view)
            while view.outcome is None:
                message = await connection.receive()
                if message is None:
                    lost = True  # raised outside the nursery: one error, not a group
                    break
                if isinstance(message, Error) and message.id == turn:
                    view.outcome = TurnFailed(id=turn, kind="error", message=message.message)
                elif getattr(message, "id", None) == turn or isinstance(message, SessionFailed):
                    view.feed(message)
                elif isinstance(message, ModeChanged):
                    console.print(changed_line(message), style="yellow")
            nursery.cancel_scope.cancel()
    if lost:
        raise Lost
    console.print(view.final())


async def _refresh(live: Live, view: TurnView, console: Console) -> None:
    while True:
        live.update(view.live(console.height), refresh=True)
        await trio.sleep(REFRESH)


async def _answer_approvals(connection: Connection, view: TurnView) -> None:
    """While a call waits for approval, its key (y, n, a) answers it; the keyboard is left
    alone otherwise. Another client may answer first: then the prompt goes away."""
    while True:
        waiting = view.approval
        if waiting is None:
            await trio.sleep(REFRESH)
            continue
        decision = None
        with cbreak() as fd:
            while decision is None and view.approval is waiting:
                with trio.move_on_after(REFRESH):
                    decision = APPROVAL_KEYS.get(await read_key(fd))
        if decision is not None and view.approval is waiting:
            view.approval = None  # answered: the daemon's `approval_decided` follows
            await connection.send(decided(waiting, decision))


async def _cancel_on_interrupt(connection: Connection, turn: str) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as interrupts:
        async for _ in interrupts:
            try:
                await connection.send(Cancel(id=turn))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # loopd went away: the turn's reader says so
