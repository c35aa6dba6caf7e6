"""A real MCP server (tests/support/mcp_server.py, the official SDK) as a tool source:
listed, called, killed, and called again; and a server that cannot start."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopd.config import McpServer, Policy, ToolsConfig
from loopd.tools import (
    Approval,
    Asking,
    CallOrigin,
    Failed,
    Result,
    ToolRequest,
    answer_call,
    dispatch,
    open_tool_port,
)
from loopd.tools._dispatch import Local
from loopd.tools._mcp import Down, McpSource, State
from support.ports import never_asked
from test_tools_dispatch import schema_values

SERVER = str(Path(__file__).resolve().parent / "support" / "mcp_server.py")


def config(tmp_path: Path, **servers: McpServer) -> ToolsConfig:
    return ToolsConfig(roots=[tmp_path], timeout=5, mcp=servers)


def notes(pid_file: Path, **policy: object) -> McpServer:
    """The notes server, its tools allowed unless `policy` says otherwise: these tests are of
    the server's life, and an MCP server's tools ask by default."""
    return McpServer(
        command=[sys.executable, SERVER],
        env={"NOTES_PID_FILE": str(pid_file)},
        policy=Policy.model_validate({"action": "allow", **policy}),
    )


def request(tool: str, **arguments: object) -> ToolRequest:
    return ToolRequest(session="s", call=1, tool=tool, arguments=arguments)


async def test_an_mcp_servers_tools_join_the_registry_and_answer(tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    cfg = config(tmp_path, notes=notes(pid, **{"class": "private", "untrusted": True}))
    async with open_tool_port(cfg) as port:
        assert "notes.read_note" in port.registry.names()
        found = dispatch(port.registry, "find_tool", '{"query": "read one of my notes"}')
        assert isinstance(found, Local)
        assert found.text.splitlines()[1].startswith("1. notes.read_note: Read one of the user")
        answer = (
            await port.call(request("notes.read_note", title="groceries"), never_asked)
        ).answer
        assert answer == Result("eggs, milk, bread", "private", True)


async def test_an_mcp_servers_tool_asks_before_it_runs_by_default(tmp_path: Path) -> None:
    """As in other agents, a server's tool runs only once a person approves it; `session`
    approves that tool for the rest of the session."""
    server = McpServer(command=[sys.executable, SERVER])
    asked: list[Asking] = []
    async with open_tool_port(config(tmp_path, notes=server)) as port, trio.open_nursery() as n:

        async def on_asking(asking: Asking) -> None:
            asked.append(asking)
            n.start_soon(port.decide, "s", asking.call, "session")

        answered = await port.call(request("notes.list_notes"), on_asking)
    assert [a.tool for a in asked] == ["notes.list_notes"]
    assert answered.answer == Result("groceries\ntodo", "public", False)
    assert answered.approval == Approval("notes.list_notes", "session", "user")


@pytest.mark.parametrize(
    "table",
    ['[tools.policies."notes.list_notes"]', "[tools.policies.notes]", "[tools.mcp.notes] policy"],
)
async def test_an_mcp_servers_tool_the_config_allows_runs_unasked(
    tmp_path: Path, table: str
) -> None:
    server: dict[str, object] = {"command": [sys.executable, SERVER]}
    tools: dict[str, object] = {"roots": [str(tmp_path)], "timeout": 5, "mcp": {"notes": server}}
    allow = {"action": "allow"}
    if table.startswith("[tools.policies"):
        tools["policies"] = {table.removeprefix("[tools.policies.").strip('"]'): allow}
    else:
        server["policy"] = allow
    async with open_tool_port(ToolsConfig.model_validate(tools)) as port:
        answered = await port.call(request("notes.list_notes"), never_asked)
    assert answered.answer == Result("groceries\ntodo", "public", False)


async def test_an_mcp_tool_error_is_failed(tmp_path: Path) -> None:
    async with open_tool_port(config(tmp_path, notes=notes(tmp_path / "pid"))) as port:
        answer = (await port.call(request("notes.read_note", title="diary"), never_asked)).answer
    assert isinstance(answer, Failed)
    assert "diary" in answer.message


async def test_a_hanging_mcp_call_times_out_and_the_server_still_answers(tmp_path: Path) -> None:
    cfg = config(tmp_path, notes=notes(tmp_path / "pid")).model_copy(update={"timeout": 0.5})
    async with open_tool_port(cfg) as port:
        answer = (await port.call(request("notes.wait", seconds=30), never_asked)).answer
        assert answer == Failed("notes.wait did not finish within 0.5 s and was stopped")
        assert (await port.call(request("notes.list_notes"), never_asked)).answer == Result(
            "groceries\ntodo", "public", False
        )


async def test_a_killed_server_is_reported_then_started_again(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    async with open_tool_port(config(tmp_path, notes=notes(pid_file))) as port:
        assert isinstance(
            (await port.call(request("notes.list_notes"), never_asked)).answer, Result
        )
        first_pid = int(pid_file.read_text())
        os.kill(first_pid, signal.SIGKILL)

        answer = (await port.call(request("notes.list_notes"), never_asked)).answer
        assert isinstance(answer, Failed)
        assert "MCP server notes stopped" in answer.message
        assert all(not e.available for e in port.registry.entries() if e.source == "notes")

        again = (await port.call(request("notes.list_notes"), never_asked)).answer
        assert again == Result("groceries\ntodo", "public", False)
        assert int(pid_file.read_text()) != first_pid
        assert all(e.available for e in port.registry.entries() if e.source == "notes")


async def test_a_server_that_cannot_start_leaves_the_rest_working(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = McpServer(command=[str(tmp_path / "no-such-server")])
    async with open_tool_port(config(tmp_path, broken=broken)) as port:
        assert not [n for n in port.registry.names() if n.startswith("broken.")]
        assert isinstance((await port.call(request("current_time"), never_asked)).answer, Result)
    assert "MCP server broken did not start" in caplog.text


async def test_a_bug_in_an_mcp_sources_supervisor_restarts_it_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor fails as it marks the killed server down: it is started again at once."""
    become = McpSource._become
    failed = False

    def broken(source: McpSource, state: State) -> None:
        nonlocal failed
        if isinstance(state, Down) and not failed:
            failed = True
            raise KeyError("a bug")
        become(source, state)

    monkeypatch.setattr(McpSource, "_become", broken)
    pid_file = tmp_path / "pid"
    async with open_tool_port(config(tmp_path, notes=notes(pid_file))) as port:
        assert isinstance(
            (await port.call(request("notes.list_notes"), never_asked)).answer, Result
        )
        first_pid = int(pid_file.read_text())
        os.kill(first_pid, signal.SIGKILL)
        answer = (await port.call(request("notes.list_notes"), never_asked)).answer
        assert isinstance(answer, Failed)
        assert "MCP server notes stopped" in answer.message
        again = (await port.call(request("notes.list_notes"), never_asked)).answer
        assert again == Result("groceries\ntodo", "public", False)
        assert int(pid_file.read_text()) != first_pid
    assert failed
    assert (
        "the supervisor of MCP server notes failed, and starts again (1 of 5 restarts within 60 s)"
        in caplog.text
    )


async def test_an_mcp_source_that_keeps_failing_stops_alone_and_its_calls_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every start after the first trips a bug: past its bound the source stops, and loopd's
    other tools go on."""
    run_once = McpSource._run_once
    lives = 0

    async def broken(source: McpSource, failures: int) -> int:
        nonlocal lives
        lives += 1
        if lives > 1:
            raise KeyError("a bug")
        return await run_once(source, failures)

    monkeypatch.setattr(McpSource, "_run_once", broken)
    pid_file = tmp_path / "pid"
    async with open_tool_port(config(tmp_path, notes=notes(pid_file))) as port:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert isinstance(
            (await port.call(request("notes.list_notes"), never_asked)).answer, Failed
        )
        answer = (await port.call(request("notes.list_notes"), never_asked)).answer
        assert answer == Failed(
            "MCP server notes is stopped: the supervisor of MCP server notes failed 6 times "
            "within 60 s, the last time with KeyError: 'a bug'; loopd goes on without it"
        )
        assert isinstance((await port.call(request("current_time"), never_asked)).answer, Result)
    assert lives == 7


SCHEMA_SERVER = str(Path(__file__).resolve().parent / "support" / "schema_server.py")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # The SDK insists on "type": "object" at the top; below it, anything.
    schema=st.fixed_dictionaries(
        {"type": st.just("object")},
        optional={
            "properties": st.dictionaries(
                st.sampled_from(["a", "b"]),
                schema_values | st.sampled_from([{"$ref": "#/$defs/nope"}, {"$ref": "#/"}]),
                max_size=2,
            ),
            "required": schema_values,
            "$defs": schema_values,
            "additionalProperties": schema_values,
        },
    ),
    arguments=st.sampled_from(['{"a": 1}', '{"b": "x"}', "{}"]) | schema_values.map(json.dumps),
)
def test_a_real_mcp_server_with_any_schema_leaves_the_model_a_text(
    schema: dict[str, object], arguments: str
) -> None:
    """Schemas as a server sends them, through the SDK's client: whatever they are, a call
    gives the model a text (a result, what was wrong, or that the tool is not there)."""
    server = McpServer(
        command=[sys.executable, SCHEMA_SERVER],
        env={"TOOL_SCHEMA": json.dumps(schema)},
        policy=Policy(action="allow"),
    )

    async def play() -> str:
        async with open_tool_port(ToolsConfig(timeout=5, mcp={"s": server})) as port:
            call = '{"name": "s.t", "arguments": ' + arguments + "}"
            answer = await answer_call(
                port.registry,
                port,
                "call_tool",
                call,
                CallOrigin("s", 1),
                find_limit=5,
                on_asking=never_asked,
            )
            return answer.text

    assert trio.run(play)
