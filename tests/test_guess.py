"""A request sent from a guessed rendering of its new message, checked as it goes
(`loopd.turn.guess`): the guess kept only where it can be put back, the answer held until the
check, a wrong guess cancelled before anything of it is passed on."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from loopd.infer import (
    AnyRequest,
    ChatEvent,
    ChatRequest,
    Completion,
    ConnectError,
    Content,
    EventSink,
    Progress,
    Sent,
)
from loopd.session.records import PromptRecord
from loopd.session.store import StoreError
from loopd.turn.guess import SAID, Guessed, Request, Shapes, send

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]


def _said(words: str) -> list[dict[str, Any]]:
    return [CONVERSATION[0], {"role": "user", "content": words}]


def test_a_rendering_is_kept_by_the_conversation_around_the_users_words() -> None:
    shapes = Shapes()
    first = Shapes.key(_said("Hello there."), "tools")
    assert first is not None
    shapes.keep(first, "<s>Be brief.</s><u>Hello there.</u><a>")
    nxt = Shapes.key(_said("And now?"), "tools")
    assert nxt is not None
    assert shapes.guess(nxt) == "<s>Be brief.</s><u>And now?</u><a>"
    # Other tools, or other messages around the words: no guess.
    assert shapes.guess(Shapes.key(_said("And now?"), "other tools")) is None  # type: ignore[arg-type]
    other = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "x"}]
    assert shapes.guess(Shapes.key(other, "tools")) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("said", "rendered"),
    [
        ("  padded  ", "<u>padded</u>"),  # the template trimmed the words: not there as said
        ("a", "<s>a system</s><u>a</u>"),  # there twice: which is the user's is not known
        (f"{SAID} itself", f"<u>{SAID} itself</u>"),
    ],
)
def test_a_rendering_the_words_cannot_be_put_back_into_is_not_kept(
    said: str, rendered: str
) -> None:
    shapes = Shapes()
    key = Shapes.key(_said(said), "tools")
    assert key is not None
    shapes.keep(key, rendered)
    assert shapes.guess(key) is None


def test_a_sessions_tools_are_dumped_once_for_its_keys() -> None:
    shapes = Shapes()
    tools = ({"type": "function", "function": {"name": "read", "parameters": {"b": 1, "a": 2}}},)
    named = shapes.tools(tools)
    assert shapes.tools(tools) is named  # kept, not dumped again for the next key
    assert shapes.tools(({**tools[0]},)) == named  # the same tools, held elsewhere
    assert shapes.tools(({"type": "function", "function": {"name": "write"}},)) != named


def test_no_guess_where_the_conversation_does_not_end_with_the_users_words() -> None:
    assert Shapes.key([*CONVERSATION, {"role": "tool", "content": "r"}]) is None
    assert Shapes.key([CONVERSATION[0], {"role": "user", "content": ""}]) is None


GUESSED = ChatRequest(messages=[{"role": "user", "content": "guessed"}])
RIGHT = ChatRequest(messages=[{"role": "user", "content": "right"}])
RECORD = PromptRecord(text="guessed")
RIGHT_RECORD = PromptRecord(text="right")


class Model:
    """Answers each request with a progress event and three words, a checkpoint between each."""

    def __init__(self) -> None:
        self.sent: list[AnyRequest] = []
        self.finished: list[AnyRequest] = []

    @property
    def retry(self) -> Any:
        raise NotImplementedError

    @property
    def reached(self) -> bool:
        return True

    async def chat(
        self, request: AnyRequest, on_event: EventSink, *, sent: Sent | None = None
    ) -> Completion:
        self.sent.append(request)
        if sent is not None:
            sent()  # written at once
        on_event(Progress(total=3, cache=0, processed=3))
        words = request.messages[0]["content"]  # type: ignore[union-attr]
        for word in (words, " is", " said"):
            await trio.sleep(0.01)
            on_event(Content(text=word))
        self.finished.append(request)
        return Completion(
            content=f"{words} is said", reasoning_content=None, finish_reason="stop", timings=None
        )


def _checked(after: float, right: Request | None) -> Guessed:
    async def check() -> Request | None:
        await trio.sleep(after)
        return right

    return Guessed((GUESSED, RECORD), check)


@pytest.mark.parametrize("after", [0.0, 0.015, 1.0], ids=["before", "during", "after"])
async def test_a_right_guess_passes_its_answer_on_once_checked(after: float) -> None:
    """Whenever the check ends (before the answer starts, during it, after it ended), the
    events are passed on once each, in order, and none before the check."""
    model, seen, checked = Model(), list[ChatEvent](), trio.Event()

    def on_event(event: ChatEvent) -> None:
        assert checked.is_set() or after == 0.0
        seen.append(event)

    async def check() -> Request | None:
        await trio.sleep(after)
        checked.set()
        return None

    completion, record = await send(model, Guessed((GUESSED, RECORD), check), on_event)
    assert completion.content == "guessed is said"
    assert record is RECORD
    assert model.sent == [GUESSED]
    assert [getattr(e, "text", None) for e in seen] == [None, "guessed", " is", " said"]


@pytest.mark.parametrize("after", [0.0, 0.015, 1.0], ids=["before", "during", "after"])
async def test_a_wrong_guess_is_cancelled_and_nothing_of_it_passed_on(after: float) -> None:
    model, seen = Model(), list[ChatEvent]()
    completion, record = await send(model, _checked(after, (RIGHT, RIGHT_RECORD)), seen.append)
    assert completion.content == "right is said"
    assert record is RIGHT_RECORD
    assert model.sent == [GUESSED, RIGHT]
    assert "".join(getattr(e, "text", "") for e in seen) == "right is said"
    assert (GUESSED in model.finished) == (after == 1.0)  # cut short unless it had ended


async def test_a_failed_guessed_request_fails_once_the_guess_is_known_right() -> None:
    class Failing(Model):
        async def chat(
            self, _request: AnyRequest, _on_event: EventSink, *, sent: Sent | None = None
        ) -> Completion:
            del sent  # fails before anything is written
            raise RuntimeError("the server went away")

    with pytest.raises(RuntimeError, match="went away"):
        await send(Failing(), _checked(0.01, None), lambda _: None)
    # A wrong guess's failure is the guess's: the right request is sent.
    model = Model()
    calls = 0

    async def chat(
        request: AnyRequest, on_event: EventSink, *, sent: Sent | None = None
    ) -> Completion:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the guessed one")
        return await Model.chat(model, request, on_event, sent=sent)

    model.chat = chat  # type: ignore[method-assign]
    completion, _ = await send(model, _checked(0.01, (RIGHT, RIGHT_RECORD)), lambda _: None)
    assert completion.content == "right is said"


async def test_a_failed_check_raises_its_own_error() -> None:
    """Raised as it is, not in a group: the turn retries a server that went away."""

    async def check() -> Request | None:
        raise ConnectError("cannot connect to llama-server", None)

    model = Model()
    with pytest.raises(ConnectError):
        await send(model, Guessed((GUESSED, RECORD), check), lambda _: None)
    assert model.finished == []  # the guessed request was cancelled


@pytest.mark.parametrize("guessed", [True, False], ids=["guessed", "rendered"])
@pytest.mark.parametrize("after", [0.0, 0.015, 1.0], ids=["before", "during", "after"])
async def test_nothing_is_passed_on_before_the_question_is_durable(
    guessed: bool, after: float
) -> None:
    model, seen, durable = Model(), list[ChatEvent](), trio.Event()

    def on_event(event: ChatEvent) -> None:
        assert durable.is_set()
        seen.append(event)

    async def first() -> None:
        await trio.sleep(after)
        durable.set()

    request = _checked(0.0, None) if guessed else (GUESSED, RECORD)
    completion, record = await send(model, request, on_event, first=first)
    assert (completion.content, record) == ("guessed is said", RECORD)
    assert [getattr(e, "text", None) for e in seen] == [None, "guessed", " is", " said"]


async def test_a_question_that_cannot_be_made_durable_fails_its_request() -> None:
    model = Model()

    async def first() -> None:
        await trio.sleep(0.015)
        raise StoreError("cannot write its records to disk")

    seen = list[ChatEvent]()
    with pytest.raises(StoreError):
        await send(model, (GUESSED, RECORD), seen.append, first=first)
    assert (seen, model.finished) == ([], [])


async def test_the_question_is_made_durable_even_where_the_check_fails() -> None:
    """The turn then waits for the server to come back: its question must be on disk."""

    async def check() -> Request | None:
        raise ConnectError("cannot connect to llama-server", None)

    durable = trio.Event()

    async def first() -> None:
        await trio.sleep(0.015)
        durable.set()

    with pytest.raises(ConnectError):
        await send(Model(), Guessed((GUESSED, RECORD), check), lambda _: None, first=first)
    assert durable.is_set()


async def test_the_check_and_the_fsync_start_once_the_request_is_written() -> None:
    """The server has the request before the work beside it takes the process's time."""
    order: list[str] = []

    class Slow(Model):
        async def chat(
            self, request: AnyRequest, on_event: EventSink, *, sent: Sent | None = None
        ) -> Completion:
            await trio.sleep(0.01)  # connecting, writing
            order.append("written")
            return await super().chat(request, on_event, sent=sent)

    async def check() -> Request | None:
        order.append("check")
        return None

    async def first() -> None:
        order.append("fsync")

    await send(Slow(), Guessed((GUESSED, RECORD), check), lambda _: None, first=first)
    assert order[0] == "written"
    assert sorted(order[1:]) == ["check", "fsync"]


async def test_no_task_is_made_on_the_way_to_the_request() -> None:
    """The check's and the fsync's tasks are made once the request is written: making them
    before would cost every first token that much."""
    before_written: list[int] = []

    class Counting(Model):
        async def chat(
            self, request: AnyRequest, on_event: EventSink, *, sent: Sent | None = None
        ) -> Completion:
            nurseries = trio.lowlevel.current_task().child_nurseries
            before_written.append(sum(len(n.child_tasks) for n in nurseries))
            return await super().chat(request, on_event, sent=sent)

    async def check() -> Request | None:
        return None

    async def first() -> None:
        pass

    await send(Counting(), Guessed((GUESSED, RECORD), check), lambda _: None, first=first)
    assert before_written == [0]


async def test_a_request_cancelled_before_it_is_written_starts_no_work_beside_it() -> None:
    started: list[str] = []

    class Never(Model):
        async def chat(
            self, _request: AnyRequest, _on_event: EventSink, *, sent: Sent | None = None
        ) -> Completion:
            del sent  # never written
            await trio.sleep_forever()  # still connecting when the turn is cancelled
            raise AssertionError

    async def check() -> Request | None:
        started.append("check")
        return None

    async def first() -> None:
        started.append("fsync")

    with trio.move_on_after(0.01):
        await send(Never(), Guessed((GUESSED, RECORD), check), lambda _: None, first=first)
    assert started == []
