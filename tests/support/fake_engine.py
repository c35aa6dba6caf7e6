"""A scripted OpenAI-compatible server over real HTTP on loopback, in a thread of its own: each
path answers what the test gives it (a JSON body, an event stream, a status, a cut), or what a
real server behind it answers (`upstream`), and every request is kept with its headers, so a
test can check what loopd sent. Stands in for what no
real server here can be made to do on purpose (a 400 without JSON, a stream cut mid-token, an
answer without token ids, a usage without cache figures)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    cut: bool = False
    """Close the connection after the body, without the chunked encoding's end (a server that
    died mid-stream)."""

    @classmethod
    def of(cls, payload: object, status: int = 200) -> Answer:
        return cls(status, json.dumps(payload).encode())

    @classmethod
    def events(cls, *chunks: object, done: bool = True, cut: str | None = None) -> Answer:
        """An event stream of `chunks`; `cut`: the start of one more event, and then the
        connection breaks."""
        lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
        if done and cut is None:
            lines.append("data: [DONE]\n\n")
        body = "".join(lines) + (cut or "")
        return cls(200, body.encode(), "text/event-stream", cut is not None)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


Route = Callable[[Any], Answer]


@dataclass
class FakeEngine:
    routes: Mapping[str, Route | Answer]
    upstream: str | None = None
    """Where a path the routes do not name goes (a real server behind this one, which then
    records what reaches it), its answer read whole and sent on."""
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Answer:
        body = json.loads(raw) if raw else None
        self.seen.append(Seen(method, path, headers, body))
        route = self.routes.get(path)
        if route is None and self.upstream is not None:
            return self._forward(method, path, raw)
        if route is None:
            return Answer.of({"error": {"message": f"no {path}", "code": 404}}, 404)
        return route if isinstance(route, Answer) else route(body)

    def _forward(self, method: str, path: str, raw: bytes) -> Answer:
        headers = {"Content-Type": "application/json"} if raw else {}
        with httpx.Client(timeout=600) as http:
            got = http.request(method, f"{self.upstream}{path}", content=raw, headers=headers)
        kind = got.headers.get("content-type", "application/json").split(";")[0]
        return Answer(got.status_code, got.content, kind)

    def bodies(self, path: str) -> list[Any]:
        return [s.body for s in self.seen if s.path == path]


@contextmanager
def fake_engine(
    routes: Mapping[str, Route | Answer], upstream: str | None = None
) -> Iterator[FakeEngine]:
    engine = FakeEngine(routes, upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            answer = engine.answer(self.command, self.path, headers, raw)
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            if answer.content_type == "text/event-stream":  # chunked, as real servers send it
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(answer.body), answer.body))
                if not answer.cut:
                    self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                self.close_connection = True
                if answer.cut:  # the body's end never comes: the server died under it
                    self.connection.shutdown(2)
                return
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)

        do_GET = do_POST = _serve  # noqa: N815 - the names http.server calls

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    engine.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        server.shutdown()
        server.server_close()
