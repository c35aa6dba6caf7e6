"""A small llama-server stand-in that serves recorded exchanges over real HTTP on loopback.

A recording file (`recordings/*.json`) holds a `source` line saying how it was made and a list
of `exchanges`, each the request sent and the response received: status, headers and the raw
body. The server answers requests with the exchanges in order, whatever was asked, and keeps
what it was sent in `requests` so tests can check it. A response may carry `replay` options
that make the server misbehave on purpose:

- `event_delay`: seconds between SSE events (for cancelling mid-stream);
- `stall`: accept the request and never answer;
- `cut`: send the body, then drop the connection without ending the chunked encoding.

Run it as a process for tests that need a separate server:
`python tests/support/replay.py recordings/plain.json [...] --port N`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

RECORDINGS = Path(__file__).resolve().parent.parent.parent / "recordings"
MAX_REQUEST = 16 * 1024 * 1024
SIDE_ENDPOINTS: dict[str, Any] = {
    "/health": {"status": "ok"},
    "/props": {"model_path": "SmolLM2-135M-Instruct.Q4_1.gguf", "total_slots": 1},
    "/slots": None,  # `slots` of them
}


@dataclass(frozen=True)
class Exchange:
    request: dict[str, Any]
    status: int
    headers: list[tuple[str, str]]
    body: str
    replay: dict[str, Any]

    def events(self) -> list[bytes]:
        """The body split after each SSE event, so each goes out as its own chunk."""
        raw = self.body.encode()
        pieces = [p + b"\n\n" for p in raw.split(b"\n\n")]
        pieces[-1] = pieces[-1][:-2]
        return [p for p in pieces if p]


def load(name: str) -> list[Exchange]:
    path = Path(name) if name.endswith(".json") else RECORDINGS / f"{name}.json"
    data = json.loads(path.read_text())
    return [
        Exchange(
            request=e["request"],
            status=e["response"]["status"],
            headers=[(k, v) for k, v in e["response"]["headers"]],
            body=e["response"]["body"],
            replay=e["response"].get("replay", {}),
        )
        for e in data["exchanges"]
    ]


Responder = Callable[[Any], Exchange]
"""Makes the response from the request's JSON body: a scripted server rather than a recording."""


@dataclass
class ReplayServer:
    exchanges: list[Exchange | Responder]
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    broken: int = 0
    """Responses the client stopped reading before their end (it closed the connection)."""
    slots: int = 1
    """Slots `GET /slots` tells of."""
    side: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    """Endpoints answered with the JSON a function makes of the request's body, not kept in
    `requests` (a scripted server's `/apply-template`, `/tokenize`, ...); before
    `SIDE_ENDPOINTS`."""
    _changed: trio.Event = field(default_factory=trio.Event)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until a request or a broken connection makes `condition` true."""
        while not condition():
            await self._changed.wait()

    @classmethod
    def of(cls, *names: str) -> ReplayServer:
        return cls([e for name in names for e in load(name)])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._serve, listeners)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST)
        try:
            while await self._one(stream, conn):
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.broken += 1
            self._notify()
        except h11.ProtocolError:
            pass
        finally:
            await stream.aclose()

    async def _one(self, stream: trio.SocketStream, conn: h11.Connection) -> bool:
        request, body = await _receive_request(stream, conn)
        if request is None:
            return False
        target = request.target.decode()
        # What loopd asks besides completions, answered as is.
        if target in self.side or target in SIDE_ENDPOINTS:
            side = self.side[target](body) if target in self.side else SIDE_ENDPOINTS[target]
            if target == "/slots" and target not in self.side:
                side = [{"id": n, "n_ctx": 8192} for n in range(self.slots)]
            payload = json.dumps(side).encode()
            await _send(
                stream,
                conn,
                h11.Response(
                    status_code=200,
                    headers=[
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(payload))),
                    ],
                ),
            )
            await _send(stream, conn, h11.Data(data=payload))
            await _send(stream, conn, h11.EndOfMessage())
            return True
        self.requests.append(
            {"method": request.method.decode(), "path": request.target.decode(), "body": body}
        )
        self._notify()
        if not self.exchanges:
            await _send(stream, conn, h11.Response(status_code=500, headers=[]))
            await _send(stream, conn, h11.Data(data=b'{"error":"no more recordings"}'))
            await _send(stream, conn, h11.EndOfMessage())
            return True
        exchange = self.exchanges.pop(0)
        if not isinstance(exchange, Exchange):
            exchange = exchange(self.requests[-1]["body"])
        if exchange.replay.get("stall"):
            await trio.sleep_forever()
        headers = [(k, v) for k, v in exchange.headers if k.lower() != "content-length"]
        headers.append(("Transfer-Encoding", "chunked"))
        await _send(stream, conn, h11.Response(status_code=exchange.status, headers=headers))
        for piece in exchange.events():
            await _send(stream, conn, h11.Data(data=piece))
            await trio.sleep(exchange.replay.get("event_delay", 0))
        if exchange.replay.get("cut"):
            return False
        await _send(stream, conn, h11.EndOfMessage())
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE


async def _receive_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request | None, Any]:
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            try:
                return request, json.loads(body) if body else None
            except ValueError:
                return request, body.decode(errors="replace")
        elif isinstance(event, h11.ConnectionClosed):
            return None, None


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("recordings", nargs="+")
    args.add_argument("--port", type=int, default=0)
    args.add_argument("--repeat", type=int, default=1, help="serve the list this many times")
    opts = args.parse_args()
    exchanges = [e for name in opts.recordings for e in load(name)] * opts.repeat
    server = ReplayServer(exchanges, port=opts.port)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            print(server.url, flush=True)
            await trio.sleep(math.inf)

    trio.run(run)


if __name__ == "__main__":
    main()
