"""A llama-server that answers at once: a proxy that asks the real server the first time it
sees a request and replays that answer, whole, every time after.

What a client adds to the time to first content against it is its own work alone: no prompt to
process, no server noise. `just bench history` sends loopd's requests, and the same bodies
directly, through it once each has been asked for real (`history.py`). `GET /missed` says how many
requests it had to ask the real server for.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import h11
import httpx
import trio

MAX_REQUEST = 64 * 1024 * 1024
"""A long history's token ids, as JSON."""


MISSED = b"/missed"
"""Not a llama-server path: how many requests it had to ask `upstream` for, so far."""


@dataclass(frozen=True)
class _Answer:
    status: int
    content_type: str
    body: bytes


@dataclass
class InstantServer:
    """Answers each request as `upstream` answered it the first time; `missed` counts the
    requests it had to ask `upstream` for. Run it as a process of its own, as llama-server is
    (`python bench/instant.py URL`): in the client's process it would answer without a hop
    between processes, which loopd's requests cannot skip."""

    upstream: str
    prompt_time: float = 0.0
    """Seconds a stream takes to its first token, every time: a short prompt on a GPU, where
    what a client does beside its request (loopd's check and fsync) is done before it."""
    token_time: float = 0.005
    """Seconds between the tokens of a stream (200 a second)."""
    port: int = 0
    missed: int = 0
    _answers: dict[tuple[bytes, bytes, bytes], _Answer] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with httpx.AsyncClient(base_url=self.upstream, timeout=3600) as http:

            async def serve(stream: trio.SocketStream) -> None:
                await self._serve(stream, http)

            task_status.started()
            await trio.serve_listeners(serve, listeners)

    async def _serve(self, stream: trio.SocketStream, http: httpx.AsyncClient) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        try:
            while await self._one(stream, conn, http):
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            await stream.aclose()

    async def _one(
        self, stream: trio.SocketStream, conn: h11.Connection, http: httpx.AsyncClient
    ) -> bool:
        request, body = None, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return False
        assert request is not None  # noqa: S101 - h11 gives the request before its end
        answer = await self._answer(request, bytes(body), http)
        if not answer.content_type.startswith("text/event-stream"):
            headers = [
                ("Content-Type", answer.content_type),
                ("Content-Length", str(len(answer.body))),
            ]
            await self._send(stream, conn, h11.Response(status_code=answer.status, headers=headers))
            await self._send(stream, conn, h11.Data(data=answer.body), h11.EndOfMessage())
        else:  # as llama-server streams: its headers at once, the first token once the
            # prompt is processed, then the others one by one
            headers = [("Content-Type", answer.content_type), ("Transfer-Encoding", "chunked")]
            await self._send(stream, conn, h11.Response(status_code=answer.status, headers=headers))
            await trio.sleep(self.prompt_time)
            first, rest = _first_token(answer.body)
            await self._send(stream, conn, h11.Data(data=first))
            for piece in rest:
                await trio.sleep(self.token_time)
                await self._send(stream, conn, h11.Data(data=piece))
            await self._send(stream, conn, h11.EndOfMessage())
            return False  # llama-server closes the connection after a stream, despite Keep-Alive
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    @staticmethod
    async def _send(stream: trio.SocketStream, conn: h11.Connection, *events: h11.Event) -> None:
        await stream.send_all(b"".join(conn.send(e) or b"" for e in events))

    async def _answer(self, request: h11.Request, body: bytes, http: httpx.AsyncClient) -> _Answer:
        if request.target == MISSED:
            return _Answer(200, "application/json", str(self.missed).encode())
        key = (request.method, request.target, body)
        if (answer := self._answers.get(key)) is None:
            self.missed += 1
            response = await _ask(http, request, body)
            answer = self._answers[key] = _Answer(
                response.status_code,
                response.headers.get("content-type", "application/json"),
                response.content,
            )
        return answer


async def _ask(http: httpx.AsyncClient, request: h11.Request, body: bytes) -> httpx.Response:
    method, target = request.method.decode(), request.target.decode()
    headers = {"Content-Type": "application/json"}
    try:
        return await http.request(method, target, content=body, headers=headers)
    except httpx.RemoteProtocolError:
        # llama-server closes a keep-alive connection after 5 idle seconds.
        return await http.request(method, target, content=body, headers=headers)


def _first_token(body: bytes) -> tuple[bytes, list[bytes]]:
    """A stream's events up to its first token's, and each one after it."""
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    at = next(
        (i for i, e in enumerate(events) if b'"tokens":[' in e and b'"tokens":[]' not in e), 0
    )
    return b"".join(events[: at + 1]), events[at + 1 :]


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("upstream", help="the real server's URL")
    args.add_argument("--prompt-time", type=float, default=0.0, help="seconds; see InstantServer")
    opts = args.parse_args()
    server = InstantServer(opts.upstream, opts.prompt_time)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            print(server.url, flush=True)

    trio.run(run)


if __name__ == "__main__":
    main()
