"""bxctl: one-turn runs and their exit statuses against a real `loopd serve`, the rendering
on event streams without a terminal, and the live chat driven in tmux."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from rich.console import Console

from bxctl import rewind
from bxctl.chat import _mode, _think
from bxctl.cli import main
from bxctl.connection import Connection
from bxctl.oneshot import read_message, status_lines
from bxctl.text import recent_tree, session_line
from bxctl.view import TurnView
from conftest import StartDaemon, Unstarted
from loopd.infer import Content, Progress, Reasoning, Repeating, ThinkingCapped, Waiting
from loopd.locations import config_file
from loopd.session.records import (
    CacheLossRecord,
    FailureKind,
    ToolResultRecord,
    UnreadRecord,
    UserRecord,
)
from loopd.session.store import Store
from loopd.session.transcript import transcript
from loopd.wire.events import (
    ApprovalNeeded,
    CacheLoss,
    Compacting,
    ToolCallStarted,
    ToolOutputChunk,
    ToolResult,
    TurnEvent,
)
from loopd.wire.proto import (
    Event,
    SessionFailed,
    SlotInfo,
    Status,
    TurnDone,
    TurnFailed,
    Usage,
    dump,
)
from support.daemon import Daemon, loopds_of
from support.fake_llama import FakeLlama, Reply


async def bxctl(
    d: Daemon,
    *args: str,
    stdin: bytes | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    """Run bxctl against `d`, in folder `cwd` (default: `/`, which loopd refuses as a
    session's folder whatever the roots, so a new session has none), with `env` added to
    the environment (where a terminal 200 columns wide is its width unless it says another)."""
    command = [sys.executable, "-m", "bxctl", "--config", str(d.config), *args]
    with trio.fail_after(60):
        done = await trio.run_process(
            command,
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=cwd or "/",
            env={**os.environ, "COLUMNS": "200", **(env or {})},
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_chat_m_prints_the_answer_and_exits_0(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="Paris is the capital.")]))
    code, out, err = await bxctl(d, "chat", "-m", "Capital of France?")
    session = Store(d.home / "sessions").latest()
    assert (code, out, err) == (0, "Paris is the capital.\n", f"bxctl: session {session}\n")


async def test_chat_reads_the_message_from_stdin(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="Hello from stdin.")]))
    code, out, _ = await bxctl(d, "chat", stdin=b"hi there\n")
    assert (code, out) == (0, "Hello from stdin.\n")


async def test_chat_json_prints_the_turns_messages(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="One two.")]))
    code, out, _ = await bxctl(d, "chat", "-m", "count", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [line["type"] for line in lines[:2]] == ["session", "accepted"]
    assert lines[-1]["type"] == "turn_done"
    assert lines[-1]["content"] == "One two."
    assert any(line["type"] == "event" and line["event"]["kind"] == "content" for line in lines)


async def test_chat_m_names_its_session_so_a_script_goes_on_in_it(daemon: StartDaemon) -> None:
    """On stderr, and as the first line with --json: `--session ID` then continues that
    session, whichever session is the latest by then."""
    d = await daemon(FakeLlama([Reply(content="Noted.")] * 4))
    _, _, err = await bxctl(d, "chat", "-m", "remember oats")
    assert (await bxctl(d, "chat", "-m", "another conversation"))[0] == 0  # now the latest
    (first,) = re.fullmatch(r"bxctl: session (\S+)\n", err).groups()  # type: ignore[union-attr]
    code, out, _ = await bxctl(d, "chat", "--session", first, "-m", "and milk", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert (code, lines[0]) == (0, {"type": "session", "session": first})
    assert [i.turns for i in Store(d.home / "sessions").sessions_now() if i.id == first] == [2]


async def test_a_limit_exits_3(daemon: StartDaemon) -> None:
    call = ("c1", "find_tool", '{"query": "anything"}')
    calls = [Reply(tool_calls=((f"c{n}", call[1], f'{{"query": "q{n}"}}'),)) for n in range(3)]
    d = await daemon(FakeLlama(calls), loop="tool_iterations = 1\n")
    code, _, err = await bxctl(d, "chat", "-m", "loop forever")
    assert code == 3
    assert "turn_limit" in err


async def test_a_full_session_exits_4(daemon: StartDaemon) -> None:
    d = await daemon("context_full")
    code, _, err = await bxctl(d, "chat", "-m", "too much")
    assert code == 4
    assert "session_full" in err


async def test_a_failed_request_exits_1(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(kind="server_error")]))
    code, _, err = await bxctl(d, "chat", "-m", "hello")
    assert code == 1
    assert "infer" in err


async def test_no_daemon_with_no_start_exits_5_with_one_line(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "nobody", "http://127.0.0.1:9")
    code, out, err = await bxctl(d, "chat", "-m", "hello", "--no-start")
    assert (code, out) == (5, "")
    assert err.startswith("bxctl: loopd is not running at ")
    assert "loopd serve" in err
    assert len(err.strip().splitlines()) == 1


async def test_two_chat_m_at_once_start_one_loopd_and_both_are_answered(
    unstarted: Unstarted,
) -> None:
    d = await unstarted(FakeLlama([Reply(content="Hello there.")] * 2))
    runs: list[tuple[int, str, str]] = []

    async def one() -> None:
        runs.append(await bxctl(d, "chat", "-m", "hello"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert [(code, out) for code, out, _ in runs] == [(0, "Hello there.\n")] * 2
    named = [re.findall(r"^bxctl: session \S+$", err, re.MULTILINE) for _, _, err in runs]
    assert [len(lines) for lines in named] == [1, 1]  # each its own session
    # One may wait for the other's slot: a script hears so on stderr (`bxctl: queued: ...`).
    said = sorted(re.sub(r"bxctl: (session \S+|queued: .*)\n", "", err) for _, _, err in runs)
    assert said == ["", f"bxctl: starting loopd (log: {d.home / 'loopd.log'})\n"]
    (pid,) = loopds_of(d.config)
    assert int((d.home / "loopd.pid").read_text()) == pid


async def test_stop_ends_the_loopd_bxctl_started_and_waits_until_it_has_exited(
    unstarted: Unstarted,
) -> None:
    d = await unstarted(FakeLlama([Reply(content="Hello there.")]))
    assert (await bxctl(d, "chat", "-m", "hello"))[0] == 0
    (pid,) = loopds_of(d.config)
    assert (await bxctl(d, "stop")) == (0, "loopd stopped\n", "")
    assert exited(pid)  # when stop returns, not only told
    assert not (d.home / "loopd.pid").exists()
    assert loopds_of(d.config) == []
    assert (await bxctl(d, "stop")) == (0, "no loopd started by bxctl is running\n", "")


@pytest.mark.parametrize("held", ["a process that is not loopd", "garbage", "no process"])
async def test_stop_signals_nothing_but_the_loopd_its_pid_file_names(
    tmp_path: Path, held: str
) -> None:
    """A pid file left by a loopd that died: its pid may be another process's by now."""
    d = Daemon(tmp_path / "nobody", "http://127.0.0.1:9")
    other = await trio.lowlevel.open_process(["sleep", "60"])
    try:
        pid = {"a process that is not loopd": other.pid, "no process": 2**22 + 1}.get(held)
        (d.home / "loopd.pid").write_text(f"{pid}\n" if pid else "not a pid\n")
        assert (await bxctl(d, "stop")) == (0, "no loopd started by bxctl is running\n", "")
        assert other.poll() is None
        assert not (d.home / "loopd.pid").exists()
    finally:
        other.kill()
        await other.wait()


async def test_a_started_loopd_that_does_not_come_up_is_told_with_its_log(
    unstarted: Unstarted,
) -> None:
    d = await unstarted(FakeLlama([]))
    missing = d.home / "no-such-model.gguf"
    config = re.sub(r'url = ".*"\n', f'managed.model = "{missing}"\n', d.config.read_text())
    d.config.write_text(config)  # bxctl reads it well; the loopd it starts has no model
    code, out, err = await bxctl(d, "chat", "-m", "hello")
    assert (code, out) == (5, "")
    log = d.home / "loopd.log"
    assert err.startswith(f"bxctl: starting loopd (log: {log})\nbxctl: loopd did not start: ")
    assert f"exited with status 1; its log {log} says:\n" in err
    assert str(missing) in err.split("says:")[1]
    assert not loopds_of(d.config)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a socket away needs root")
async def test_a_socket_of_another_user_is_not_connected_to(tmp_path: Path) -> None:
    socket_path = tmp_path / "other.sock"
    listener = trio.socket.socket(family=trio.socket.AF_UNIX)
    await listener.bind(str(socket_path))
    listener.listen(1)
    os.chown(socket_path, 65534, 65534)  # someone else's daemon, or someone else's trap
    try:
        command = [sys.executable, "-m", "bxctl", "--socket", str(socket_path), "status"]
        done = await trio.run_process(command, capture_stderr=True, check=False)
    finally:
        listener.close()
    assert done.returncode == 5
    assert "belongs to another user (uid 65534), not to you" in done.stderr.decode()


async def test_status_sessions_and_log(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="Logged answer.")]))
    assert (await bxctl(d, "chat", "-m", "remember this"))[0] == 0
    code, out, _ = await bxctl(d, "status")
    assert code == 0
    assert "(1 turn)" in out
    code, out, _ = await bxctl(d, "sessions")
    assert out.startswith("* ")
    code, out, _ = await bxctl(d, "log")
    assert code == 0
    assert "you: remember this" in out
    assert "model: Logged answer." in out
    assert "cached" in out
    assert await bxctl(d, "log", "latest") == (0, out, "")  # as every command that names one


async def test_sessions_lists_titles_most_recent_first_with_one_turn_singular(
    daemon: StartDaemon,
) -> None:
    """As loopd answers and as the store reads when none runs."""
    d = await daemon(FakeLlama([Reply(content="ok")] * 3))
    assert (await bxctl(d, "chat", "-m", "plan the garden\nwith more lines"))[0] == 0
    first = Store(d.home / "sessions").latest()
    assert (await bxctl(d, "chat", "-m", "fix the bike"))[0] == 0
    second = Store(d.home / "sessions").latest()
    assert (await bxctl(d, "chat", "--session", str(first), "-m", "and the roses"))[0] == 0
    for fast in (True, False):
        code, out, _ = await bxctl(d, "sessions")
        assert code == 0
        listed = [line.split() for line in out.splitlines()]
        assert [words[:3] for words in listed] == [
            [first, "2", "turns"],
            ["*", second, "1"],  # the latest made, which `chat --continue` takes
        ]
        assert out.splitlines()[0].endswith("  plan the garden")
        assert out.splitlines()[1].endswith("  fix the bike")
        assert f"{second}     1 turn   20" in out
        if fast:
            await d.stop()


async def test_sessions_cuts_a_long_title_to_fit_the_terminal(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([Reply(content="ok")]))
    title = "please " * 20
    assert (await bxctl(d, "chat", "-m", title))[0] == 0
    for fast in (True, False):
        code, out, _ = await bxctl(d, "sessions", env={"COLUMNS": "70"})
        assert code == 0
        (line,) = out.splitlines()
        assert len(line) == 70
        assert line.endswith("  please pl…")
        if fast:
            await d.stop()


def listed_session(
    name: str, last: str, *, parent: str | None = None, forked_from: str | None = None
) -> SimpleNamespace:
    return SimpleNamespace(
        id=name,
        parent=parent,
        forked_from=forked_from,
        at=1 if forked_from else None,
        continues=None,
        turns=1,
        last_activity=f"2026-12-01T{last}:00+00:00",
        title=f"title of {name}",
    )


def test_a_session_worked_in_last_comes_first_with_its_forks_under_it() -> None:
    """Work in a fork brings up the session it forks; the tree stays as it is."""
    listed = [
        listed_session("a", "10:00"),
        listed_session("b", "11:00"),
        listed_session("a-fork", "12:00", forked_from="a"),
        listed_session("c", "11:30"),
        listed_session("c-agent", "11:20", parent="c"),
    ]
    tree = [(depth, s.id) for depth, s in recent_tree(listed)]
    assert tree == [(0, "a"), (1, "a-fork"), (0, "c"), (1, "c-agent"), (0, "b")]


def test_a_title_of_wide_or_control_characters_fits_its_columns() -> None:
    """A wide character takes two columns of the terminal; a tab or an escape in the user's
    message reaches the terminal as a space."""
    wide = listed_session("a", "10:00")
    wide.title = "日本語" * 20
    line = session_line(wide, None, width=60)
    assert sum(2 if c >= "\u3000" else 1 for c in line) <= 60
    assert line.endswith("…")
    escaped = listed_session("b", "10:00")
    escaped.title = "red\x1b[31m\tline"
    assert session_line(escaped, None).endswith("  red [31m line")


NO_FILES = (
    "loopd changes no files in this session ([tools] roots is empty, and the session has no "
    "folder of its own)"
)


async def test_fork_and_rewind_make_a_session_listed_as_the_fork_of_its_parent(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two")]))
    assert (await bxctl(d, "chat", "-m", "first"))[0] == 0
    assert (await bxctl(d, "chat", "--continue", "-m", "second"))[0] == 0
    parent = Store(d.home / "sessions").latest()
    assert parent is not None
    code, out, _ = await bxctl(d, "fork", "--at", "1")
    fork = out.split()[1].rstrip(":")
    assert (code, out) == (0, f"session {fork}: the fork of session {parent} at turn 1\n")
    for fast in (True, False):  # loopd's answer, then the store read when none runs
        code, out, _ = await bxctl(d, "sessions")
        assert f"{fork}     1 turn " in out
        assert re.search(f"{fork} .* fork at turn 1  first$", out, re.MULTILINE)
        if fast:
            await d.stop()
    await d.start()
    code, _, err = await bxctl(d, "fork", parent, "--at", "3")
    assert (code, err) == (2, f"bxctl: session {parent} has turns 1 to 2: there is no turn 3\n")
    code, _, err = await bxctl(d, "fork", "20990101T000000000Z-000000")
    assert code == 2
    assert "20990101T000000000Z-000000" in err
    code, out, _ = await bxctl(d, "rewind", parent, "--at", "1")
    rewound = out.split()[1].rstrip(":")
    assert (code, out) == (0, f"session {rewound}: the fork of session {parent} at turn 1\n")
    code, _, err = await bxctl(d, "rewind", parent, "--at", "3")
    assert (code, err) == (2, f"bxctl: session {parent} has turns 1 to 2: there is no turn 3\n")
    code, _, err = await bxctl(d, "rewind", parent, "--at", "1", "--files")
    assert (code, err) == (1, f"bxctl: {NO_FILES}\n")  # it has no folder: none were changed
    for command in ("fork", "rewind"):  # a usage error, not loopd's refusal of a bad request
        code, _, err = await bxctl(d, command, parent, "--at", "0")
        assert code == 2
        assert "argument --at: turns are numbered from 1" in err


async def test_sessions_draws_each_fork_under_the_session_it_forks(daemon: StartDaemon) -> None:
    """A fork of a fork under its fork, a rewind under the session rewound; as loopd answers
    and as the store reads when none runs."""
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two")]))
    assert (await bxctl(d, "chat", "-m", "first"))[0] == 0
    assert (await bxctl(d, "chat", "--continue", "-m", "second"))[0] == 0
    parent = Store(d.home / "sessions").latest()
    assert parent is not None

    async def made(*words: str) -> str:
        code, out, _ = await bxctl(d, *words)
        assert code == 0
        return out.split()[1].rstrip(":")

    fork = await made("fork", parent, "--at", "2")
    of_fork = await made("fork", fork, "--at", "1")
    rewound = await made("rewind", parent, "--at", "1")
    for fast in (True, False):
        code, out, _ = await bxctl(d, "sessions")
        assert code == 0
        drawn = [line[: line.index(" turn")].rsplit(maxsplit=1)[0] for line in out.splitlines()]
        assert drawn == [f"  {parent}", f"  └─ {fork}", f"     └─ {of_fork}", f"* └─ {rewound}"]
        assert f"{of_fork}     1 turn " in out
        assert re.search(f"{of_fork} .* fork at turn 1  first$", out, re.MULTILINE)
        if fast:
            await d.stop()


async def test_status_and_sessions_run_on_neither_trio_nor_pydantic_nor_rich(
    daemon: StartDaemon,
) -> None:
    """`bxctl status` and `bxctl sessions` ask a real loopd over a plain socket: none of the
    full client's imports, which cost ten times the interpreter's start. The session marked is
    the one `chat --continue` takes."""
    d = await daemon(FakeLlama([Reply(content="one"), Reply(content="two")]))
    for text in ("first", "second"):
        assert (await bxctl(d, "chat", "-m", text))[0] == 0
    code = (
        "import sys\n"
        "from bxctl.cli import main\n"
        f"codes = [main(['--config', {str(d.config)!r}, c]) for c in ('status', 'sessions')]\n"
        "print(codes, sorted({m.split('.')[0] for m in sys.modules} & {'trio','pydantic','rich'}))"
    )
    done = await trio.run_process([sys.executable, "-c", code], capture_stdout=True)
    *shown, loaded = done.stdout.decode().splitlines()
    assert loaded == "[0, 0] []"
    assert re.fullmatch(r"session  \S+ \(1 turn\)", shown[0])
    listed = [line for line in shown if line.startswith(("* ", "  "))]
    assert len(listed) == 2
    assert listed[0].startswith(f"* {Store(d.home / 'sessions').latest()}  ")


async def test_status_of_a_session_loopd_does_not_know_is_refused(daemon: StartDaemon) -> None:
    d = await daemon(FakeLlama([]))
    code, out, err = await bxctl(d, "status", "--in", "nosuch")
    assert (code, out) == (2, "")
    assert err.startswith("bxctl: ")
    assert "nosuch" in err
    assert len(err.splitlines()) == 1


def test_status_reads_the_wire_models_as_plain_json() -> None:
    """The plain reading of a `status` line renders as its model does: every field `bxctl
    status` prints is named as proto.py names it."""
    asking = ApprovalNeeded.model_validate(
        {
            "call": 3,
            "session": "sub",
            "tool": "write_file",
            "arguments": {"path": "a.txt", "lines": [{"n": 1}]},
            "class": "private",
            "untrusted": False,
            "timeout": 60.0,
        }
    )
    status = Status(
        session="s1",
        server="http://a",
        model="m.gguf",
        engine="vllm",
        context_size=4096,
        slot=0,
        busy=True,
        queue=1,
        turns=2,
        last_usage=Usage(
            prompt_n=10,
            cache_n=90,
            predicted_n=5,
            prompt_ms=1.0,
            predicted_ms=2.0,
            reasoning_tokens=0,
            thinking_capped=False,
        ),
        context=100,
        past_reasoning=25,
        pending=[Event(id="t", event=asking)],
        slots=[
            SlotInfo(server="http://a", slot=0, session="s1", tokens=100, busy=True),
            SlotInfo(server="http://b", slot=0, session=None, tokens=None, busy=False),
        ],
    )
    plain = status_lines(read_message(dump(status)))  # type: ignore[arg-type] # read as its model
    assert plain == status_lines(status)
    assert plain == [
        "session  s1 (2 turns)",
        "server   http://a  (vLLM)",
        "model    m.gguf, a window of 4096 tokens  slot 0",
        "turn     running, 1 waiting",
        "slot http://a 0   busy, session s1, 100 tokens",
        "slot http://b 0   idle, free",
        "last     10 prompt tokens processed, 90 cached, 5 generated",
        "context  100 of 4096 tokens in the slot (2%), 25 of them past reasoning (25%)",
        (
            'waiting  call 3: write_file {"path": "a.txt", "lines": [{"n": 1}]} '
            "(bxctl approve 3 --once|--session|--deny --in s1 --sub-agent sub)"
        ),
    ]


# -- rendering, without a terminal -----------------------------------------------------------


def render(view: TurnView, *, live: bool = False) -> str:
    console = Console(record=True, width=120, color_system=None)
    console.print(view.live(20) if live else view.final())
    return console.export_text()


def turn_events() -> list[Any]:
    events: list[TurnEvent] = [
        Waiting(),
        Progress(total=120, cache=100, processed=100),
        Progress(total=120, cache=100, processed=120),
        Reasoning(text="Let me"),
        Reasoning(text=" look."),
        ThinkingCapped(cap=2),
        ToolCallStarted(name="call_tool", call=1, tool="read_file"),
        ToolResult(
            name="call_tool",
            call=1,
            data_class="private",
            untrusted=True,
            truncated=True,
            preview="# Notes",
        ),
        CacheLoss(expected=200, cached=50),
        Content(text="Your **notes**"),
        Content(text=" say hi."),
    ]
    return [Event(id="t", event=e) for e in events]


def test_a_turn_renders_tools_content_cache_loss_and_figures() -> None:
    view = TurnView()
    for message in turn_events():
        view.feed(message)
    usage = Usage(
        prompt_n=20,
        cache_n=100,
        predicted_n=4,
        prompt_ms=10,
        predicted_ms=50,
        reasoning_tokens=2,
        thinking_capped=True,
    )
    view.feed(TurnDone(id="t", content="Your **notes** say hi.", usage=usage))
    text = render(view)
    assert "⚙ call_tool → read_file (call 1)" in text
    assert "↳ # Notes  [private, untrusted, truncated]" in text
    assert "Your notes say hi." in text  # Markdown, not raw asterisks
    assert "CACHE LOSS: 50 tokens cached of 200 expected" in text
    assert "thinking capped at 2 tokens" in text
    assert "(thought for 3 words; --show-reasoning shows it)" in text
    figures = [line.strip() for line in text.splitlines() if "request" in line]
    assert figures == [
        "request 1: prompt 120 tokens, 100 cached, 20 processed; 4 generated at 80 tokens/s"
    ]


def usage(prompt_n: int, cache_n: int | None, predicted_n: int) -> Usage:
    return Usage(
        prompt_n=prompt_n,
        cache_n=cache_n,
        predicted_n=predicted_n,
        prompt_ms=10,
        predicted_ms=100,
        reasoning_tokens=0,
        thinking_capped=False,
    )


def figures(*messages: Any) -> list[str]:
    view = TurnView()
    for message in messages:
        view.feed(message)
    return [line.strip() for line in render(view).splitlines() if line.startswith("request")]


def test_an_answers_figures_are_one_line_with_the_servers_count_of_what_it_generated() -> None:
    """Seven pieces of text streamed, and the end token that streams none: eight generated,
    as the server counts them."""
    pieces = [Event(id="t", event=Content(text=f"w{n} ")) for n in range(7)]
    assert figures(
        Event(id="t", event=Waiting()),
        Event(id="t", event=Progress(total=98, cache=0, processed=98)),
        *pieces,
        TurnDone(id="t", content="...", usage=usage(98, 0, 8)),
    ) == ["request 1: prompt 98 tokens, 0 cached, 98 processed; 8 generated at 80 tokens/s"]


def test_a_compactions_figures_are_its_summary_requests() -> None:
    """The summary streams no text: what it generated is the server's figure, not 0."""
    assert figures(
        Event(id="c", event=Compacting(session="s1", slot=0)),
        Event(id="c", event=Waiting()),
        Event(id="c", event=Progress(total=500, cache=400, processed=500)),
        TurnDone(id="c", content="The summary.", usage=usage(100, 400, 68)),
    ) == ["request 1: prompt 500 tokens, 400 cached, 100 processed; 68 generated at 680 tokens/s"]


def test_a_request_before_the_last_says_only_what_its_progress_told() -> None:
    """The server's count of tokens generated comes with the turn's last request alone."""
    assert figures(
        Event(id="t", event=Waiting()),
        Event(id="t", event=Progress(total=120, cache=100, processed=120)),
        Event(id="t", event=ToolCallStarted(name="find_tool", call=1)),
        Event(id="t", event=Waiting()),
        Event(id="t", event=Progress(total=150, cache=130, processed=150)),
        TurnDone(id="t", content="Done.", usage=usage(20, 130, 3)),
    ) == [
        "request 1: prompt 120 tokens, 100 cached, 20 processed",
        "request 2: prompt 150 tokens, 130 cached, 20 processed; 3 generated at 30 tokens/s",
    ]


def test_a_server_that_reports_no_progress_has_its_figures_from_its_usage() -> None:
    """vLLM and OpenAI-compatible servers send no progress: no made-up `prompt 0 tokens`."""
    assert figures(
        Event(id="t", event=Waiting()),
        Event(id="t", event=Content(text="Hi.")),
        TurnDone(id="t", content="Hi.", usage=usage(12, None, 2)),
    ) == ["request 1: prompt 12 tokens processed, cache not reported; 2 generated at 20 tokens/s"]


def test_a_running_commands_last_lines_show_under_it_until_its_result() -> None:
    view = TurnView()
    started = ToolCallStarted(name="call_tool", call=4, tool="run_command")
    printed = "".join(f"step {n}\n" for n in range(1, 9)) + "compiling 10%\rcompiling 90%"
    chunks = [ToolOutputChunk(call=4, text=t) for t in (printed[:30], printed[30:])]
    events: list[TurnEvent] = [started, *chunks]
    for event in events:
        view.feed(Event(id="t", event=event))
    lines = render(view, live=True).splitlines()
    at = lines.index("⚙ call_tool → run_command (call 4)")
    shown = ["step 5", "step 6", "step 7", "step 8", "compiling 90%"]
    assert lines[at + 1 : at + 6] == [f"    │ {line}" for line in shown]
    assert "step 4" not in render(view, live=True)
    result = ToolResult(
        name="call_tool",
        call=4,
        data_class="public",
        untrusted=False,
        truncated=False,
        preview="exit status 0",
    )
    view.feed(Event(id="t", event=result))
    assert "step 8" not in render(view, live=True)
    assert "↳ exit status 0" in render(view, live=True)


def test_reasoning_is_shown_while_thinking_and_whole_with_the_flag() -> None:
    view = TurnView()
    for message in turn_events()[:5]:
        view.feed(message)
    assert "Let me look." in render(view, live=True)
    shown = TurnView(show_reasoning=True)
    for message in turn_events():
        shown.feed(message)
    assert "Let me look." in render(shown)


def test_prompt_progress_is_a_bar_while_the_prompt_is_read() -> None:
    view = TurnView()
    for message in turn_events()[:2]:
        view.feed(message)
    assert "reading the prompt: 100/120 tokens" in render(view, live=True)


def test_a_long_answer_shows_only_its_tail_live() -> None:
    view = TurnView()
    view.feed(Event(id="t", event=Content(text="\n\n".join(f"line {n}" for n in range(200)))))
    text = render(view, live=True)
    assert "line 199" in text
    assert "line 0\n" not in text
    assert len(text.splitlines()) < 25


def test_a_failed_session_says_why_and_how_to_go_on() -> None:
    view = TurnView()
    view.feed(
        SessionFailed(session="s1", fault="disk_full", message="the disk is full: s1.jsonl: ...")
    )
    view.feed(TurnFailed(id="t", kind="error", message="the disk is full: s1.jsonl: ..."))
    text = render(view)
    assert "session s1 failed and is closed: the disk is full: s1.jsonl" in text
    assert "/resume s1 opens it again" in text


@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        ("turn_limit", "Send another message"),
        ("session_full", "/compact goes on in a new session"),
        ("infer", "Is it running?"),
        ("cancelled", "Cancelled."),
    ],
)
def test_a_failed_turn_says_what_to_do_next(kind: FailureKind, hint: str) -> None:
    view = TurnView()
    view.feed(TurnFailed(id="t", kind=kind, message="details"))
    assert hint in render(view)


def test_the_transcript_shows_results_and_cache_losses() -> None:
    records = [
        UserRecord(content="hi"),
        ToolResultRecord(
            call=3, tool_call_id="c", name="x", content="result line\nmore", untrusted=True
        ),
        CacheLossRecord(expected=9, cached=2),
        UnreadRecord(text="[f(a=1)", error="TypeError: boom"),
    ]
    console = Console(record=True, width=200, color_system=None)
    for line in transcript(records):  # type: ignore[arg-type]
        console.print(line)
    text = console.export_text()
    assert "you: hi" in text
    assert "↳ #3 result line  [public, untrusted]" in text
    assert "CACHE LOSS: 2 cached of 9 expected" in text
    assert "could not read this answer from here, TypeError: boom" in text


# -- the live chat, in tmux ------------------------------------------------------------------


class Tmux:
    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, *args: str) -> str:
        done = await trio.run_process(["tmux", *args], capture_stdout=True, check=True)
        return done.stdout.decode()

    async def screen(self) -> str:
        return await self.run("capture-pane", "-p", "-t", self.name)

    async def close(self) -> None:
        """End the tmux session (its processes get a hang-up), also from a cancelled test."""
        with trio.CancelScope(shield=True):
            await trio.run_process(["tmux", "kill-session", "-t", self.name], check=False)

    async def keys(self, *keys: str) -> None:
        await self.run("send-keys", "-t", self.name, *keys)

    async def chat(
        self, d: Daemon, state: Path, rows: int = 30, columns: int = 100, cwd: Path | None = None
    ) -> None:
        """`bxctl chat` against `d` in a new tmux session, in folder `cwd` (default: an empty
        one beside `state`, where new sessions work); the shell says BXCTL-EXIT-<status> when
        it ends, and keeps the pane open."""
        if cwd is None:
            cwd = state.with_name(f"{state.name}-work")
            cwd.mkdir(parents=True, exist_ok=True)
        bxctl = f"{sys.executable} -m bxctl --config {d.config} chat"
        command = f"env XDG_STATE_HOME={state} {bxctl}; echo BXCTL-EXIT-$?; sleep 60"
        size = ("-x", str(columns), "-y", str(rows))
        await self.run("new-session", "-d", "-s", self.name, *size, "-c", str(cwd), command)

    async def wait_for(self, *texts: str, timeout: float = 30) -> str:
        """The screen, once any of `texts` is on it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = await self.screen()
            if any(text in screen for text in texts):
                return screen
            await trio.sleep(0.05)
        raise AssertionError(f"{texts!r} never appeared; the screen:\n{await self.screen()}")

    async def wait_for_words(self, text: str, timeout: float = 30) -> str:
        """The screen's words joined by single spaces, once `text` is in them (across the
        chat's own line breaks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in (words := " ".join((await self.screen()).split())):
                return words
            await trio.sleep(0.05)
        raise AssertionError(f"{text!r} never appeared; the screen:\n{await self.screen()}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_the_live_chat_in_tmux(daemon: StartDaemon, tmp_path: Path) -> None:
    long = " ".join(f"word{n}" for n in range(400))
    d = await daemon(
        FakeLlama(
            [
                Reply(tool_calls=(("c1", "find_tool", '{"query": "read a file"}'),)),
                Reply(content="Use **current_time** for that."),
                Reply(content=long, delay=0.05),
            ]
        )
    )
    tmux = Tmux(f"bxctl-{id(d):x}")
    await tmux.chat(d, tmp_path / "state", cwd=d.home)  # loopd's own folder: refused
    try:
        screen = await tmux.wait_for("no folder of its own")
        assert f"not working in {d.home}:" in " ".join(screen.split())  # loopd's own folder
        assert "(its file tools work in [tools] roots, if any)" in " ".join(screen.split())
        await tmux.keys("/help", "Enter")
        await tmux.wait_for("/rewind [N] [files]")
        await tmux.keys("/mode read_only", "Enter")
        await tmux.wait_for("mode: read_only (thinking on)")
        await tmux.keys("/mode sideways", "Enter")
        await tmux.wait_for("/mode alone, or /mode ask|accept_edits|read_only")
        await tmux.keys("which tool tells the time?", "Enter")
        screen = await tmux.wait_for("Use current_time for that.")
        assert "⚙ find_tool (call 1)" in screen
        assert "request 2: prompt" in screen  # after the find_tool call's request 1
        await tmux.keys("talk for a long time", "Enter")
        await tmux.wait_for("word5")
        await tmux.keys("C-c")
        screen = await tmux.wait_for(
            "Cancelled. What it had written is kept in the log, marked as cut short."
        )
        assert "word399" not in screen
        await d.stop()  # loopd restarts under bxctl's feet
        await d.start()
        await tmux.keys("are you back?", "Enter")
        await tmux.wait_for("reconnected to loopd")
        await tmux.keys("are you back now?", "Enter")
        await tmux.wait_for("(the script ran out)")
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_two_chats_hold_two_conversations_and_a_script_is_in_neither(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    replies = ["answer-one", "answer-two", "answer-three", "answer-four"]
    d = await daemon(FakeLlama([Reply(content=r) for r in replies]))
    left, right = Tmux(f"left-{id(d):x}"), Tmux(f"right-{id(d):x}")
    await left.chat(d, tmp_path / "left")
    await right.chat(d, tmp_path / "right")
    try:
        first = re.findall(r"session (\S+)", await left.wait_for("/help for help"))[0]
        other = re.findall(r"session (\S+)", await right.wait_for("/help for help"))[0]
        assert first != other
        await left.keys("message-alpha", "Enter")
        await left.wait_for("answer-one")
        await right.keys("message-beta", "Enter")
        await right.wait_for("answer-two")
        assert "answer-two" not in await left.screen()
        assert (await bxctl(d, "chat", "-m", "message-gamma"))[0] == 0  # answer-three
        await left.keys("/new", "Enter")
        await left.wait_for("new session")
        await right.keys("message-delta", "Enter")
        await right.wait_for("answer-four")
        for screen in (await left.screen(), await right.screen()):
            assert "answer-three" not in screen
            assert "message-gamma" not in screen
        assert "message-delta" not in await left.screen()
    finally:
        await left.close()
        await right.close()
    store = Store(d.home / "sessions")
    await logs_left(store, 3)  # the left chat's new one, quit with nothing said, goes
    said = {
        s.id: [r.content for r in store.read(s.id)[1] if isinstance(r, UserRecord)]
        for s in await store.sessions()
    }
    assert said[first] == ["message-alpha"]
    assert said[other] == ["message-beta", "message-delta"]
    assert sorted(said.values()) == [
        ["message-alpha"],
        ["message-beta", "message-delta"],
        ["message-gamma"],
    ]


async def logs_left(store: Store, count: int) -> None:
    """Once the store holds `count` logs: loopd removes a session that holds nothing once
    its clients have left, which it learns when their connections close."""
    with trio.fail_after(30):
        while len(list(store.directory.glob("*.jsonl"))) > count:  # noqa: ASYNC110 - loopd removes them
            await trio.sleep(0.05)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_a_chat_quit_before_its_first_message_leaves_no_session(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([]))
    tmux = Tmux(f"quit-{id(d):x}")
    await tmux.chat(d, tmp_path / "state")
    try:
        session = re.findall(r"session (\S+)", await tmux.wait_for("/help for help"))[0]
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("BXCTL-EXIT-0")
    finally:
        await tmux.close()
    store = Store(d.home / "sessions")
    await logs_left(store, 0)
    assert not store.path_of(session).exists()
    assert await bxctl(d, "sessions") == (0, f"no sessions in {store.directory}\n", "")


ROOT = Path(__file__).resolve().parent.parent


def exited(pid: int) -> bool:
    """Gone, or a zombie its parent (init, for a loopd that bxctl started) has not reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.llama
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
@pytest.mark.skipif(shutil.which("just") is None, reason="needs just (`.ci/run` installs it)")
async def test_just_chat_survives_ctrl_c_and_the_terminal_closing(tmp_path: Path) -> None:
    """`just chat` as a newcomer runs it: loopd in the background of the same terminal."""
    home = Path(tempfile.mkdtemp(prefix="jc-"))  # short: a socket path has 108 bytes at most
    env = {f"XDG_{k}": str(home / k.lower()) for k in ("STATE_HOME", "CONFIG_HOME", "RUNTIME_DIR")}
    (home / "runtime_dir").mkdir(mode=0o700)
    (home / "config_home" / "loopd").mkdir(parents=True)
    # Long enough to be interrupted, short enough that the next answer comes soon.
    (home / "config_home" / "loopd" / "config.toml").write_text("[loop]\nmax_tokens = 200\n")
    settings = " ".join(f"{k}={v}" for k, v in env.items())
    tmux = Tmux(f"just-chat-{home.name}")
    await tmux.run(
        "new-session", "-d", "-s", tmux.name, "-x", "100", "-y", "30", "-c", str(ROOT),
        f"env {settings} just chat; echo CHAT-EXIT-$?; sleep 60",
    )  # fmt: skip
    pid_file = home / "state_home" / "loopd" / "loopd.pid"
    pid = 0
    try:
        # The greeting says what the bundled model is, and how to point at a real one.
        screen = " ".join((await tmux.wait_for("docs/operations.md", timeout=120)).split())
        pid = int(pid_file.read_text())
        assert "bundled demonstration model" in screen
        assert "set [server.managed] model or [server] url in" in screen
        # The first question a newcomer asks, answered right (at the bundled temperature, 0).
        await tmux.keys("What is the capital of France? One sentence.", "Enter")
        await tmux.wait_for(" generated at ", timeout=120)
        assert "Paris" in await tmux.screen()
        await tmux.keys("Write a long story about a cat and a dog.", "Enter")
        await tmux.wait_for("reading the prompt", "answering", timeout=60)  # the turn runs
        await tmux.keys("C-c")
        await tmux.wait_for(
            "Cancelled. What it had written is kept in the log, marked as cut short.",
            timeout=60,
        )
        assert alive(pid)
        await tmux.keys("Say hello.", "Enter")
        await tmux.keys("/status", "Enter")
        await tmux.wait_for("(3 turns)", timeout=120)  # once the third turn has ended
        # A clean /quit after a Ctrl-C that bxctl took: `just chat` exits as bxctl does, 0,
        # where just alone would take the Ctrl-C as its own and exit 130.
        await tmux.keys("/quit", "Enter")
        await tmux.wait_for("CHAT-EXIT-", timeout=60)
        screen = await tmux.screen()
        assert "CHAT-EXIT-0" in screen
        assert "interrupted" not in screen
        await tmux.run("kill-session", "-t", tmux.name)  # the terminal closes
        await trio.sleep(1)
        assert alive(pid)
        done = await trio.run_process(
            ["just", "stop"], cwd=ROOT, env={**os.environ, **env}, capture_stdout=True
        )
        assert done.stdout.decode().strip() == "loopd stopped"
        with trio.fail_after(30):
            while alive(pid):  # noqa: ASYNC110 - another process: nothing to wait on but its pid
                await trio.sleep(0.1)
    finally:
        await tmux.close()
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)  # a failed run leaves no loopd (or llama-server) behind
        shutil.rmtree(home, ignore_errors=True)


async def test_think_off_is_the_sessions_mode_shown_by_mode_and_kept_across_a_restart(
    daemon: StartDaemon,
) -> None:
    d = await daemon(FakeLlama([]))
    console = Console(record=True, width=100)
    connection = await Connection.open(d.socket)
    session = await connection.hello("new")
    await _think(["maybe"], connection, console)  # refused, and said why
    await _think(["off"], connection, console)
    await _mode([], connection, console)
    await connection.aclose()
    await d.stop()
    await d.start()
    connection = await Connection.open(d.socket)
    await connection.hello(session)
    await _think([], connection, console)
    await connection.aclose()
    said = console.export_text().splitlines()
    assert said == [
        "/think on, /think off, or /think alone (whether turns think)",
        "thinking: off (mode ask)",
        "mode: ask (thinking off)",
        "thinking: off (mode ask)",
    ]


def test_an_answer_cut_in_a_loop_says_so() -> None:
    view = TurnView()
    view.feed(Event(id="t", event=Content(text="She loves her cat. " * 3)))
    view.feed(Event(id="t", event=Repeating(period=19, span=2000)))
    assert "said the same 19 characters over and over (2000 characters): cut" in render(view)


async def test_chat_works_in_its_folder_or_in_none_where_loopd_refuses_it(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    here = tmp_path / "project"
    here.mkdir()
    d = await daemon(FakeLlama([Reply(content="Seen.")] * 2), tools=f'roots = ["{here}"]')
    logs = Store(d.home / "sessions")
    for folder, cwd in ((here, str(here)), (tmp_path, None)):  # tmp_path: outside the roots
        code, out, _ = await bxctl(d, "chat", "-m", "where am I?", cwd=folder)
        assert (code, out) == (0, "Seen.\n")
        made = logs.latest()
        assert made is not None
        assert logs.read(made)[0].cwd == cwd


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_fork_and_rewind_in_the_live_chat_go_on_in_the_fork(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([Reply(content=f"answer-{n}") for n in range(3)]))
    tmux = Tmux(f"fork-{id(d):x}")
    await tmux.chat(d, tmp_path / "state")
    try:
        parent = re.findall(r"session (\S+)", await tmux.wait_for("/help for help"))[0]
        for n, text in enumerate(("message-one", "message-two")):
            await tmux.keys(text, "Enter")
            await tmux.wait_for(f"answer-{n}")
        await tmux.keys("/fork 3", "Enter")
        await tmux.wait_for("there is no turn 3")
        await tmux.keys("/fork 1", "Enter")
        screen = await tmux.wait_for_words(f"the fork of session {parent} at turn 1")
        fork = re.findall(r"session (\S+): the fork of", screen)[0]
        await tmux.keys("message-three", "Enter")
        await tmux.wait_for("answer-2")
        await tmux.keys("/rewind", "Enter")
        await tmux.wait_for("  2. message-three")
        await tmux.keys("/rewind 1", "Enter")
        screen = await tmux.wait_for_words(f"the fork of session {fork} at turn 1")
        rewound = re.findall(rf"session (\S+): the fork of session {fork} at turn 1", screen)[0]
    finally:
        await tmux.close()
    store = Store(d.home / "sessions")
    said = [r.content for r in store.read(fork)[1] if isinstance(r, UserRecord)]
    assert said == ["message-one", "message-three"]
    said = [r.content for r in store.read(rewound)[1] if isinstance(r, UserRecord)]
    assert said == ["message-one"]


def test_no_start_help_says_what_chat_and_acp_do_with_no_loopd(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`chat` exits, `acp` stays up answering -32010 (as test_acp's no-start tests show)."""
    for command, says in (
        ("chat", "but say so and exit with status 5"),
        ("acp", "but stay up and answer each request that needs loopd with the error -32010"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert says in " ".join(capsys.readouterr().out.split())


def test_the_config_file_in_effect_is_the_named_one_else_the_xdg_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What hints name: `--config`, else `$LOOPD_CONFIG`, else `$XDG_CONFIG_HOME/loopd`'s."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("LOOPD_CONFIG", raising=False)
    assert config_file() == tmp_path / "xdg" / "loopd" / "config.toml"
    monkeypatch.setenv("LOOPD_CONFIG", str(tmp_path / "env.toml"))
    assert config_file() == tmp_path / "env.toml"
    assert config_file(tmp_path / "named.toml") == tmp_path / "named.toml"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (`.ci/run` installs it)")
async def test_the_greeting_names_the_config_file_in_effect(
    daemon: StartDaemon, tmp_path: Path
) -> None:
    d = await daemon(FakeLlama([]))  # its model is the bundled one's: the greeting says so
    tmux = Tmux(f"config-{id(d):x}")
    await tmux.chat(d, tmp_path / "state")  # bxctl --config FILE chat
    try:
        words = await tmux.wait_for_words("(docs/operations.md)")
    finally:
        await tmux.close()
    assert f"[server]urlin{d.config}(docs" in "".join(words.split())  # a path wraps anywhere


def test_rewind_takes_turns_from_1() -> None:
    """`/rewind 0` (chat and editor) is its usage, not loopd's refusal of a bad request."""
    assert rewind.parse(["0"]) is None
    assert rewind.parse(["0", "files"]) is None
    assert rewind.parse(["1", "files"]) == (1, True)
