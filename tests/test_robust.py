"""Nothing a model or a tool does stops or freezes loopd: a real `loopd serve` on a scripted
llama-server, real files under its roots, and a secret beside them that must never reach a
request."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import NO_SLOT_FILES
from loopd.session.records import ToolResultRecord, conversation_problems
from loopd.session.store import Store
from loopd.tools import MAX_ARGUMENT_BYTES
from loopd.turn.calls import loggable
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

SECRET = "TOP-SECRET-4c1d"  # noqa: S105 - a marker, not a password
TOOL_TIMEOUT = 3


def files(home: Path) -> Path:
    """The one root loopd may read, with links that point out of it at a secret."""
    notes, outside = home / "notes", home / "outside"
    (notes / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.md").write_text(f"{SECRET}\n")
    (notes / "today.md").write_text("# Today\nbuy milk\n" + "a" * 60 + "b\n")
    (notes / "sub" / "deep.md").write_text("nothing here\n")
    (notes / "link.md").symlink_to(outside / "secret.md")
    (notes / "away").symlink_to(outside)
    return notes


def daemon_for(home: Path, url: str) -> Daemon:
    d = Daemon(home, url, slots=NO_SLOT_FILES)
    notes = files(home)
    d.config.write_text(
        d.config.read_text()
        + f'[tools]\nroots = ["{notes}"]\ntimeout = {TOOL_TIMEOUT}\n[loop]\ntool_iterations = 4\n'
    )
    return d


@dataclass
class Scripted:
    daemon: Daemon
    fake: FakeLlama
    server: ReplayServer

    def results(self) -> list[str]:
        store = Store(self.daemon.home / "sessions")
        records = store.read(store.latest() or "")[1]
        return [r.content for r in records if isinstance(r, ToolResultRecord)]

    def problems(self) -> list[str]:
        store = Store(self.daemon.home / "sessions")
        return conversation_problems(list(store.read(store.latest() or "")[1]))


@pytest.fixture
async def scripted(
    tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[Callable[[], Awaitable[Scripted]]]:
    started: list[Daemon] = []

    async def start() -> Scripted:
        fake = FakeLlama([])
        server = ReplayServer([fake] * 100)
        await nursery.start(server.run)
        d = daemon_for(tmp_path / "loopd", server.url)
        await d.start()
        started.append(d)
        return Scripted(d, fake, server)

    yield start
    for d in started:
        await d.end()


def call_tool(tool: str, **arguments: Any) -> str:
    return json.dumps({"name": tool, "arguments": arguments})


async def status(client: LineClient) -> dict[str, Any]:
    await client.send({"type": "status"})
    return (await client.until("status", timeout=5))[-1]


async def test_deeply_nested_or_huge_arguments_end_the_call_not_loopd(
    scripted: Callable[[], Awaitable[Scripted]],
) -> None:
    s = await scripted()
    deep = "[" * 100_000 + "]" * 100_000
    deep_inside = '{"name": "read_file", "arguments": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001
    huge = call_tool("read_file", path="x" * MAX_ARGUMENT_BYTES)
    calls = (("c1", "call_tool", deep), ("c2", "call_tool", deep_inside), ("c3", "call_tool", huge))
    s.fake.replies += [Reply(tool_calls=calls), Reply(content="ok")]
    client = await s.daemon.connect()
    done = await client.turn("t1", "go")
    assert done[-1]["type"] == "turn_done"
    nested, nested_inside, too_big = s.results()
    assert nested == "The arguments of call_tool nest objects or lists more than 64 deep."
    assert nested_inside == nested
    assert too_big == (
        f"The arguments of call_tool are {len(huge)} bytes; at most {MAX_ARGUMENT_BYTES} are read."
    )
    assert (await status(client))["type"] == "status"
    assert s.problems() == []


async def test_a_catastrophic_regex_ends_at_the_timeout_and_loopd_answers_meanwhile(
    scripted: Callable[[], Awaitable[Scripted]],
) -> None:
    s = await scripted()
    calls = (
        # Hours of backtracking in `re`; `regex` sees through it.
        ("c1", "call_tool", call_tool("search_text", pattern="^(a+)+$", regex=True)),
        # Exponential in `regex` too: its timeout ends it.
        ("c2", "call_tool", call_tool("search_text", pattern="^(a|aa)+$", regex=True)),
    )
    s.fake.replies += [Reply(tool_calls=calls), Reply(content="ok")]
    alice, bob = await s.daemon.connect(), await s.daemon.connect()
    await alice.send({"type": "send", "id": "t1", "content": "search"})
    started = 0
    while started < 2:  # the second call is running
        line = (await alice.until("event"))[-1]
        started += line["event"]["kind"] == "tool_call_started"
    with trio.fail_after(TOOL_TIMEOUT - 1):  # answered before the tool's deadline
        assert (await status(bob))["busy"]
    done = await alice.until("turn_done", timeout=TOOL_TIMEOUT + 10)
    assert done[-1]["type"] == "turn_done"
    found, stopped = s.results()
    assert found == "No line under . matches '^(a+)+$'."
    # The port's deadline and the search's own (which ends its thread) are the same moment.
    assert stopped in (
        "The tool failed: search_text did not finish within 3 s and was stopped",
        (
            "The tool failed: searching for '^(a|aa)+$' took too long ([tools] timeout); "
            "a simpler pattern or a narrower path will do"
        ),
    )


# What a model might send: any JSON, text that is not JSON, deep nesting, huge strings, tools
# that do not exist, and paths that try to leave the root.
paths = st.sampled_from(
    [".", "today.md", "sub", "../outside/secret.md", "/etc/passwd", "link.md", "away",
     "away/secret.md", "sub/../../outside/secret.md", "~/secret.md", "", "\x00", "today.md/x"]
)  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
file_calls = st.builds(
    lambda tool, path, extra: call_tool(tool, path=path, **extra),
    st.sampled_from(["read_file", "list_directory", "search_text", "no_such_tool"]),
    paths,
    st.fixed_dictionaries({}, optional={"pattern": st.text(max_size=8), "regex": st.booleans()}),
)
arguments = st.one_of(
    file_calls,
    file_calls,
    json_values.map(json.dumps),
    st.text(max_size=50),
    # Big ones by name, made in the test: hypothesis would print them whole.
    st.sampled_from(["<deep 64>", "<deep 65>", "<deep 200000>", "<huge>"]),
)


def expand(arguments: str) -> str:
    if arguments.startswith("<deep "):
        n = int(arguments[6:-1])
        return "[" * n + "]" * n
    if arguments == "<huge>":
        return call_tool("read_file", path="a" * MAX_ARGUMENT_BYTES)
    return arguments


model_calls = st.lists(
    st.tuples(st.sampled_from(["call_tool", "find_tool", "read_file", "x"]), arguments),
    min_size=1,
    max_size=3,
)


class Running:
    """A scripted llama-server on a thread of its own, so that every hypothesis example can
    talk to the same `loopd serve` from its own `trio.run`. Not a dataclass: hypothesis
    prints each example's arguments, a dataclass field by field, and the scripted server's
    every request body and its list of 100,000 exchanges would take gigabytes."""

    def __init__(self, fake: FakeLlama, server: ReplayServer, daemon: Daemon) -> None:
        self.fake, self.server, self.daemon = fake, server, daemon

    def __repr__(self) -> str:
        return f"Running(loopd at {self.daemon.socket})"


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    fake = FakeLlama([])
    server = ReplayServer([fake] * 100_000)
    stop = trio.CancelScope()
    ready = threading.Event()
    token: list[trio.lowlevel.TrioToken] = []

    async def serve() -> None:
        token.append(trio.lowlevel.current_trio_token())
        with stop:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    assert ready.wait(10)
    daemon = daemon_for(tmp_path_factory.mktemp("robust"), server.url)
    try:
        trio.run(daemon.start)
        yield Running(fake, server, daemon)
    finally:
        trio.run(daemon.kill)
        trio.from_thread.run_sync(stop.cancel, trio_token=token[0])
        thread.join(10)


@settings(
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(calls=model_calls)
def test_any_call_a_model_sends_ends_with_a_result_and_loopd_keeps_answering(
    running: Running, calls: list[tuple[str, str]]
) -> None:
    async def play() -> None:
        running.fake.replies = [
            Reply(tool_calls=tuple((f"c{i}", n, expand(a)) for i, (n, a) in enumerate(calls))),
            Reply(content="done"),
        ]
        client = await LineClient.connect(running.daemon.socket)
        try:
            # A session each: the history sent with every request stays small.
            await client.send({"type": "new_session"})
            await client.until("welcome")
            end = (await client.turn("t", "go", timeout=30))[-1]
            # A limit may end it (three identical calls); loopd itself never fails it.
            assert end["type"] == "turn_done" or end["kind"] == "turn_limit", end
            with trio.fail_after(2):
                assert not (await status(client))["busy"]
        finally:
            await client.aclose()

    running.server.requests.clear()
    trio.run(play)
    for request in running.server.requests:
        assert SECRET not in json.dumps(request["body"])
    store = Store(running.daemon.home / "sessions")
    assert conversation_problems(list(store.read(store.latest() or "")[1])) == []


client_lines = st.lists(
    st.one_of(
        st.binary(max_size=60),
        st.text(max_size=60).map(str.encode),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["hello", "send", "cancel", "status", "history", "subscribe",
                                      "sessions", "bogus"])},
            optional={"id": st.text(max_size=5) | st.integers(), "content": st.text(max_size=10),
                      "protocol": st.integers(), "start": st.integers() | st.text(max_size=3)},
        ).map(lambda m: json.dumps(m).encode()),
    ),
    max_size=6,
)  # fmt: skip


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(lines=client_lines)
def test_any_lines_a_client_sends_leave_loopd_answering(
    running: Running, lines: list[bytes]
) -> None:
    async def play() -> None:
        running.fake.replies = [Reply(content="ok")] * 6
        rude = await LineClient.connect(running.daemon.socket)
        with contextlib.suppress(trio.BrokenResourceError):
            for line in lines:
                await rude.send(line.replace(b"\n", b" "))
        await rude.aclose()
        polite = await LineClient.connect(running.daemon.socket)
        try:
            with trio.fail_after(30):  # a turn the rude client started may run first
                assert (await status(polite))["type"] == "status"
        finally:
            await polite.aclose()

    trio.run(play)


async def test_a_file_name_that_is_not_utf8_is_listed_and_found(
    scripted: Callable[[], Awaitable[Scripted]],
) -> None:
    """Python reads such a name with a lone surrogate for its byte, which no log line and no
    request can hold: the turn goes on, the byte written as its escape."""
    s = await scripted()
    notes = os.fsencode(s.daemon.home / "notes")
    await trio.Path(os.fsdecode(notes + b"/caf\xe9.md")).write_text("buy bread\n")
    calls = (
        ("c1", "call_tool", call_tool("list_directory", path=".")),
        ("c2", "call_tool", call_tool("search_text", pattern="bread")),
    )
    s.fake.replies += [Reply(tool_calls=calls), Reply(content="ok")]
    client = await s.daemon.connect()
    done = await client.turn("t1", "go")
    assert done[-1]["type"] == "turn_done", done[-1]
    listed, found = s.results()
    assert "caf\\xe9.md (10 bytes)" in listed.splitlines()
    assert found == "caf\\xe9.md:1: buy bread"
    assert s.problems() == []


@given(st.text(st.characters(exclude_categories=())))
def test_any_text_a_tool_returns_can_be_written(text: str) -> None:
    kept = loggable(text)
    kept.encode()  # a lone surrogate would raise here
    if all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert kept == text
