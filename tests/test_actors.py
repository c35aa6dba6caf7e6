"""The actors wired by open_core, seen only through their handles and the log on disk: a test
per message of the session actor's inbox and of the slot pool's, sessions opened and stopped
by the registry, turns in order, events fanned out, approvals, cancels that reach the HTTP
stream, and a log left valid by every way a turn can stop."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import pytest
import trio

from loopd.actors import (
    Busy,
    DuplicateTurn,
    ModeChanged,
    PoolHandle,
    Published,
    SessionHandle,
    SessionRegistry,
    SlotFiles,
    Subscription,
    TooManySessions,
    TurnDone,
    TurnFailed,
    open_core,
    pool_actor,
)
from loopd.actors._errors import SessionFailed
from loopd.actors._pool import _Pool, _Release, _Views
from loopd.actors._registry import _Hooks
from loopd.actors._session import SessionActor
from loopd.config import Config
from loopd.infer import Client, Content, Queued, Slot
from loopd.session.records import AssistantRecord, Record, UserRecord, conversation_problems
from loopd.session.store import Store
from loopd.supervise import ActorFailed, GaveUp
from loopd.tools._port import _Decide, _PortActor
from loopd.turn.exact import next_request
from loopd.wire.events import ApprovalDecided, ApprovalNeeded
from loopd.wire.proto import HISTORY_PAGE
from support.bugs import plant_bug
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

T = TypeVar("T")


@pytest.fixture
async def served(nursery: trio.Nursery) -> tuple[FakeLlama, ReplayServer]:
    fake = FakeLlama([])
    server = ReplayServer([fake] * 50)
    await nursery.start(server.run)
    return fake, server


def config(tmp_path: Path, max_live: int = 64, **loop: Any) -> Config:
    """The scripted server answers the chat endpoint only: history goes as messages."""
    (tmp_path / "notes").mkdir(exist_ok=True)
    (tmp_path / "notes" / "today.md").write_text("buy milk\n")
    return Config.model_validate(
        {
            "loop": loop,
            "tools": {
                "roots": [str(tmp_path / "notes")],
                "policies": {"read_file": {"action": "ask"}},
                "approval_timeout": 5,
            },
            "channel": {"queue_limit": 2},
            "session": {"history": "template", "max_live": max_live},
            "slots": {"save": "never"},  # the scripted server keeps no slot files
        }
    )


class Core:
    """The actors over a store in `tmp_path`, on the scripted server."""

    def __init__(self, tmp_path: Path, server: ReplayServer, **settings: Any) -> None:
        self.tmp_path, self.server, self.settings = tmp_path, server, settings
        self.store = Store(tmp_path / "sessions")
        self.first = ""
        self.sessions: SessionRegistry | None = None
        self.pool: PoolHandle | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[SessionHandle]:
        """The core, and a client attached to a new session (`first`)."""
        cfg = config(self.tmp_path, **self.settings)
        async with (
            Client(self.server.url) as client,
            open_core(cfg, self.store, [client]) as core,
        ):
            self.sessions, self.pool = core.sessions, core.pool
            actor, self.first = await core.sessions.attach("new")
            yield actor

    def log(self, session: str | None = None) -> list[Record]:
        return self.store.read(session or self.first)[1]

    def kinds(self, session: str | None = None) -> list[str]:
        return [r.kind for r in self.log(session)]


@pytest.fixture
def core(tmp_path: Path, served: Any) -> Core:
    return Core(tmp_path, served[1])


async def collect(subscription: Subscription, turns: int) -> list[Published]:
    """The turns' messages up to the end of `turns` of them; a change of the session's mode,
    which every subscriber hears too, is passed over."""
    got: list[Published] = []
    async for message in subscription.receive:
        if isinstance(message, ModeChanged):
            continue
        assert isinstance(message, Published)
        got.append(message)
        if sum(isinstance(m.item, TurnDone | TurnFailed) for m in got) == turns:
            break
    return got


def read_file(path: str, call_id: str = "c1") -> Reply:
    arguments = json.dumps({"name": "read_file", "arguments": {"path": path}})
    return Reply(tool_calls=((call_id, "call_tool", arguments),))


async def next_of(subscription: Subscription, kind: type[T]) -> T:
    async for message in subscription.receive:
        assert isinstance(message, Published)
        if isinstance(message.item, kind):
            return message.item
    raise AssertionError(f"no {kind.__name__}")


# -- send, subscribe ---------------------------------------------------------------------------


async def test_send_runs_turns_in_order_and_subscribers_see_them_tagged(
    core: Core, served: Any
) -> None:
    served[0].replies = [Reply(content="one"), Reply(content="two")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        assert await actor.send("t1", "first") == 0
        assert await actor.send("t2", "second") == 1
        got = await collect(subscription, 2)
    done = [(m.turn, m.item.outcome.content) for m in got if isinstance(m.item, TurnDone)]
    assert done == [("t1", "one"), ("t2", "two")]
    assert {m.turn for m in got if isinstance(m.item, Content)} == {"t1", "t2"}
    assert core.kinds().count("turn_end") == 2


async def test_send_beyond_the_queue_limit_is_busy_and_a_used_id_is_refused(
    core: Core, served: Any
) -> None:
    served[0].replies = [Reply(kind="stall")]
    async with core.running() as actor:
        await actor.send("t1", "runs")
        await trio.testing.wait_all_tasks_blocked()
        await actor.send("t2", "waits")
        with pytest.raises(DuplicateTurn):
            await actor.send("t1", "again")
        with pytest.raises(DuplicateTurn):
            await actor.send("t2", "again")
        await actor.send("t3", "waits too")
        with pytest.raises(Busy):
            await actor.send("t4", "one too many")
        status = await actor.status()
        assert (status.running, status.queued) == ("t1", ("t2", "t3"))


# -- cancel ------------------------------------------------------------------------------------


async def test_cancel_a_waiting_turn_and_an_unknown_one(core: Core, served: Any) -> None:
    served[0].replies = [Reply(kind="stall")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "runs")
        await actor.send("t2", "waits")
        assert await actor.cancel("t2")
        assert not await actor.cancel("t9")
        assert (await actor.status()).queued == ()
        failed = await next_of(subscription, TurnFailed)
    assert failed == TurnFailed("cancelled", "cancelled before it ran")


async def test_cancel_a_running_turn_ends_its_http_stream_and_leaves_a_valid_log(
    core: Core, served: Any
) -> None:
    fake, server = served
    fake.replies = [Reply(content=" ".join(["slowly"] * 100), delay=0.05)]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "hello")
        await next_of(subscription, Content)
        assert await actor.cancel("t1")
        got = await collect(subscription, 1)
        with trio.fail_after(5):
            await server.wait_until(lambda: server.broken > 0)
    assert got[-1].item == TurnFailed("cancelled", "the turn was cancelled")
    assert core.kinds() == ["user", "assistant", "usage", "turn_end"]  # what came is kept
    cut = core.log()[1]
    assert isinstance(cut, AssistantRecord)
    assert cut.cut == "cancelled"
    assert cut.content
    assert " ".join(["slowly"] * 100).startswith(cut.content)
    assert core.log()[-1].reason == "cancelled"  # type: ignore[union-attr]


# -- the registry of sessions --------------------------------------------------------------------


async def test_two_sessions_keep_their_own_logs(core: Core, served: Any) -> None:
    served[0].replies = [Reply(content="in the first"), Reply(content="in the second")]
    async with core.running() as first:
        assert core.sessions is not None
        second, second_id = await core.sessions.attach("new")
        subscriptions = [await first.subscribe(100), await second.subscribe(100)]
        await first.send("t1", "one")
        await collect(subscriptions[0], 1)
        await second.send("t1", "two")  # the same turn id: another session's
        await collect(subscriptions[1], 1)
        listed = (await core.sessions.sessions()).sessions
        assert [s.id for s in listed] == [core.first, second_id]
        assert [s.turns for s in listed] == [1, 1]
        assert (await first.status()).session == core.first
    assert second_id != core.first
    assert [r.content for r in core.log() if isinstance(r, UserRecord)] == ["one"]
    assert [r.content for r in core.log(second_id) if isinstance(r, UserRecord)] == ["two"]


async def test_attaching_to_a_live_session_shares_its_actor(core: Core, served: Any) -> None:
    served[0].replies = [Reply(content="seen by both")]
    async with core.running() as first:
        assert core.sessions is not None
        again, session = await core.sessions.attach(core.first)
        latest, latest_id = await core.sessions.attach("latest")
        assert again is first
        assert latest is first
        assert session == latest_id == core.first
        watching = await again.subscribe(100)
        await first.send("t1", "hello")
        got = await collect(watching, 1)
    assert isinstance(got[-1].item, TurnDone)


async def test_a_session_nobody_is_in_stops_once_its_turn_ends_and_opens_again(
    core: Core, served: Any
) -> None:
    served[0].replies = [Reply(kind="stall")]
    async with core.running() as first:
        assert core.sessions is not None
        await first.send("t1", "runs on without its client")
        await trio.testing.wait_all_tasks_blocked()
        core.sessions.detach(first)
        assert core.sessions.live == 1  # its turn still runs
        assert await first.cancel("t1")
        with trio.fail_after(5):
            while core.sessions.live:  # noqa: ASYNC110 - the actor stops on its own
                await trio.sleep(0.01)
        again, session = await core.sessions.attach(core.first)
        assert session == core.first
        assert again is not first
        assert [r.kind for r in (await again.history()).records] == ["user", "turn_end"]
    assert core.kinds() == ["user", "turn_end"]


async def test_a_turn_that_waits_for_a_slot_says_so_and_runs_when_one_is_free(
    core: Core, served: Any
) -> None:
    """The scripted server has one slot: a second session's turn waits for it."""
    fake, server = served
    fake.replies = [Reply(kind="stall"), Reply(content="my turn")]
    async with core.running() as first:
        assert core.sessions is not None
        second, _ = await core.sessions.attach("new")
        watching = await second.subscribe(100)
        await first.send("t1", "holds the slot")
        with trio.fail_after(5):
            await server.wait_until(lambda: len(server.requests) == 1)  # it stalls there
        await second.send("t2", "waits for it")
        with trio.fail_after(5):
            got = await next_of(watching, Queued)
        assert got == Queued()
        assert await first.cancel("t1")
        with trio.fail_after(5):
            done = await next_of(watching, TurnDone)
    assert done.outcome.content == "my turn"


async def test_one_session_more_than_max_live_is_refused(tmp_path: Path, served: Any) -> None:
    core = Core(tmp_path, served[1], max_live=2)
    async with core.running():
        assert core.sessions is not None
        await core.sessions.attach("new")
        with pytest.raises(TooManySessions, match=r"\[session\] max_live"):
            await core.sessions.attach("new")
        await core.sessions.attach(core.first)  # one it serves already is no more


async def test_history_pages_from_the_start_or_the_end(core: Core, served: Any) -> None:
    served[0].replies = [Reply(content="a"), Reply(content="b")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "one")
        await actor.send("t2", "two")
        await collect(subscription, 2)
        whole = await actor.history()
        last_two = await actor.history(-2)
        middle = await actor.history(1, 3)
    assert whole.session == core.first
    assert [r.kind for r in whole.records] == core.kinds()
    assert (last_two.start, list(last_two.records)) == (len(core.log()) - 2, core.log()[-2:])
    assert (middle.start, list(middle.records)) == (1, core.log()[1:3])
    assert len(whole.records) <= HISTORY_PAGE


async def test_status_tells_the_session_its_turns_and_its_last_usage(
    core: Core, served: Any
) -> None:
    served[0].replies = [Reply(content="hello there")]
    async with core.running() as actor:
        before = await actor.status()
        subscription = await actor.subscribe(100)
        await actor.send("t1", "hi")
        await collect(subscription, 1)
        after = await actor.status()
    assert (before.session, before.turns, before.running, before.last_usage) == (
        core.first,
        0,
        None,
        None,
    )
    assert after.turns == 1
    assert after.last_usage is not None
    assert after.context is not None
    assert after.context > 0


# -- subscribe, unsubscribe ----------------------------------------------------------------------


async def test_a_subscriber_that_falls_behind_is_dropped_not_the_turn(
    core: Core, served: Any
) -> None:
    served[0].replies = [Reply(content=" ".join(["word"] * 50))]
    async with core.running() as actor:
        slow = await actor.subscribe(2)
        steady = await actor.subscribe(1000)
        await actor.send("t1", "talk")
        got = await collect(steady, 1)
        assert slow.lagged
        assert len([m async for m in slow.receive]) == 2  # what fitted, then the end
    assert isinstance(got[-1].item, TurnDone)


async def test_unsubscribe_closes_the_subscription(core: Core, served: Any) -> None:
    served[0].replies = [Reply(content="unheard")]
    async with core.running() as actor:
        gone = await actor.subscribe(100)
        await actor.unsubscribe(gone)
        assert [m async for m in gone.receive] == []
        staying = await actor.subscribe(100)
        await actor.send("t1", "hi")
        await collect(staying, 1)


# -- approvals (decide) ----------------------------------------------------------------------


async def test_decide_once_runs_the_waiting_call(core: Core, served: Any) -> None:
    served[0].replies = [read_file("today.md"), Reply(content="milk")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "what do I buy?")
        needed = await next_of(subscription, ApprovalNeeded)
        assert (needed.call, needed.tool, needed.arguments) == (
            1,
            "read_file",
            {"path": "today.md"},
        )
        pending = (await actor.status()).pending
        assert [(p.turn, p.item) for p in pending] == [("t1", needed)]
        assert not await actor.decide(2, "once")  # no such call waits
        assert await actor.decide(1, "once")
        decided = await next_of(subscription, ApprovalDecided)
        await collect(subscription, 1)
        assert (await actor.status()).pending == ()
    assert decided == ApprovalDecided(call=1, tool="read_file", decision="once", by="user")
    kinds = core.kinds()
    assert kinds[:5] == ["user", "assistant", "usage", "approval_request", "approval"]
    assert "buy milk" in next(r.content for r in core.log() if r.kind == "tool_result")
    assert conversation_problems(core.log()) == []


async def test_decide_deny_runs_nothing_and_tells_the_model(core: Core, served: Any) -> None:
    served[0].replies = [read_file("today.md"), Reply(content="ok")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "read it")
        needed = await next_of(subscription, ApprovalNeeded)
        assert await actor.decide(needed.call, "deny")
        await collect(subscription, 1)
    result = next(r for r in core.log() if r.kind == "tool_result")
    assert result.content == "The call was denied: the user did not approve it"


async def test_cancel_while_a_call_waits_closes_its_approval(core: Core, served: Any) -> None:
    served[0].replies = [read_file("today.md")]
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "read it")
        await next_of(subscription, ApprovalNeeded)
        assert await actor.cancel("t1")
        await collect(subscription, 1)
        assert (await actor.status()).pending == ()
    log = core.log()
    approval = next(r for r in log if r.kind == "approval")
    assert (approval.decision, approval.by) == ("deny", "turn_end")
    assert conversation_problems(log) == []


# -- the whole core ----------------------------------------------------------------------------


async def test_stopping_the_core_mid_turn_leaves_a_valid_log(core: Core, served: Any) -> None:
    fake, server = served
    fake.replies = [Reply(kind="stall")]
    async with core.running() as actor:
        await actor.send("t1", "hello")
        with trio.fail_after(5):
            await server.wait_until(lambda: bool(server.requests))
    assert core.kinds() == ["user", "turn_end"]
    assert core.log()[-1].reason == "cancelled"  # type: ignore[union-attr]


async def test_a_bug_in_a_turn_fails_that_turn_and_the_next_is_served(
    core: Core, served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served[0].replies = [Reply(content="still here")]
    calls = 0

    async def broken_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        return await next_request(*args, **kwargs)

    monkeypatch.setattr("loopd.turn.loop.next_request", broken_once)
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "first")
        await actor.send("t2", "second")
        got = await collect(subscription, 2)
    ends = [m.item for m in got if isinstance(m.item, TurnDone | TurnFailed)]
    assert ends[0] == TurnFailed("error", "loopd failed: KeyError: 'a bug'")
    assert isinstance(ends[1], TurnDone)
    assert ends[1].outcome.content == "still here"
    assert [r.reason for r in core.log() if r.kind == "turn_end"] == ["error", "answer"]


# -- the slot pool -------------------------------------------------------------------------------


NO_FILES = SlotFiles("never", Path("unused"), None, 1)
LLAMA = SimpleNamespace(slot_files=True)
"""A client's engine as the pool reads it: llama-server's, whose slots hold their caches."""


def slots(count: int) -> list[Slot]:
    # The pool only lends slots and knows their server; nothing runs on them here.
    server = cast("Client", SimpleNamespace(base_url="http://llama.test", engine=LLAMA))
    return [Slot(server, n) for n in range(count)]


async def test_acquire_gives_a_free_slot_then_the_owners_hot_one(nursery: trio.Nursery) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(2), NO_FILES)
    async with pool.lease("a") as lease:
        assert lease is not None
        assert (lease.slot.number, lease.hot, lease.evicted) == (0, False, None)
        lease.tokens = 40
    async with pool.lease("b") as other:
        assert other is not None
        assert other.slot.number == 1
    async with pool.lease("a") as again:
        assert again is not None
        assert (again.slot.number, again.hot, again.tokens) == (0, True, 40)


def model_slots(**counts: int) -> list[Slot]:
    """Slots of one server per model (`[models.NAME]`), `counts[NAME]` of each."""
    made = []
    for model, count in counts.items():
        server = cast("Client", SimpleNamespace(base_url=f"http://{model}.test", engine=LLAMA))
        made += [Slot(server, n) for n in range(count)]
    return made


async def test_a_session_is_lent_only_its_models_slots(nursery: trio.Nursery) -> None:
    served = {"http://small.test": "small", "http://big.test": "big"}
    pool: PoolHandle = await nursery.start(
        partial(pool_actor, model_slots(small=1, big=1), NO_FILES, models=served, default="small")
    )
    async with pool.lease("a", model="big") as lease:
        assert lease is not None
        assert lease.slot.client.base_url == "http://big.test"
    async with pool.lease("b") as default:  # a request that names no model: the default's
        assert default is not None
        assert default.slot.client.base_url == "http://small.test"


async def test_a_session_waits_for_its_models_slot_while_anothers_are_free(
    nursery: trio.Nursery,
) -> None:
    served = {"http://small.test": "small", "http://big.test": "big"}
    pool: PoolHandle = await nursery.start(
        partial(pool_actor, model_slots(small=2, big=1), NO_FILES, models=served, default="small")
    )
    got: list[str] = []

    async def turn(owner: str) -> None:
        async with pool.lease(owner, model="big") as lease:
            assert lease is not None
            got.append(lease.slot.client.base_url)

    async with trio.open_nursery() as turns:
        async with pool.lease("a", model="big"):
            turns.start_soon(turn, "b")
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # small's two slots are free, and not lent to big's session
            async with pool.lease("c", model="big", wait=False) as none:
                assert none is None
        await trio.testing.wait_all_tasks_blocked()
    assert got == ["http://big.test"]


async def test_acquire_with_no_free_slot_takes_the_least_recently_used(
    nursery: trio.Nursery,
) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(2), NO_FILES)
    for owner in ("a", "b", "a"):  # b's slot is now the one given back longest ago
        async with pool.lease(owner):
            pass
    async with pool.lease("c") as lease:
        assert lease is not None
        assert (lease.slot.number, lease.hot, lease.evicted) == (1, False, "b")
        pool.saved("b")
        lease.evicted = None
    views = await pool.views()
    assert [(v.session, v.busy) for v in views] == [("a", False), ("c", False)]


async def test_acquire_waits_while_every_slot_is_busy_and_in_order(
    nursery: trio.Nursery,
) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(1), NO_FILES)
    got: list[str] = []

    async def turn(owner: str) -> None:
        async with pool.lease(owner) as lease:
            assert lease is not None
            got.append(owner)

    async with trio.open_nursery() as turns, pool.lease("a"):
        turns.start_soon(turn, "b")
        await trio.testing.wait_all_tasks_blocked()
        turns.start_soon(turn, "c")
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        assert [v.busy for v in await pool.views()] == [True]
    assert got == ["b", "c"]


async def test_a_lease_granted_as_its_asker_is_cancelled_is_given_back(
    nursery: trio.Nursery,
) -> None:
    """The slot comes free and the waiting turn is cancelled in the same pass of trio's loop.
    Which of the pool and the turn runs next is trio's choice; where it is the pool, it
    grants the slot to an asker that will never read it, and must have it back. Twenty
    rounds: each order comes in about half of them."""
    pool: PoolHandle = await nursery.start(pool_actor, slots(1), NO_FILES)
    for _ in range(20):
        waiting = trio.CancelScope()

        async def turn(waiting: trio.CancelScope = waiting) -> None:
            with waiting:
                async with pool.lease("b"):
                    raise AssertionError("a cancelled turn ran")  # pragma: no cover

        async with trio.open_nursery() as turns, pool.lease("a") as held:
            assert held is not None
            turns.start_soon(turn)
            await trio.testing.wait_all_tasks_blocked()
            waiting.cancel()  # and "a" gives its slot back, without a checkpoint between
        assert waiting.cancelled_caught
        async with pool.lease("a", wait=False) as again:
            assert again is not None  # not lent for good to the cancelled turn
            assert again.hot  # and it still holds a's cache


async def test_hot_only_and_no_wait_answer_none_at_once(nursery: trio.Nursery) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(1), NO_FILES)
    async with pool.lease("a", hot_only=True) as lease:
        assert lease is None  # no slot holds a's cache
    async with pool.lease("a"), pool.lease(None, wait=False) as side:
        assert side is None  # the only slot is busy
    async with pool.lease(None, wait=False) as side:
        assert side is not None
        assert side.evicted == "a"
        pool.saved("a")
        side.evicted = None
    assert [v.session for v in await pool.views()] == [None]  # a summary holds nobody's


async def test_an_evicted_session_waits_until_its_cache_is_saved(nursery: trio.Nursery) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(2), NO_FILES)
    async with pool.lease("a"):
        pass
    async with pool.lease("x"):
        pass
    granted = trio.Event()

    async def a_again() -> None:
        async with pool.lease("a") as lease:
            assert lease is not None
            assert not lease.hot
            granted.set()

    async with pool.lease("b") as taking:  # takes a's slot, the least recently used
        assert taking is not None
        assert taking.evicted == "a"
        nursery.start_soon(a_again)
        await trio.testing.wait_all_tasks_blocked()
        assert not granted.is_set()  # x's slot is idle, but a's file is not written yet
        pool.saved("a")
        taking.evicted = None
        with trio.fail_after(5):
            await granted.wait()


async def test_reset_forgets_what_idle_slots_held(nursery: trio.Nursery) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(2), NO_FILES)
    async with pool.lease("a"):
        pass
    async with pool.lease("b") as busy:
        assert busy is not None
        pool.reset("http://llama.test")
        assert [v.session for v in await pool.views()] == [None, "b"]
    async with pool.lease("a") as lease:
        assert lease is not None
        assert not lease.hot


async def test_a_move_takes_an_idle_slot_of_another_server_and_counts_the_first_down(
    nursery: trio.Nursery,
) -> None:
    one, two = (
        cast("Client", SimpleNamespace(base_url=url, engine=LLAMA))
        for url in ("http://1", "http://2")
    )
    pool: PoolHandle = await nursery.start(pool_actor, [Slot(one, 0), Slot(two, 0)], NO_FILES)
    async with pool.lease("a") as lease:
        assert lease is not None
        async with pool.lease("b") as busy:  # the other server's only slot
            assert busy is not None
            assert not await pool.move(lease)  # none idle elsewhere: it stays
            assert (lease.slot.client, lease.index) == (one, 0)
        assert await pool.move(lease)
        assert (lease.slot.client, lease.index, lease.hot, lease.evicted) == (two, 1, False, "b")
        pool.saved("b")
        lease.evicted = None
        views = await pool.views()
        assert [(v.session, v.busy) for v in views] == [(None, False), ("a", True)]
        async with pool.lease("c", wait=False) as other:
            assert other is None  # the server it left counts as not answering
        pool.health("http://1", up=True)
        async with pool.lease("c", wait=False) as other:
            assert other is not None
            assert other.slot.client is one
    assert [v.session for v in await pool.views()] == ["c", "a"]


async def test_a_session_whose_slot_went_to_another_takes_one_on_the_server_it_ran_on(
    nursery: trio.Nursery,
) -> None:
    """On vLLM no slot holds a session's cache, the server does: a session that lost its slot
    takes an idle one of the same server, not a free one elsewhere."""
    vllm = SimpleNamespace(slot_files=False)
    one, two = (
        cast("Client", SimpleNamespace(base_url=url, engine=vllm))
        for url in ("http://1", "http://2")
    )
    states = [Slot(two, 0), Slot(two, 1), Slot(one, 0)]
    pool: PoolHandle = await nursery.start(pool_actor, states, NO_FILES)
    async with pool.lease("a", prefer="http://1") as a, pool.lease("b") as b:
        assert a is not None
        assert b is not None
        assert (a.slot.client, b.slot.client) == (one, two)
    async with pool.lease("c", prefer="http://1") as c:  # c takes the slot a had
        assert c is not None
        assert c.evicted == "a"
        pool.saved("a")
        c.evicted = None
    async with pool.lease("a") as again:
        assert again is not None
        assert not again.hot
        assert again.slot.client is one  # not the free slot of the other server


async def test_a_bug_in_the_slot_pool_fails_what_it_held_and_the_pool_serves_on(
    core: Core, served: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scripted server has one slot: a's turn holds it (waiting for an approval) and b's
    waits for it when the pool fails. b's wait fails, a's turn goes on, and the restarted pool
    still knows a's slot is lent: b's next turn waits for it, and runs once a gives it back."""
    served[0].replies = [read_file("today.md"), Reply(content="a is done"), Reply(content="b ran")]
    plant_bug(monkeypatch, _Pool, _Views)
    lost = "the slot pool failed (KeyError: 'a bug') while it held this request: send it again"
    async with core.running() as a:
        assert core.sessions is not None
        assert core.pool is not None
        b, _ = await core.sessions.attach("new")
        a_events, b_events = await a.subscribe(100), await b.subscribe(100)
        await a.send("a1", "read my note")
        with trio.fail_after(5):
            needed = await next_of(a_events, ApprovalNeeded)
        await b.send("b1", "waits for the slot")
        with trio.fail_after(5):
            await next_of(b_events, Queued)
        with pytest.raises(ActorFailed) as failed:
            await core.pool.views()
        assert str(failed.value) == lost
        with trio.fail_after(5):
            assert await next_of(b_events, TurnFailed) == TurnFailed("error", lost)
        await b.send("b2", "waits again")
        with trio.fail_after(5):
            assert await next_of(b_events, object) == Queued()  # its first event: not lent twice
        assert [v.busy for v in await core.pool.views()] == [True]
        assert await a.decide(needed.call, "once")
        with trio.fail_after(5):
            a_done = await next_of(a_events, TurnDone)
            b_done = await next_of(b_events, TurnDone)
    assert (a_done.outcome.content, b_done.outcome.content) == ("a is done", "b ran")
    assert "the slot pool failed, and starts again (1 of 5 restarts within 60 s)" in caplog.text
    assert "KeyError: 'a bug'" in caplog.text  # the traceback


async def test_a_bug_in_the_tool_port_fails_that_decision_and_the_session_goes_on(
    core: Core, served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served[0].replies = [read_file("today.md"), Reply(content="milk")]
    plant_bug(monkeypatch, _PortActor, _Decide)
    async with core.running() as actor:
        subscription = await actor.subscribe(100)
        await actor.send("t1", "what do I buy?")
        with trio.fail_after(5):
            needed = await next_of(subscription, ApprovalNeeded)
        with pytest.raises(ActorFailed, match=r"^the tool port failed \(KeyError: 'a bug'\)"):
            await actor.decide(needed.call, "once")
        assert [p.item for p in (await actor.status()).pending] == [needed]  # it still waits
        assert await actor.decide(needed.call, "once")
        with trio.fail_after(5):
            done = await next_of(subscription, TurnDone)
    assert done.outcome.content == "milk"


async def test_a_release_the_pool_fails_on_still_frees_the_slot(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool: PoolHandle = await nursery.start(pool_actor, slots(1), NO_FILES)
    plant_bug(monkeypatch, _Pool, _Release)
    async with pool.lease("a"):
        pass
    with trio.fail_after(5):
        async with pool.lease("b") as lease:
            assert lease is not None
            assert not lease.hot  # what the slot held was forgotten
    assert [(v.session, v.busy) for v in await pool.views()] == [("b", False)]


async def test_a_pool_that_keeps_failing_stops_loopd_saying_why(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant_bug(monkeypatch, _Pool, _Views, math.inf)
    why = r"the slot pool failed 6 times within 60 s, the last time with KeyError: 'a bug'"
    with pytest.RaisesGroup(pytest.RaisesExc(GaveUp, match=f"^{why}$"), flatten_subgroups=True):
        async with core.running():
            assert core.pool is not None
            for _ in range(5):
                with pytest.raises(ActorFailed):
                    await core.pool.views()
            with contextlib.suppress(ActorFailed):
                await core.pool.views()
            await trio.sleep_forever()  # the core stops


async def test_a_core_fixture_is_closed_cleanly(tmp_path: Path) -> None:
    """The store holds nothing open once the core stops: the session can be opened again."""
    core = Core(tmp_path, ReplayServer([]))
    async with trio.open_nursery() as nursery:
        await nursery.start(core.server.run)
        async with core.running():
            pass
        nursery.cancel_scope.cancel()
    with await core.store.open(core.first):
        pass


async def test_a_bug_answering_a_message_fails_that_request_and_the_session_goes_on(
    core: Core, served: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    served[0].replies = [Reply(content="still here")]
    status = SessionActor._status
    tripped = False

    async def broken(actor: SessionActor) -> Any:
        nonlocal tripped
        if not tripped:
            tripped = True
            raise KeyError("a bug")
        return await status(actor)

    monkeypatch.setattr(SessionActor, "_status", broken)
    async with core.running() as actor:
        with pytest.raises(ActorFailed, match=r"^session \S+ failed \(KeyError: 'a bug'\)"):
            await actor.status()
        assert (await actor.status()).session == core.first
        subscription = await actor.subscribe(100)
        await actor.send("t1", "are you there?")
        with trio.fail_after(5):
            done = await next_of(subscription, TurnDone)
    assert done.outcome.content == "still here"
    assert "KeyError: 'a bug'" in caplog.text  # with its traceback


async def test_a_bug_in_a_session_actor_fails_that_session_alone_and_it_opens_again(
    core: Core, served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor's own work between turns (here: telling the registry it is idle, after its
    first turn) raises: that session fails (`error`), another session answers, and the failed
    one opens again."""
    served[0].replies = [Reply(content="one"), Reply(content="two"), Reply(content="three")]
    idle = _Hooks.idle
    calls = 0

    def broken(hooks: _Hooks) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # patched once it runs: the first call is after its first turn
            raise KeyError("a bug")
        idle(hooks)

    async with core.running() as actor:
        assert core.sessions is not None
        subscription = await actor.subscribe(100)
        monkeypatch.setattr(_Hooks, "idle", broken)
        await actor.send("t1", "first")
        with trio.fail_after(5):
            failed = [m async for m in subscription.receive if isinstance(m, SessionFailed)]
        assert [(f.session, f.fault) for f in failed] == [(core.first, "error")]
        failed_one = failed[0]
        assert failed_one.message == "loopd failed: KeyError: 'a bug'"
        other, _ = await core.sessions.attach("new")
        others = await other.subscribe(100)
        await other.send("o1", "hello")
        with trio.fail_after(5):
            assert (await next_of(others, TurnDone)).outcome.content == "two"
        again, opened = await core.sessions.attach(core.first)
        assert opened == core.first
        kinds = [r.kind for r in (await again.history()).records]
        assert kinds[-3:] == ["assistant", "usage", "turn_end"]
