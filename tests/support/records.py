"""Hypothesis strategies for session records."""

from __future__ import annotations

from hypothesis import strategies as st

from loopd.infer import Timings, ToolCall
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    Record,
    SummaryRecord,
    ToolResultRecord,
    TurnEndRecord,
    UnreadRecord,
    UsageRecord,
    UserRecord,
)

# Any text a model or a user could produce; lone surrogates cannot be UTF-8 at all.
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
small = st.integers(min_value=0, max_value=100_000)

tool_calls = st.builds(ToolCall, id=text, name=text, arguments=text)
timings = st.builds(
    Timings,
    cache_n=small,
    prompt_n=small,
    predicted_n=small,
    prompt_ms=st.floats(0, 1e6),
    predicted_ms=st.floats(0, 1e6),
)

records: st.SearchStrategy[Record] = st.one_of(
    st.builds(UserRecord, content=text),
    st.builds(
        AssistantRecord,
        content=st.none() | text,
        reasoning_content=st.none() | text,
        tool_calls=st.lists(tool_calls, max_size=3).map(tuple),
    ),
    st.builds(
        UsageRecord,
        timings=st.none() | timings,
        reasoning_tokens=small,
        thinking_capped=st.booleans(),
    ),
    st.builds(CacheLossRecord, expected=small, cached=small),
    st.builds(UnreadRecord, text=text, error=text),
    st.builds(
        ToolResultRecord,
        call=small,
        tool_call_id=text,
        name=text,
        content=text,
        data_class=st.sampled_from(["public", "private", "secret"]),
        untrusted=st.booleans(),
        truncated=st.booleans(),
    ),
    st.builds(
        SummaryRecord,
        session=text,
        text=text,
        timings=st.none() | timings,
        slot=st.integers(0, 8),
        omitted=small,
    ),
    st.builds(
        TurnEndRecord,
        reason=st.sampled_from(["answer", "turn_limit", "session_full", "cancelled", "error"]),
    ),
)
