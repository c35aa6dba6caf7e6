"""The JSON-RPC peer under `bxctl acp`, over in-memory streams: answers, errors it must give
and go on after, notifications, and its own requests to the other side."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from pydantic import BaseModel

from bxctl.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, Peer, RpcError


class Echo(BaseModel):
    text: str


class Broken(Exception):
    pass


class Wire:
    """The other side: lines to the peer's input, lines from its output."""

    def __init__(self) -> None:
        self.to_peer_send, self.to_peer = trio.testing.memory_stream_one_way_pair()
        self.from_peer, self.from_peer_receive = trio.testing.memory_stream_one_way_pair()
        self.buffer = b""
        self.seen: list[str] = []

    async def send(self, message: dict[str, Any]) -> None:
        await self.to_peer_send.send_all(json.dumps(message).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(5):
            while b"\n" not in self.buffer:
                self.buffer += await self.from_peer_receive.receive_some()
        line, self.buffer = self.buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer


@pytest.fixture
async def wire(nursery: trio.Nursery) -> tuple[Wire, Peer]:
    w = Wire()

    async def echo(request: Echo) -> Echo:
        if request.text == "broken":
            raise Broken("the echo is broken")
        if request.text == "crash":
            raise ZeroDivisionError("no")
        return request

    async def seen(request: Echo) -> None:
        w.seen.append(request.text)

    peer = Peer(
        w.from_peer,
        name="the peer",
        methods={"echo": (Echo, echo)},
        notifications={"seen": (Echo, seen)},
        errors={Broken: -32010},
        max_line=1000,
    )
    nursery.start_soon(peer.serve, w.to_peer)
    return w, peer


async def answer_or_error(peer: Peer, text: str) -> Any:
    """What the peer's own request got: its result, or its error's message."""
    try:
        return await peer.ask("question", Echo(text=text))
    except RpcError as e:
        return e.message


def request(rpc_id: int, method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params}


async def test_a_request_is_answered_by_its_id(wire: tuple[Wire, Peer]) -> None:
    w, _ = wire
    await w.send(request(7, "echo", {"text": "hi"}))
    assert await w.receive() == {"jsonrpc": "2.0", "id": 7, "result": {"text": "hi"}}


async def test_errors_each_with_its_code_and_the_peer_goes_on(wire: tuple[Wire, Peer]) -> None:
    w, _ = wire
    await w.send(request(1, "echo", {"text": "broken"}))
    assert (await w.receive())["error"] == {"code": -32010, "message": "the echo is broken"}
    await w.send(request(2, "echo", {"text": "crash"}))
    answer = await w.receive()
    assert answer["error"]["code"] == INTERNAL_ERROR
    assert answer["error"]["message"] == "the peer failed: ZeroDivisionError: no"
    await w.send(request(3, "echo", {"words": "hi"}))
    assert (await w.receive())["error"] == {
        "code": INVALID_PARAMS,
        "message": "echo: text: Field required",
    }
    await w.send(request(4, "shout", {}))
    assert (await w.receive())["error"] == {
        "code": METHOD_NOT_FOUND,
        "message": "the peer does not offer shout",
    }
    await w.send(request(5, "echo", {"text": "still here"}))
    assert (await w.receive())["result"] == {"text": "still here"}


async def test_notifications_are_taken_in_order_and_bad_ones_dropped_silently(
    wire: tuple[Wire, Peer],
) -> None:
    w, _ = wire
    for params in ({"text": "a"}, {"nope": 1}, {"text": "b"}):
        await w.send({"jsonrpc": "2.0", "method": "seen", "params": params})
    await w.send({"jsonrpc": "2.0", "method": "unknown", "params": {}})
    await w.send(request(1, "echo", {"text": "after"}))
    assert (await w.receive())["id"] == 1  # nothing was answered before it
    assert w.seen == ["a", "b"]


async def test_its_own_requests_get_their_answers_or_errors(wire: tuple[Wire, Peer]) -> None:
    w, peer = wire
    answers: list[Any] = []

    async def ask() -> None:
        answers.append(await answer_or_error(peer, "?"))
        answers.append(await answer_or_error(peer, "!"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        asked = await w.receive()
        assert (asked["method"], asked["params"]) == ("question", {"text": "?"})
        await w.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"yes": True}})
        asked = await w.receive()
        await w.send({"jsonrpc": "2.0", "id": asked["id"], "error": {"code": 1, "message": "no"}})
    assert answers == [
        {"yes": True},
        "question was answered with an error: {'code': 1, 'message': 'no'}",
    ]


async def test_the_end_of_the_input_leaves_the_running_requests_answered(
    wire: tuple[Wire, Peer],
) -> None:
    """A script that writes its requests and closes its end still reads the answers; a request
    of the peer's own then fails, with nobody left to answer it."""
    w, peer = wire
    failed: list[str] = []

    async def ask() -> None:
        failed.append(await answer_or_error(peer, "?"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        assert (await w.receive())["method"] == "question"
        await w.send(request(1, "echo", {"text": "last"}))
        await w.to_peer_send.aclose()
        assert (await w.receive())["result"] == {"text": "last"}
    assert failed == [
        "question was answered with an error: "
        + str({"code": INTERNAL_ERROR, "message": "the other side closed its input"})
    ]
    with pytest.raises(RpcError, match="question: the other side closed its input"):
        await peer.ask("question", Echo(text="again?"))
