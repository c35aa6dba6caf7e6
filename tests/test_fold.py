"""A session's state as a fold of its records: records in, state out, no file; and the same
answers as reading every record again, for every sequence of records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from loopd.infer import ToolCall
from loopd.session.baseline import make_baseline
from loopd.session.fold import SessionState
from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    AssistantRecord,
    Mode,
    ModeRecord,
    PlanRecord,
    PlanStep,
    PromptRecord,
    Record,
    SessionHeader,
    ToolResultRecord,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
    current_plan,
    granted_tools,
    now,
    open_approvals,
)
from loopd.session.store import Store
from loopd.turn.exact import past_reasoning

BASELINE = make_baseline("Be brief.")


def header(mode: Mode = "ask", grants: tuple[str, ...] = ()) -> SessionHeader:
    return SessionHeader(
        id="s", created=now(), baseline=BASELINE, loopd_version="0", mode=mode, grants=grants
    )


def asked(call: int, call_id: str = "c1", tool: str = "wipe") -> ApprovalRequestRecord:
    return ApprovalRequestRecord(call=call, tool_call_id=call_id, tool=tool, arguments={})


def answer(*calls: str, tokens: tuple[int, ...] | None = (1, 2)) -> AssistantRecord:
    return AssistantRecord(
        content=None,
        tool_calls=tuple(ToolCall(id=c, name="wipe", arguments="{}") for c in calls),
        tokens=tokens,
    )


def test_a_fold_starts_from_its_header() -> None:
    state = SessionState(header("read_only", ("buy",)))
    assert (state.mode, state.granted, state.turns, state.turn_open) == (
        "read_only",
        {"buy"},
        0,
        False,
    )


def test_a_fold_takes_the_last_mode_and_every_tool_granted_for_the_session() -> None:
    state = SessionState(header(grants=("buy",)))
    records: list[Record] = [
        ModeRecord(mode="accept_edits", thinking=True, model="big"),
        ApprovalRecord(call=1, tool="wipe", decision="session"),
        ApprovalRecord(call=2, tool="web", decision="once"),
        ModeRecord(mode="read_only", model="big"),
    ]
    for record in records:
        state.apply(record)
    assert (state.mode, state.thinking, state.model) == ("read_only", None, "big")
    assert state.granted == {"buy", "wipe"}


def test_a_fold_knows_the_turn_open_and_the_approvals_that_still_wait() -> None:
    waiting = asked(2, "c2")
    state = SessionState(
        header(),
        [
            UserRecord(content="go"),
            answer("c1", "c2"),
            asked(1),
            waiting,
            ApprovalRecord(call=1, tool="wipe", decision="once"),
        ],
    )
    assert (state.turns, state.turn_open, state.last_user, state.last_call) == (1, True, 0, 2)
    assert state.open_approvals == [waiting]
    assert (state.allowed(1), state.allowed(2)) == (True, False)
    state.apply(ApprovalRecord(call=2, tool="wipe", decision="deny"))
    state.apply(TurnEndRecord(reason="answer"))
    assert (state.open_approvals, state.allowed(2), state.turn_open) == ([], False, False)


def test_a_change_of_model_leaves_no_usage_of_the_model_before() -> None:
    usage = UsageRecord(timings=None, reasoning_tokens=3)
    state = SessionState(header(), [usage])
    assert state.last_usage is usage
    state.apply(ModeRecord(mode="ask", model="small"))
    assert state.last_usage is None
    state.apply(ModeRecord(mode="read_only", model="small"))  # the same model: nothing changes
    state.apply(later := UsageRecord(timings=None))
    assert state.last_usage is later


def test_a_fold_counts_the_reasoning_the_exact_prompt_holds_and_keeps_the_plan() -> None:
    plan = PlanRecord(call=1, tool_call_id="p", steps=(PlanStep(step="a", status="pending"),))
    state = SessionState(
        header(),
        [
            PromptRecord(text="p", full=True),
            answer(),
            UsageRecord(timings=None, reasoning_tokens=4),
            plan,
        ],
    )
    assert (state.past_reasoning, state.plan) == (4, plan)
    state.apply(answer(tokens=None))  # history went as messages: the template decides
    assert state.past_reasoning is None


async def test_a_session_folds_what_it_appends_as_it_folds_what_it_reads(tmp_path: Path) -> None:
    store = Store(tmp_path)
    written: list[Record] = [
        UserRecord(content="go"),
        answer("c1"),
        asked(4),
        ModeRecord(mode="read_only", model="m"),
        UsageRecord(timings=None, reasoning_tokens=2),
    ]
    with await store.create(BASELINE) as session:
        for record in written:
            await session.append(record)
        live = vars(session.state) | {"trail": session.state.trail.last()}
        number = session.next_call()
    with await store.open(session.id) as reopened:
        read = vars(reopened.state) | {"trail": reopened.state.trail.last()}
        assert reopened.next_call() == number
    assert read == live


# The old scans, each as it read every record on trio's thread after an open: the fold must
# answer what they answered.


def scanned_turn_open(records: Sequence[Record]) -> bool:
    last_user = max((i for i, r in enumerate(records) if isinstance(r, UserRecord)), default=-1)
    return last_user >= 0 and not any(isinstance(r, TurnEndRecord) for r in records[last_user:])


def scanned_allowed(records: Sequence[Record]) -> set[int]:
    return {r.call for r in records if isinstance(r, ApprovalRecord)} - {
        r.call for r in records if isinstance(r, ApprovalRecord) and r.decision == "deny"
    }


def scanned_last_answer(records: Sequence[Record]) -> tuple[int, AssistantRecord] | None:
    for index in range(len(records) - 1, -1, -1):
        if isinstance(last := records[index], AssistantRecord):
            return index, last
    return None


def scanned_mode(start: SessionHeader, records: Sequence[Record]) -> tuple[object, ...]:
    """Mode, thinking and model, and the last usage on that model (`Session._note`,
    `Session.last_usage`)."""
    mode, thinking, model, since = start.mode, start.thinking, None, 0
    for at, record in enumerate(records, start=1):
        if isinstance(record, ModeRecord):
            mode, thinking = record.mode, record.thinking
            if record.model != model:
                model, since = record.model, at
    usage = next(
        (r for r in reversed(records[since:]) if isinstance(r, UsageRecord)),
        None,
    )
    return mode, thinking, model, usage


calls = st.integers(1, 4)
call_ids = st.sampled_from(["c1", "c2", "c3"])
tools = st.sampled_from(["wipe", "buy", "web"])
generated: st.SearchStrategy[Record] = st.one_of(
    st.builds(UserRecord, content=st.just("u")),
    st.builds(
        AssistantRecord,
        content=st.none(),
        tool_calls=st.lists(
            st.builds(ToolCall, id=call_ids, name=tools, arguments=st.just("{}")), max_size=3
        ).map(tuple),
        tokens=st.none() | st.lists(st.integers(0, 9), max_size=3).map(tuple),
    ),
    st.builds(PromptRecord, text=st.just("p"), full=st.booleans()),
    st.builds(UsageRecord, timings=st.none(), reasoning_tokens=st.integers(0, 9)),
    st.builds(
        ModeRecord,
        mode=st.sampled_from(["ask", "accept_edits", "read_only"]),
        thinking=st.none() | st.booleans(),
        model=st.none() | st.sampled_from(["a", "b"]),
    ),
    st.builds(
        ToolResultRecord, call=calls, tool_call_id=call_ids, name=tools, content=st.just("r")
    ),
    st.builds(
        ApprovalRequestRecord, call=calls, tool_call_id=call_ids, tool=tools, arguments=st.just({})
    ),
    st.builds(
        ApprovalRecord,
        call=calls,
        tool=tools,
        decision=st.sampled_from(["once", "session", "deny"]),
    ),
    st.builds(PlanRecord, call=calls, tool_call_id=call_ids, steps=st.just(())),
    st.builds(TurnEndRecord, reason=st.sampled_from(["answer", "cancelled", "error"])),
)


@settings(max_examples=400, deadline=None)
@given(
    records=st.lists(generated, max_size=30),
    mode=st.sampled_from(["ask", "accept_edits", "read_only"]),
    grants=st.lists(tools, max_size=2).map(tuple),
)
def test_the_fold_answers_what_a_scan_of_every_record_answers(
    records: list[Record], mode: Mode, grants: tuple[str, ...]
) -> None:
    start = header(mode, grants)
    state = SessionState(start, records)
    users = [i for i, r in enumerate(records) if isinstance(r, UserRecord)]
    assert state.turns == len(users)
    assert state.last_user == max(users, default=-1)
    assert state.turn_open == scanned_turn_open(records)
    assert state.open_approvals == open_approvals(records)
    assert {c for c in range(6) if state.allowed(c)} == scanned_allowed(records)
    assert state.last_answer == scanned_last_answer(records)
    assert state.granted == set(grants) | granted_tools(records)
    assert state.plan == current_plan(records)
    assert state.past_reasoning == past_reasoning(records)
    assert (state.mode, state.thinking, state.model, state.last_usage) == scanned_mode(
        start, records
    )
    results = [r.call for r in records if isinstance(r, ToolResultRecord | ApprovalRequestRecord)]
    assert state.last_call == max(results, default=0)
