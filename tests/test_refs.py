"""Requests that name themselves: a real `loopd serve` over its Unix socket, raw JSON lines.
Every answer carries its request's `ref`, a turn's lines the `ref` of its `send`, and a client
of protocol 2 that sends none reads what it always read."""

from __future__ import annotations

import json
from typing import Any

import trio

from conftest import StartDaemon
from loopd.wire import PROTOCOL
from support.daemon import LineClient


async def lines(client: LineClient, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    with trio.fail_after(30):
        while len(got) < count:
            line = await client.receive()
            assert line is not None, f"closed after {got}"
            got.append(line)
    return got


async def test_two_status_requests_and_a_history_at_once_each_get_their_own_answer(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "hello", "protocol": PROTOCOL, "session": "new", "ref": "h"})
    await client.until("welcome")
    await client.turn("t1", "hello")
    asked = [
        {"type": "status", "ref": "first"},
        {"type": "history", "start": -1, "ref": "page"},
        {"type": "status", "ref": "second"},
    ]
    await client.send("".join(f"{json.dumps(m)}\n" for m in asked))  # in flight together
    answers = {line["ref"]: line for line in await lines(client, 3)}
    assert {ref: line["type"] for ref, line in answers.items()} == {
        "first": "status",
        "page": "history",
        "second": "status",
    }
    assert len(answers["page"]["records"]) == 1


async def test_a_hello_of_protocol_3_is_welcomed_with_its_ref(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "hello", "protocol": 3, "session": "new", "ref": "hi"})
    welcome = (await client.until("welcome"))[-1]
    assert (welcome["protocol"], welcome["ref"]) == (3, "hi")


async def test_a_turns_lines_carry_the_ref_of_its_send_and_a_subscriber_sees_none(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain")
    alice, bob = await d.connect(), await d.connect()
    await bob.send({"type": "subscribe"})
    await bob.send({"type": "status"})
    await bob.until("status")
    await alice.send({"type": "send", "id": "t1", "content": "hello", "ref": "ask-1"})
    own = await alice.until("turn_done")
    assert own[0]["type"] == "accepted"
    assert "event" in {line["type"] for line in own}
    assert {line.get("ref") for line in own} == {"ask-1"}
    seen = await bob.until("turn_done")
    assert "event" in {line["type"] for line in seen}
    assert all("ref" not in line for line in seen)


async def test_an_error_carries_the_ref_of_the_request_it_refuses(daemon: StartDaemon) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "approve", "call": 7, "decision": "once", "ref": "yes-7"})
    error = (await client.until("error"))[-1]
    assert (error["code"], error["ref"]) == ("unknown_call", "yes-7")


async def test_a_message_that_does_not_validate_is_refused_with_its_ref(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "history", "start": "soon", "ref": "page"})
    error = (await client.until("error"))[-1]
    assert (error["code"], error["ref"]) == ("bad_message", "page")


async def test_a_client_of_protocol_2_without_refs_reads_lines_without_them(
    daemon: StartDaemon,
) -> None:
    d = await daemon("plain")
    client = await d.connect()
    await client.send({"type": "hello", "protocol": 2, "client": "old", "session": "new"})
    welcome = (await client.until("welcome"))[-1]
    assert welcome["protocol"] == 2
    got = await client.turn("t1", "hello")
    await client.send({"type": "status"})
    status = (await client.until("status"))[-1]
    await client.send({"type": "undo"})
    error = (await client.until("error"))[-1]
    assert got[0]["type"] == "accepted"
    assert got[-1]["type"] == "turn_done"
    assert status["turns"] == 1
    assert error["code"] == "undo_refused"
    assert all("ref" not in line for line in [welcome, *got, status, error])
