"""MCP servers a client gives one session (`tools.given_tools`): a real server
(tests/support/mcp_server.py) offered to that session's port handle alone, stopped with it; a
name already taken refused; a server that cannot start leaves the session's tools working."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from loopd.config import McpServer, Policy, ToolsConfig
from loopd.session.records import GivenServer, McpServersRecord
from loopd.session.transcript import transcript
from loopd.tools import Failed, Registry, Result, ToolEntry, dispatch, given_tools, open_tool_port
from loopd.tools._dispatch import Local
from loopd.wire.proto import McpServer as Given
from support.ports import never_asked
from test_tools_mcp import SERVER, request

ALLOWED = {"notes": Policy(action="allow")}


def given(name: str, pid_file: Path, command: str = sys.executable) -> Given:
    return Given(name=name, command=[command, SERVER], env={"NOTES_PID_FILE": str(pid_file)})


async def gone(pid: int) -> bool:
    """The process has ended and been reaped, within a few seconds."""
    with trio.move_on_after(10):
        while await trio.Path(f"/proc/{pid}").exists():  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.05)
        return True
    return False


async def test_a_given_server_answers_its_session_and_no_other_and_stops_with_it(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "pid"
    async with open_tool_port(ToolsConfig(timeout=10, policies=ALLOWED)) as port:
        config = ToolsConfig(timeout=10, policies=ALLOWED)
        async with (
            given_tools(port, config, [given("notes", pid_file)]) as (mine, record),
            given_tools(port, config, []) as (other, _),
        ):
            assert record == (GivenServer(name="notes", command=(sys.executable, SERVER)),)
            assert "notes.read_note" in mine.registry.names()
            answer = await mine.call(request("notes.read_note", title="todo"), never_asked)
            assert answer.answer == Result("write the tests", "public", False)
            for elsewhere in (port, other):
                assert "notes.read_note" not in elsewhere.registry.names()
                found = dispatch(elsewhere.registry, "find_tool", '{"query": "read my notes"}')
                assert isinstance(found, Local)
                assert "notes." not in found.text
                refused = dispatch(elsewhere.registry, "call_tool", '{"name": "notes.list_notes"}')
                assert isinstance(refused, Local)
                assert "There is no tool named 'notes.list_notes'" in refused.text
                # Even a call that got past the dispatch finds nothing to run there.
                call = await elsewhere.call(request("notes.list_notes"), never_asked)
                assert call.answer == Failed("the tool notes.list_notes is no longer there")
            pid = int(pid_file.read_text())
        assert await gone(pid)
        assert isinstance((await port.call(request("current_time"), never_asked)).answer, Result)


async def test_a_given_servers_tools_ask_unless_the_users_policies_say_otherwise(
    tmp_path: Path,
) -> None:
    servers = [given("notes", tmp_path / "pid")]
    for policies, action in (({}, "ask"), (ALLOWED, "allow")):
        config = ToolsConfig(timeout=10, policies=policies)
        async with open_tool_port(config) as port, given_tools(port, config, servers) as (mine, _):
            entry = mine.registry.get("notes.read_note")
            assert entry is not None
            assert entry.policy.action == action


async def test_a_name_already_taken_is_refused_and_not_started(tmp_path: Path) -> None:
    configured = McpServer(command=[str(tmp_path / "not-started")])
    config = ToolsConfig(timeout=10, mcp={"notes": configured})
    servers = [
        given("notes", tmp_path / "a"),
        given("builtin", tmp_path / "b"),
        given("mine", tmp_path / "c"),
        given("mine", tmp_path / "d"),
    ]
    async with open_tool_port(config) as port, given_tools(port, config, servers) as (_, got):
        assert [s.refused for s in got] == [
            "[tools] mcp has a server named notes",
            "loopd's own tools come from a source named builtin",
            None,
            "an earlier server of the same list is named mine",
        ]
        assert [p.name for p in await trio.Path(tmp_path).iterdir() if p.name in "abcd"] == ["c"]
    lines = [line.plain for line in transcript([McpServersRecord(servers=got)])]  # bxctl log
    command = f"{sys.executable} {SERVER}"
    assert lines[0] == (
        f"  MCP server notes for this session: {command} "
        "(not started: [tools] mcp has a server named notes)"
    )
    assert lines[2] == f"  MCP server mine for this session: {command}"


async def test_a_given_server_that_cannot_start_leaves_the_session_working(
    tmp_path: Path,
) -> None:
    config = ToolsConfig(timeout=10)
    broken = [given("broken", tmp_path / "pid", command=str(tmp_path / "no-such-server"))]
    async with open_tool_port(config) as port, given_tools(port, config, broken) as (mine, got):
        assert got[0].refused is None  # it was tried
        assert not [n for n in mine.registry.names() if n.startswith("broken.")]
        assert isinstance((await mine.call(request("current_time"), never_asked)).answer, Result)
    assert not await trio.Path(tmp_path / "pid").exists()


def test_a_registry_over_another_offers_both_and_sees_the_others_changes() -> None:
    def entry(name: str, source: str) -> ToolEntry:
        return ToolEntry(name, f"{name} things", f"{name} things", {}, source, Policy())

    shared = Registry([entry("read_file", "builtin")])
    own = Registry(base=shared)
    own.set_source("notes", [entry("notes.read_note", "notes")])
    assert own.names() == ["notes.read_note", "read_file"]
    assert {e.name for e in own.search("read things", 5)} == {"notes.read_note", "read_file"}
    shared.set_source("web", [entry("web.read_page", "web")])
    assert "web.read_page" in [e.name for e in own.search("read things", 5)]
    assert shared.names() == ["read_file", "web.read_page"]
    assert own.sources() == {"builtin", "notes", "web"}
    own.set_source("builtin", [entry("read_file", "builtin-shadow")])
    assert own.get("read_file") == entry("read_file", "builtin")  # loopd's own wins


async def test_an_error_of_the_session_stops_its_servers_and_passes_as_it_came(
    tmp_path: Path,
) -> None:
    """The session's actor failing (its registry catches `SessionFailed` by its type)."""
    pid_file = tmp_path / "pid"
    config = ToolsConfig(timeout=10)
    async with open_tool_port(config) as port:
        with pytest.raises(KeyError, match="the session failed"):
            async with given_tools(port, config, [given("notes", pid_file)]):
                raise KeyError("the session failed")
    assert await gone(int(pid_file.read_text()))
