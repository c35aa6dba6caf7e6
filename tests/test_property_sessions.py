"""The property loopd exists for, with several sessions at once: each session's every request
extends that session's previous one, byte for byte, whatever the interleaving.

hypothesis writes interleavings of messages to two or three sessions, sent all at once or one
after another, with restarts of the whole core between them (every session reopened from its
log), and plays them through the actors (registry, session actors, slot pool of two slots)
against the scripted llama-server over real HTTP. A round's messages may ask for a sub-agent:
the model answers them with a `delegate` call, and the sub-agent runs where a slot is free
(else the call is refused). Afterwards, the requests are told apart by the session whose first
message they carry; each extends the one before it of the same session, sub-agents' included,
and each session's log is a valid conversation that holds its own messages only, in order.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loopd.actors import Published, SessionHandle, Subscription, TurnDone, TurnFailed, open_core
from loopd.canonical import canonical
from loopd.config import Config
from loopd.infer import Client
from loopd.session.records import UserRecord, conversation_problems
from loopd.session.store import Store
from support.fake_llama import FakeLlama, Reply
from support.replay import Exchange, ReplayServer

SESSIONS = 3


@dataclass(frozen=True)
class Round:
    senders: list[int]
    """The sessions that send a message in this round, at once."""
    restart: bool
    """Stop the core and start it again before this round."""
    delegate: bool
    """Its messages are answered with a `delegate` call."""


rounds = st.builds(
    Round,
    senders=st.lists(st.integers(0, SESSIONS - 1), min_size=1, max_size=SESSIONS, unique=True),
    restart=st.booleans(),
    delegate=st.booleans(),
)

DELEGATE = " (delegate it)"
TASK = "the task of: "


def answer(request: dict[str, Any]) -> Exchange:
    """A `delegate` call for a message that asks for one, else a plain answer."""
    last = request["messages"][-1]
    reply = Reply(content="ok")
    if last["role"] == "user" and last["content"].endswith(DELEGATE):
        task = json.dumps({"name": "delegate", "arguments": {"task": TASK + last["content"]}})
        reply = Reply(tool_calls=(("d1", "call_tool", task),))
    return FakeLlama([reply])(request)


def config(directory: Path) -> Config:
    return Config.model_validate(
        {
            "session": {"history": "template"},
            "slots": {"save": "never"},  # the scripted server keeps no slot files
            "store": {"directory": str(directory / "sessions")},
            "tools": {"roots": []},
        }
    )


async def turn(handle: SessionHandle, subscription: Subscription, turn_id: str, text: str) -> None:
    await handle.send(turn_id, text)
    async for published in subscription.receive:
        assert isinstance(published, Published)
        if published.turn == turn_id and isinstance(published.item, TurnDone | TurnFailed):
            return


async def play(plan: list[Round], directory: Path) -> None:
    server = ReplayServer([answer] * 400, slots=2)
    store = Store(directory / "sessions")
    ids: list[str] = []
    said: dict[str, list[str]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with Client(server.url) as client:
            for n, step in enumerate(plan):
                if n > 0 and not step.restart:
                    continue  # played with the rounds before it
                async with open_core(config(directory), store, [client]) as core:
                    if not ids:
                        ids = [(await core.sessions.attach("new"))[1] for _ in range(SESSIONS)]
                        said = {i: [] for i in ids}
                    await _rounds(core.sessions, ids, said, plan, n)
        nursery.cancel_scope.cancel()
    _check(server.requests, store, said)


async def _rounds(
    sessions: Any, ids: list[str], said: dict[str, list[str]], plan: list[Round], start: int
) -> None:
    """Rounds from `start` up to the next restart, in this core."""
    handles = [(await sessions.attach(i))[0] for i in ids]
    subscriptions = [await h.subscribe(100) for h in handles]
    for n in range(start, len(plan)):
        if n > start and plan[n].restart:
            return
        async with trio.open_nursery() as senders:
            for s in plan[n].senders:
                text = f"session {s} says {n}" + (DELEGATE if plan[n].delegate else "")
                said[ids[s]].append(text)
                senders.start_soon(turn, handles[s], subscriptions[s], f"t{n}", text)


def _check(requests: list[dict[str, Any]], store: Store, said: dict[str, list[str]]) -> None:
    by_first: dict[str, list[list[Any]]] = {}
    for request in requests:
        body = request["body"]
        first = next(m["content"] for m in body["messages"] if m["role"] == "user")
        by_first.setdefault(first, []).append(body["messages"])
    for bodies in by_first.values():  # a session's, or a sub-agent's
        for earlier, later in itertools.pairwise(bodies):
            assert canonical(later[: len(earlier)]) == canonical(earlier)
    firsts = {texts[0] for texts in said.values() if texts}
    assert {f for f in by_first if not f.startswith(TASK)} <= firsts
    for session, texts in said.items():
        records = store.read(session)[1]
        assert conversation_problems(list(records)) == []
        assert [r.content for r in records if isinstance(r, UserRecord)] == texts
    children = [info for info in store.sessions_now() if info.parent is not None]
    event(f"sub-agents: {min(len(children), 2)}{'+' * (len(children) > 2)}")
    for info in children:
        if info.parent is not None:
            assert info.parent in said
            records = store.read(info.id)[1]
            assert conversation_problems(list(records)) == []
            (task,) = [r.content for r in records if isinstance(r, UserRecord)]
            assert task.removeprefix(TASK) in said[info.parent]


@settings(
    max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(plan=st.lists(rounds, min_size=1, max_size=6))
def test_each_sessions_requests_extend_its_own_previous_one(plan: list[Round]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(play, plan, Path(tmp))
