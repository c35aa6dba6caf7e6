"""`fetch_url`: one web page or text file over HTTP(S), for the model to read.

loopd speaks the HTTP itself (h11 over trio's streams) so that it decides every connection:
each URL's host is checked against `[tools.fetch]` (`_hosts`: the deny list wins, an address
that is not the internet's is refused unless the allow list names it), resolved once, and
connected to at an address that passed; TLS then checks the certificate against the name.
Redirects are followed hop by hop, each hop checked as the first URL was, at most
`max_redirects`; a redirect to another host that is not on the allow list is not followed
where a person approved the call (they approved one host): the result names where it leads,
and fetching that asks again.

HTML becomes Markdown (`html-to-markdown`, links made absolute); text, JSON and XML are kept
as they are; anything else is refused, naming its type. The body is read up to `max_bytes`
and cut there; the whole fetch, redirects included, stops at `timeout`. What it reads is the
web's: the tool's results are always untrusted (`_registry.policy_for`).
"""

from __future__ import annotations

import codecs
import ssl
import zlib
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import h11
import html_to_markdown
import trio

from loopd import __version__
from loopd.config import FetchConfig

from ._hosts import HostRefused, HostRules, Resolver, connect, host_of, system_resolver
from ._types import Judgment, ToolFailure

__all__ = ["Fetcher"]

READ_SIZE = 65536
REDIRECTS = frozenset({301, 302, 303, 307, 308})
TEXT_TYPES = ("application/json", "application/xml", "application/javascript")
HTML_TYPES = ("text/html", "application/xhtml+xml")
SNIFF = 1024


@dataclass(frozen=True)
class _Target:
    url: str
    scheme: str
    host: str
    port: int
    target: str
    """The request target: path and query."""


def target(url: str) -> _Target:
    """`url` taken apart, or `ToolFailure` saying what is wrong with it."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ToolFailure(f"{url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ToolFailure(f"{url!r}: fetch_url reads http:// and https:// URLs only")
    if not parts.hostname:
        raise ToolFailure(f"{url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise ToolFailure(f"{url!r} carries a user name or password, which fetch_url never sends")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    port = port or (443 if parts.scheme == "https" else 80)
    return _Target(url.strip(), parts.scheme, host_of(parts.hostname), port, path)


@dataclass(frozen=True)
class _Response:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes
    cut: bool


@dataclass(frozen=True)
class Fetcher:
    config: FetchConfig = field(default_factory=FetchConfig)
    resolve: Resolver = system_resolver
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    @property
    def rules(self) -> HostRules:
        return HostRules(self.config.allow, self.config.deny)

    def judge(self, url: str) -> Judgment | None:
        """The lists' say on a call: a denied host is refused and an allowed one runs, without
        asking; None: the tool's policy decides (`ask` by default)."""
        try:
            host = target(url).host
        except ToolFailure:
            return None  # it fails when it runs, saying why
        if self.rules.denied(host):
            return Judgment("deny", f"{host} is on [tools.fetch] deny")
        if self.rules.allowed(host):
            return Judgment("allow")
        return None

    def preview(self, url: str) -> str:
        """The call as a person approves it: the URL and what the lists say of its host."""
        host = target(url).host
        return (
            f"GET {url}\n{host} is on neither [tools.fetch] allow nor deny; redirects to "
            "another host that allow does not name are not followed"
        )

    async def fetch(self, url: str, *, any_host: bool = False) -> str:
        """The page at `url` for the model: a line saying what it is, then its text.
        `any_host`: follow redirects to any host that is not denied (nothing would ask)."""
        first = target(url)
        with trio.move_on_after(self.config.timeout) as deadline:
            return await self._follow(first, any_host)
        assert deadline.cancelled_caught  # noqa: S101 - the only way out of the block
        raise ToolFailure(
            f"fetching {url} took longer than {self.config.timeout:g} s ([tools.fetch] "
            "timeout) and was stopped"
        )

    async def _follow(self, first: _Target, any_host: bool) -> str:
        hop, hops = first, 0
        while True:
            if self.rules.denied(hop.host):
                raise ToolFailure(f"{hop.url}: {hop.host} is on [tools.fetch] deny")
            response = await self._get(hop)
            location = response.headers.get("location")
            if response.status not in REDIRECTS or not location:
                return self._shown(hop, response, first if hops else None)
            if hops == self.config.max_redirects:
                raise ToolFailure(
                    f"{first.url} redirected more than {hops} times ([tools.fetch] "
                    f"max_redirects); the last hop leads to {location}"
                )
            following = target(urljoin(hop.url, location))
            hops += 1
            if not (
                any_host
                or following.host in (first.host, hop.host)
                or self.rules.allowed(following.host)
            ):
                return (
                    f"{hop.url} redirects ({response.status}) to {following.url}, another "
                    f"host, which was not followed: call fetch_url with that URL to read it "
                    "(a host not on [tools.fetch] allow is approved on its own)"
                )
            hop = following

    async def _get(self, hop: _Target) -> _Response:
        try:
            stream: trio.abc.Stream = await connect(self.rules, hop.host, hop.port, self.resolve)
        except HostRefused as e:
            raise ToolFailure(f"{hop.url} is refused: {e}") from None
        except OSError as e:
            raise ToolFailure(f"{hop.url}: {e}") from None
        try:
            if hop.scheme == "https":
                stream = trio.SSLStream(
                    stream, self.tls, server_hostname=hop.host, https_compatible=True
                )
            return await self._exchange(stream, hop)
        except (trio.BrokenResourceError, OSError, h11.ProtocolError) as e:
            why = e.__cause__ or e  # trio's TLS stream says only that it broke
            raise ToolFailure(f"{hop.url}: {why}") from None
        finally:
            await trio.aclose_forcefully(stream)

    async def _exchange(self, stream: trio.abc.Stream, hop: _Target) -> _Response:
        conn = h11.Connection(h11.CLIENT)
        default = 443 if hop.scheme == "https" else 80
        host = hop.host if ":" not in hop.host else f"[{hop.host}]"
        headers = [
            ("Host", host if hop.port == default else f"{host}:{hop.port}"),
            ("User-Agent", f"loopd/{__version__} (fetch_url)"),
            ("Accept", "text/html, text/markdown, text/plain, */*;q=0.5"),
            ("Accept-Encoding", "gzip, deflate, identity;q=0.5"),
            ("Connection", "close"),
        ]
        request = h11.Request(method="GET", target=hop.target, headers=headers)
        for sent in (request, h11.EndOfMessage()):
            await stream.send_all(conn.send(sent) or b"")
        head: h11.Response | None = None
        body, size, cut = bytearray(), 0, False
        decoder: zlib._Decompress | None = None
        limit = self.config.max_bytes
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(READ_SIZE)))
            elif isinstance(event, h11.Response):
                head = event
                decoder = _decoder(_header(event, b"content-encoding"))
            elif isinstance(event, h11.Data):
                data = bytes(event.data)
                size += len(data)
                if decoder is not None:
                    data = decoder.decompress(data, limit + 1 - len(body))
                body += data
                if len(body) > limit or size > limit:
                    del body[limit:]
                    cut = True
                    break
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        assert head is not None  # noqa: S101 - h11 gives a Response before any Data
        headers_of = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        reason = head.reason.decode("latin-1", errors="replace")
        return _Response(head.status_code, reason, headers_of, bytes(body), cut)

    def _shown(self, hop: _Target, response: _Response, first: _Target | None) -> str:
        kind = response.headers.get("content-type", "")
        media = kind.split(";")[0].strip().lower()
        charset = _charset(kind)
        body = response.body
        if not media:
            media = "text/plain" if _looks_like_text(body) else "application/octet-stream"
        if media in HTML_TYPES:
            html = body.decode(charset, errors="replace")
            options = html_to_markdown.ConversionOptions(base_url=hop.url)
            text = html_to_markdown.convert(html, options).content
        elif media.startswith("text/") or media in TEXT_TYPES or media.endswith(("+json", "+xml")):
            text = body.decode(charset, errors="replace")
        else:
            raise ToolFailure(
                f"{hop.url} is {media}, not text: fetch_url reads HTML, text, JSON and XML only"
            )
        what = f"{hop.url} ({response.status} {response.reason}, {media}"
        text = text or ""
        what += f", redirected from {first.url})" if first is not None else ")"
        if response.cut:
            text += (
                f"\n[... cut: only the first {self.config.max_bytes} bytes were read "
                "([tools.fetch] max_bytes)]"
            )
        return f"{what}\n\n{text}"


def _header(response: h11.Response, name: bytes) -> str:
    values = [v.decode("latin-1") for k, v in response.headers if k == name]
    return values[0].strip().lower() if values else ""


def _decoder(encoding: str) -> zlib._Decompress | None:
    """What undoes a body's `Content-Encoding`; `ToolFailure` for one loopd does not read."""
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, told by the header
    raise ToolFailure(f"the page is sent with Content-Encoding {encoding}, which loopd cannot read")


def _charset(content_type: str) -> str:
    for parameter in content_type.split(";")[1:]:
        key, _, value = parameter.strip().partition("=")
        if key.lower() == "charset":
            name = value.strip().strip('"')
            try:
                return codecs.lookup(name).name if name else "utf-8"
            except LookupError:
                return "utf-8"
    return "utf-8"


def _looks_like_text(body: bytes) -> bool:
    head = body[:SNIFF]
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > len(head) - 4  # a character cut at the sniff's end
    return True
