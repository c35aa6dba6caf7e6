"""MCP servers at a URL: a real server of the official SDK (tests/support/mcp_http_server.py)
in its own process, over streamable HTTP or SSE, behind a bearer token; as a `[tools.mcp]`
server and as an editor's, its tool called by the scripted model through a real `loopd
serve`; killed and started again; and the config's mistakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from conftest import Unstarted
from loopd.cli import main
from loopd.config import ConfigError, McpServer, ToolsConfig, load_config
from loopd.server_proc import free_port
from loopd.session.records import GivenServer, McpServersRecord, ToolResultRecord
from loopd.tools import Registry, Result, open_tool_port
from loopd.tools._mcp import Down, McpSource
from loopd.wire import proto
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.ports import never_asked
from test_acp import StartDaemon, raw_acp
from test_hands import call
from test_sessions import records
from test_tools_mcp import request

SERVER = str(Path(__file__).resolve().parent / "support" / "mcp_http_server.py")
TOKEN = "tok-4f9c2e7a1b"  # noqa: S105 - made up, for finding it where it must not be
PATHS = {"http": "/mcp", "sse": "/sse"}


class Remote:
    """The test's MCP server at a URL, started (again) on the same port."""

    def __init__(self, transport: str, log: Path) -> None:
        self.transport, self.log = transport, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{PATHS[transport]}"
        self.process: trio.Process | None = None

    async def start(self) -> None:
        with self.log.open("a") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, SERVER, self.transport, str(self.port)],
                env={"REMOTE_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        with trio.fail_after(30):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                except OSError:
                    await trio.sleep(0.05)
                else:
                    await stream.aclose()
                    return

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()


async def remote_server(tmp_path: Path, transport: str) -> AsyncIterator[Remote]:
    remote = Remote(transport, tmp_path / f"remote-{transport}.log")
    await remote.start()
    try:
        yield remote
    finally:
        await remote.kill()


@pytest.fixture
async def remote(tmp_path: Path) -> AsyncIterator[Remote]:
    async for server in remote_server(tmp_path, "http"):
        yield server


@pytest.fixture
async def sse_remote(tmp_path: Path) -> AsyncIterator[Remote]:
    async for server in remote_server(tmp_path, "sse"):
        yield server


def shout(text: str, call_id: str = "c1") -> Reply:
    return call("remote.shout", {"text": text}, call_id)


def config_server(url: str, **more: str) -> str:
    """The `[tools]` lines of a config server at `url`, its tool allowed: these tests are of
    its connection, with no person to approve the calls."""
    lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in more.items())
    return (
        f'[tools.mcp.remote]\nurl = "{url}"\nbearer_token_env = "REMOTE_TOKEN"\n{lines}'
        'policy = { action = "allow" }\n'
    )


def remote_config(url: str) -> McpServer:
    """The server at `url` as a `[tools.mcp]` table, its tool allowed."""
    allowed = {"action": "allow"}
    return McpServer.model_validate(
        {"url": url, "bearer_token_env": "REMOTE_TOKEN", "policy": allowed}
    )


async def remote_daemon(daemon: StartDaemon, tmp_path: Path, fake: FakeLlama, url: str) -> Daemon:
    tools = f'roots = ["{tmp_path}"]\n' + config_server(url)
    return await daemon(fake, tools=tools, env={**os.environ, "REMOTE_TOKEN": TOKEN})


def results(d: Daemon, session: str) -> list[str]:
    return [r.content for r in records(d, session) if isinstance(r, ToolResultRecord)]


def session_log(d: Daemon, session: str) -> str:
    return (d.home / "sessions" / f"{session}.jsonl").read_text()


async def new_session(d: Daemon) -> tuple[LineClient, str]:
    """A client of `d` in a new session, and the session's id."""
    client = await d.connect()
    await client.send({"type": "hello", "session": "new"})
    return client, str((await client.until("welcome"))[-1]["session"])


async def turn(client: LineClient, turn_id: str) -> None:
    got = await client.turn(turn_id, "shout")
    assert got[-1]["type"] == "turn_done", got[-1]


async def test_a_config_server_at_a_url_serves_the_model_and_its_token_is_never_written(
    daemon: StartDaemon, tmp_path: Path, remote: Remote
) -> None:
    """The token goes in the requests (the server answers 401 without it), and neither
    loopd's log nor the session's holds it."""
    d = await remote_daemon(
        daemon, tmp_path, FakeLlama([shout("hello"), Reply(content="Said.")]), remote.url
    )
    client, session = await new_session(d)
    await turn(client, "t1")
    assert results(d, session) == ["HELLO!"]
    assert "MCP server remote connected: 1 tools" in d.log.read_text()
    assert TOKEN not in d.log.read_text()
    assert TOKEN not in session_log(d, session)


async def test_a_server_at_a_url_killed_is_unavailable_and_answers_once_it_is_back(
    daemon: StartDaemon, tmp_path: Path, remote: Remote
) -> None:
    script = [shout("one", "c1"), Reply(content="1.")]
    script += [shout("two", "c2"), Reply(content="2.")]  # the server killed
    script += [shout("three", "c3"), Reply(content="3.")]  # still down
    script += [shout("four", "c4"), Reply(content="4.")]  # back
    d = await remote_daemon(daemon, tmp_path, FakeLlama(script), remote.url)
    client, session = await new_session(d)
    await turn(client, "t1")
    await remote.kill()
    await turn(client, "t2")
    await turn(client, "t3")
    await remote.start()
    # The one failed try backs off 1 s at most (backoff.RESTART): past it, a call tries.
    await trio.sleep(1)
    await turn(client, "t4")
    one, two, three, four = results(d, session)
    assert one == "ONE!"
    assert two == (
        "The tool failed: MCP server remote went away (Connection closed); it is connected "
        "again on the next call"
    )
    assert three.startswith("The tool failed: MCP server remote is unavailable: ")
    assert four == "FOUR!"
    assert TOKEN not in d.log.read_text()


async def test_a_server_that_offers_only_sse_is_reached_over_sse(
    tmp_path: Path, sse_remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto`: the server refuses streamable HTTP (405), so loopd goes on over SSE."""
    monkeypatch.setenv("REMOTE_TOKEN", TOKEN)
    server = remote_config(sse_remote.url)
    async with open_tool_port(
        ToolsConfig(roots=[tmp_path], timeout=5, mcp={"remote": server})
    ) as p:
        answer = (await p.call(request("remote.shout", text="quietly"), never_asked)).answer
    assert answer == Result("QUIETLY!", "public", False)


async def test_a_server_at_a_url_that_refuses_the_token_is_down_saying_so(
    tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HTTP status it answered, where the SDK says only that it answered an error."""
    monkeypatch.setenv("REMOTE_TOKEN", "not-the-token")
    source = McpSource("remote", remote_config(remote.url), Registry(), ToolsConfig())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.supervise)
        await source.first_start.wait()
        state = source.state
        nursery.cancel_scope.cancel()
    assert isinstance(state, Down)
    assert state.why == f"Refused: {remote.url} answered HTTP 401 Unauthorized"


async def test_the_editors_server_at_a_url_serves_its_session_with_its_headers_kept_out_of_the_log(
    daemon: StartDaemon, tmp_path: Path, remote: Remote
) -> None:
    script = [shout("from the editor"), Reply(content="Said.")]
    allow = 'policies.remote = { action = "allow" }'
    d = await daemon(FakeLlama(script), tools=f'roots = ["{tmp_path}"]\n{allow}')
    headers = [{"name": "Authorization", "value": f"Bearer {TOKEN}"}]
    server = {"type": "http", "name": "remote", "url": remote.url, "headers": headers}
    acp = await raw_acp(d)
    try:
        init = await acp.answer(0, "initialize", {"protocolVersion": 1})
        new = {"cwd": str(tmp_path), "mcpServers": [server]}
        session = str((await acp.answer(1, "session/new", new))["result"]["sessionId"])
        params = {"sessionId": session, "prompt": [{"type": "text", "text": "shout"}]}
        done = await acp.answer(2, "session/prompt", params)
    finally:
        await acp.close()
    capabilities = init["result"]["agentCapabilities"]["mcpCapabilities"]
    assert capabilities["http"] is True
    assert capabilities["sse"] is True
    assert done["result"]["stopReason"] == "end_turn"
    assert results(d, session) == ["FROM THE EDITOR!"]
    given = [r for r in records(d, session) if isinstance(r, McpServersRecord)]
    assert [r.servers for r in given] == [(GivenServer(name="remote", url=remote.url),)]
    assert TOKEN not in d.log.read_text()
    assert TOKEN not in session_log(d, session)


async def test_the_editors_sse_server_is_reached_over_sse(
    daemon: StartDaemon, tmp_path: Path, sse_remote: Remote
) -> None:
    script = [shout("sse"), Reply(content="Said.")]
    allow = 'policies.remote = { action = "allow" }'
    d = await daemon(FakeLlama(script), tools=f'roots = ["{tmp_path}"]\n{allow}')
    headers = [{"name": "Authorization", "value": f"Bearer {TOKEN}"}]
    server = {"type": "sse", "name": "remote", "url": sse_remote.url, "headers": headers}
    acp = await raw_acp(d)
    try:
        new = {"cwd": str(tmp_path), "mcpServers": [server]}
        session = str((await acp.answer(1, "session/new", new))["result"]["sessionId"])
        params = {"sessionId": session, "prompt": [{"type": "text", "text": "shout"}]}
        await acp.answer(2, "session/prompt", params)
    finally:
        await acp.close()
    assert results(d, session) == ["SSE!"]


async def test_loopd_does_not_start_where_a_servers_token_variable_is_not_set(
    unstarted: Unstarted, tmp_path: Path
) -> None:
    d = await unstarted(FakeLlama([]), config_server("http://127.0.0.1:9/mcp"))
    env = {k: v for k, v in os.environ.items() if k != "REMOTE_TOKEN"}
    done = await trio.run_process(d.command("serve"), env=env, capture_stderr=True, check=False)
    assert done.returncode == 1
    assert "bearer_token_env names $REMOTE_TOKEN, which is not set" in done.stderr.decode()


def test_check_config_lists_a_server_at_a_url_and_never_its_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REMOTE_TOKEN", TOKEN)
    path = tmp_path / "loopd.toml"
    path.write_text(config_server("http://127.0.0.1:9/mcp"))
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# MCP server remote: http://127.0.0.1:9/mcp (streamable HTTP, else SSE)" in out
    assert TOKEN not in out


def test_check_config_exits_1_naming_a_token_variable_that_is_not_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REMOTE_TOKEN", raising=False)
    path = tmp_path / "loopd.toml"
    path.write_text(config_server("http://127.0.0.1:9/mcp"))
    assert main(["check-config", "--config", str(path)]) == 1
    assert (
        "# MCP server remote: cannot connect: [tools.mcp.remote] bearer_token_env names "
        "$REMOTE_TOKEN, which is not set"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        (
            'command = ["notes-mcp"]\nurl = "http://127.0.0.1:9/mcp"\n',
            "set command or url, not both",
        ),
        ('policy = { action = "allow" }\n', "set command (a program loopd runs over stdio) or url"),
        ('url = "127.0.0.1:9/mcp"\n', "'127.0.0.1:9/mcp' is not an http:// or https:// URL"),
        (
            'command = ["notes-mcp"]\nbearer_token_env = "T"\n',
            "transport, headers and bearer_token_env are for a server with a url",
        ),
    ],
)
def test_an_mcp_server_is_a_command_or_a_url(tmp_path: Path, lines: str, said: str) -> None:
    path = tmp_path / "loopd.toml"
    path.write_text(f"[tools.mcp.remote]\n{lines}")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert said in str(caught.value)


def test_a_servers_headers_are_not_in_its_repr() -> None:
    """Neither the config's table nor the wire's, which an editor's token comes in."""
    server = McpServer(url="http://127.0.0.1:9/mcp", headers={"X-Key": TOKEN})
    given = proto.McpServer(name="remote", url="http://127.0.0.1:9/mcp", headers={"X": TOKEN})
    assert TOKEN not in repr(server)
    assert TOKEN not in repr(given)
