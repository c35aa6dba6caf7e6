"""`fetch_url` through a real `loopd serve`, whose scripted model fetches pages of a real HTTP
server on 127.0.0.1 (the only network here): loopback is refused unless `[tools.fetch] allow`
names it, so each test that reads a page allows 127.0.0.1 in its own config."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import trio

from conftest import StartDaemon
from loopd.config import ConfigError, load_config
from loopd.session.records import ApprovalRequestRecord, ToolResultRecord
from loopd.session.store import Store
from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from test_bxctl import bxctl
from test_hands import call

PAGE = (
    b"<html><head><title>Notes</title><script>alert('x')</script></head><body>"
    b"<h1>Shopping</h1><p>buy <b>oat</b> milk, see <a href='/more'>more</a></p></body></html>"
)


@dataclass
class Web:
    """A local HTTP server: what it serves by path, and the paths it was asked for."""

    port: int
    asked: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _response(status: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join([*lines, "", ""])).encode() + body


async def serve_page(web: Web, stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
        data += chunk
    path = data.split(b" ")[1].decode() if data else ""
    web.asked.append(path)
    html = {"Content-Type": "text/html; charset=utf-8", "Connection": "close"}
    try:
        if path == "/page":
            await stream.send_all(
                _response("200 OK", html | {"Content-Length": str(len(PAGE))}, PAGE)
            )
        elif path == "/binary":
            blob = bytes(range(256))
            kind = {"Content-Type": "application/octet-stream", "Content-Length": "256"}
            await stream.send_all(_response("200 OK", kind, blob))
        elif path == "/huge":  # 64 MiB of it, unless the reader stops first
            await stream.send_all(_response("200 OK", {"Content-Type": "text/plain"}))
            for _ in range(1024):
                await stream.send_all(b"x" * 65535 + b"\n")
        elif path == "/slow":
            await stream.send_all(_response("200 OK", {"Content-Type": "text/plain"}, b"a"))
            await trio.sleep_forever()
        elif path.startswith("/to?"):  # a redirect to the URL after `?`
            where = {"Location": path.removeprefix("/to?"), "Content-Length": "0"}
            await stream.send_all(_response("302 Found", where))
        else:
            await stream.send_all(_response("404 Not Found", {"Content-Length": "0"}))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader stopped reading, as it should past its cap
    finally:
        await stream.aclose()


@pytest.fixture
async def web(nursery: trio.Nursery) -> Web:
    server = Web(0)
    serve = partial(trio.serve_tcp, partial(serve_page, server), 0, host="127.0.0.1")
    listeners = await nursery.start(serve)
    server.port = listeners[0].socket.getsockname()[1]
    return server


async def fetch(
    daemon: StartDaemon, tools: str, *urls: str, code: int = 0
) -> tuple[Daemon, list[ToolResultRecord]]:
    """One turn of a new session whose model fetches each of `urls`; the results it read."""
    fake = FakeLlama([call("fetch_url", {"url": u}, f"c{n}") for n, u in enumerate(urls)])
    fake.replies.append(Reply(content="done"))
    d = await daemon(fake, tools=tools)
    got, _, err = await bxctl(d, "chat", "-m", "read it")
    assert got == code, err
    return d, [r for r in records(d) if isinstance(r, ToolResultRecord)]


def records(d: Daemon) -> list[object]:
    store = Store(d.home / "sessions")
    latest = store.latest()
    assert latest is not None
    return list(store.read(latest)[1])


ALLOW_LOOPBACK = '[tools.fetch]\nallow = ["127.0.0.1"]\n'


async def test_an_html_page_comes_back_as_markdown_marked_untrusted(
    daemon: StartDaemon, web: Web
) -> None:
    _, (result,) = await fetch(daemon, ALLOW_LOOPBACK, web.url("/page"))
    assert result.content.startswith(f"<untrusted-data>\n{web.url('/page')} (200 OK, text/html)")
    assert "# Shopping" in result.content
    assert "buy **oat** milk" in result.content
    assert f"[more]({web.url('/more')})" in result.content
    assert "alert" not in result.content
    assert result.untrusted


async def test_loopback_is_refused_unless_the_allow_list_names_its_address(
    daemon: StartDaemon, web: Web
) -> None:
    tools = '[tools.policies.fetch_url]\naction = "allow"\n'
    _, (result,) = await fetch(daemon, tools, web.url("/page"))
    assert "127.0.0.1 is a loopback address, refused unless [tools.fetch] allow" in result.content
    assert web.asked == []


async def test_an_allowed_name_that_resolves_to_loopback_is_refused_as_its_address_is(
    daemon: StartDaemon, web: Web
) -> None:
    tools = '[tools.fetch]\nallow = ["localhost"]\n'
    _, (result,) = await fetch(daemon, tools, web.url("/page", host="localhost"))
    assert "(which localhost resolves to) is a loopback address" in result.content
    assert web.asked == []


async def test_a_redirect_to_a_refused_address_is_refused(daemon: StartDaemon, web: Web) -> None:
    """With the tool allowed for every host, nothing asks: each hop's address is checked."""
    tools = ALLOW_LOOPBACK + '[tools.policies.fetch_url]\naction = "allow"\n'
    _, (result,) = await fetch(
        daemon, tools, web.url("/to?http://169.254.169.254/latest/meta-data/")
    )
    assert "http://169.254.169.254/latest/meta-data/ is refused" in result.content
    assert "169.254.169.254 is a link-local address" in result.content


async def test_a_redirect_to_another_host_not_allowed_is_named_not_followed(
    daemon: StartDaemon, web: Web
) -> None:
    elsewhere = web.url("/page", host="localhost")
    _, (result,) = await fetch(daemon, ALLOW_LOOPBACK, web.url(f"/to?{elsewhere}"))
    assert f"redirects (302) to {elsewhere}, another host, which was not followed" in (
        result.content
    )
    assert web.asked == [f"/to?{elsewhere}"]


async def test_a_redirect_on_the_same_host_is_followed(daemon: StartDaemon, web: Web) -> None:
    _, (result,) = await fetch(daemon, ALLOW_LOOPBACK, web.url("/to?/page"))
    assert f"redirected from {web.url('/to?/page')}" in result.content
    assert "# Shopping" in result.content


async def test_a_huge_page_is_cut_at_the_cap(daemon: StartDaemon, web: Web) -> None:
    tools = ALLOW_LOOPBACK + "max_bytes = 100000\n"
    _, (result,) = await fetch(daemon, tools, web.url("/huge"))
    assert "[... cut: only the first 100000 bytes were read ([tools.fetch] max_bytes)]" in (
        result.content
    )


async def test_a_slow_page_is_stopped_at_the_timeout(daemon: StartDaemon, web: Web) -> None:
    tools = ALLOW_LOOPBACK + "timeout = 1\n"
    _, (result,) = await fetch(daemon, tools, web.url("/slow"))
    assert "took longer than 1 s ([tools.fetch] timeout) and was stopped" in result.content


async def test_a_file_that_is_not_text_is_named_not_read(daemon: StartDaemon, web: Web) -> None:
    _, (result,) = await fetch(daemon, ALLOW_LOOPBACK, web.url("/binary"))
    assert "is application/octet-stream, not text" in result.content


async def test_a_domain_on_neither_list_asks_naming_it(daemon: StartDaemon, web: Web) -> None:
    tools = '[tools.fetch]\nallow = ["example.com"]\n'
    d, results = await fetch(daemon, tools, web.url("/page"), code=6)  # waits for a person
    (asked,) = [r for r in records(d) if isinstance(r, ApprovalRequestRecord)]
    assert asked.tool == "fetch_url"
    assert asked.untrusted
    assert asked.preview is not None
    assert "127.0.0.1 is on neither [tools.fetch] allow nor deny" in asked.preview
    assert (results, web.asked) == ([], [])


async def test_the_deny_list_wins_over_allow_and_the_tools_policy(
    daemon: StartDaemon, web: Web
) -> None:
    tools = (
        '[tools.fetch]\nallow = ["127.0.0.1"]\ndeny = ["127.0.0.0/8"]\n'
        '[tools.policies.fetch_url]\naction = "allow"\n'
    )
    _, (result,) = await fetch(daemon, tools, web.url("/page"))
    assert result.content == "The call was denied: 127.0.0.1 is on [tools.fetch] deny"
    assert web.asked == []


def test_a_domain_with_a_scheme_or_path_is_refused_in_the_config(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[tools.fetch]\nallow = ["https://example.com/docs"]\n')
    with pytest.raises(ConfigError, match=r"'https://example.com/docs' is not a domain"):
        load_config(config)


def test_network_takes_true_false_or_a_list_of_domains(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[tools.run]\nnetwork = ["PyPI.org.", "*.pythonhosted.org"]\n')
    loaded, _ = load_config(config)
    assert loaded.tools.run.network == ["pypi.org", "*.pythonhosted.org"]
    config.write_text("[tools.run]\nnetwork = true\n")
    assert load_config(config)[0].tools.run.network is True
