"""How loopd's events, records and ends of turns read in the Agent Client Protocol: the pure
mapping under `bxctl acp`, case by case."""

from __future__ import annotations

import json

import pytest
from acp import schema

from bxctl.acp_map import (
    SHOWN_OUTPUT,
    command_of,
    decision_of,
    kind_of,
    output_update,
    permission_request,
    replayed,
    stop_reason,
    text_of,
    update_of,
    usage_of,
    usage_update,
)
from loopd.infer import ToolCall
from loopd.session.records import AssistantRecord, FailureKind, Record, ToolResultRecord, UserRecord
from loopd.wire.events import AgentUpdate, ApprovalNeeded, FileChange, ToolResult
from loopd.wire.proto import TurnFailed, Usage

PARENT = "20261202T000000000Z-aaaaaa"


def agent(parent: str = PARENT, **fields: object) -> AgentUpdate:
    values = {"session": "child", "parent": parent, "call": 4, "state": "running"} | fields
    return AgentUpdate.model_validate(values)


def test_a_sub_agents_progress_shows_in_the_call_that_started_it() -> None:
    update = update_of(agent(tool_calls=2, tokens=180, tool="read_file"), PARENT)
    assert isinstance(update, schema.ToolCallProgress)
    assert (update.tool_call_id, update.status) == ("4", "in_progress")
    assert update.content is not None
    text = update.content[0].content.text
    assert text == "sub-agent child: running, 2 tool calls, 180 tokens, last read_file"
    failed = update_of(agent(state="failed", detail="its turn took too long"), PARENT)
    assert isinstance(failed, schema.ToolCallProgress)
    assert failed.status is None  # the call's own result follows
    assert update_of(agent(parent="child"), PARENT) is None  # a sub-agent's own sub-agent


def test_a_failed_or_denied_result_is_a_failed_call() -> None:
    def result(preview: str) -> object:
        event = ToolResult.model_validate(
            {"name": "call_tool", "call": 1, "class": "public", "untrusted": False}
            | {"truncated": False, "preview": preview}
        )
        update = update_of(event, PARENT)
        assert isinstance(update, schema.ToolCallProgress)
        return update.status

    assert result("The tool failed: no such file") == "failed"
    assert result("The call was denied: the user did not approve it") == "failed"
    assert result("Not run: the turn ended first (cancelled).") == "failed"
    assert result("# Today") == "completed"


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("turn_limit", "max_turn_requests"),
        ("session_full", "max_tokens"),
        ("cancelled", "cancelled"),
        ("infer", None),
        ("error", None),
    ],
)
def test_each_end_of_a_turn_has_its_stop_reason_or_is_an_error(
    kind: FailureKind, reason: str | None
) -> None:
    assert stop_reason(TurnFailed(id="p1", kind=kind, message="why")) == reason


def test_usage_is_the_whole_prompt_with_its_cached_part() -> None:
    usage = Usage(
        prompt_n=12,
        cache_n=1200,
        predicted_n=30,
        prompt_ms=1.0,
        predicted_ms=2.0,
        reasoning_tokens=10,
        thinking_capped=False,
    )
    got = usage_of(usage)
    assert got is not None
    assert (got.input_tokens, got.cached_read_tokens, got.output_tokens) == (1212, 1200, 30)
    assert (got.total_tokens, got.thought_tokens) == (1242, 10)
    assert usage_of(None) is None


def test_a_replayed_call_is_named_by_the_tool_it_asked_for() -> None:
    arguments = json.dumps({"name": "read_file", "arguments": {"path": "today.md"}})
    records: list[Record] = [
        UserRecord(content="what do I buy?"),
        AssistantRecord(
            content=None,
            reasoning_content="Read it.",
            tool_calls=(ToolCall(id="c1", name="call_tool", arguments=arguments),),
        ),
        ToolResultRecord(call=1, tool_call_id="c1", name="call_tool", content="milk"),
        AssistantRecord(content="Milk."),
    ]
    updates = list(replayed(records))
    assert [u.session_update for u in updates] == [
        "user_message_chunk",
        "agent_thought_chunk",
        "tool_call",
        "agent_message_chunk",
    ]
    call = updates[2]
    assert isinstance(call, schema.ToolCallStart)
    assert (call.title, call.kind, call.status) == ("read_file", "read", "completed")
    assert call.raw_input == {"path": "today.md"}


def test_a_prompts_blocks_become_one_message() -> None:
    blocks = [
        schema.TextContentBlock(type="text", text="Look at this:"),
        schema.ResourceContentBlock(type="resource_link", name="a.py", uri="file:///w/a.py"),
        schema.EmbeddedResourceContentBlock(
            type="resource",
            resource=schema.TextResourceContents(uri="file:///w/b.py", text="print(1)"),
        ),
    ]
    assert text_of(blocks) == (
        "Look at this:\n\n[a.py](file:///w/a.py)\n\n[file:///w/b.py]\n```\nprint(1)\n```"
    )


def test_the_editors_choice_is_the_decision_and_anything_else_denies() -> None:
    assert [decision_of(o) for o in ("once", "session", "deny")] == ["once", "session", "deny"]
    assert decision_of(None) == "deny"  # the editor cancelled the request
    assert decision_of("allow_everything") == "deny"


def test_the_kinds_of_tools() -> None:
    assert [kind_of(t) for t in ("read_file", "edit_file", "run_command", "find_tool")] == [
        "read",
        "edit",
        "execute",
        "search",
    ]
    assert kind_of("calendar.list_events") == "other"
    assert kind_of(None) == "other"


def test_a_permission_request_shows_a_writes_texts_as_a_diff_and_the_unified_diff_otherwise() -> (
    None
):
    change = FileChange(path="/w/today.md", old_text=None, new_text="buy tea\n")
    asking = ApprovalNeeded(
        call=1,
        tool="write_file",
        arguments={"path": "today.md", "content": "buy tea\n"},
        data_class="public",
        untrusted=False,
        timeout=60,
        preview="+buy tea",
        change=change,
    )
    (diff,) = permission_request("s1", asking).tool_call.content or []
    assert isinstance(diff, schema.FileEditToolCallContent)
    assert (diff.path, diff.old_text, diff.new_text) == ("/w/today.md", None, "buy tea\n")
    binary = asking.model_copy(update={"change": None})  # a binary or too long file
    (text,) = permission_request("s1", binary).tool_call.content or []
    assert isinstance(text, schema.ContentToolCallContent)
    assert isinstance(text.content, schema.TextContentBlock)
    assert text.content.text == "+buy tea"


def test_a_prompt_is_a_command_only_when_it_names_one_of_loopds() -> None:
    assert command_of("/compact") == ("compact", [])
    assert command_of("  /undo 3 \n") == ("undo", ["3"])
    assert command_of("/status please") == ("status", ["please"])
    assert command_of("/fly to the moon") is None  # a message for the model
    assert command_of("please /compact") is None
    assert command_of("") is None


def test_the_usage_update_is_what_the_slot_holds_of_the_window() -> None:
    usage = Usage(
        prompt_n=40,
        cache_n=900,
        predicted_n=61,
        prompt_ms=1.0,
        predicted_ms=2.0,
        reasoning_tokens=0,
        thinking_capped=False,
    )
    update = usage_update(usage, 8192)
    assert update is not None
    assert (update.session_update, update.used, update.size) == ("usage_update", 1000, 8192)
    assert update.field_meta == {"loopd": {"promptTokens": 940, "cachedTokens": 900}}
    assert usage_update(usage, None) is None  # a window loopd was not told
    assert usage_update(None, 8192) is None


def test_a_long_running_commands_output_shows_its_tail_in_whole_lines() -> None:
    output = "".join(f"line {n}\n" for n in range(5000))  # about 43,000 characters
    (content,) = output_update(3, output).content or []
    assert isinstance(content, schema.ContentToolCallContent)
    text = content.content.text
    assert SHOWN_OUTPUT < len(text) < SHOWN_OUTPUT + 100
    first, cut, *_ = text.split("\n")
    assert (first, cut.split()[0]) == ("```", "[...")
    assert text.endswith("line 4999\n```")
    shown = text.split("\n")[2:-1]
    assert shown[0].startswith("line ")  # a whole line, not the end of one
    assert int(cut.split()[1]) + len("\n".join(shown)) + 1 == len(output)
    assert output_update(3, "short\n").content == _content_of("```\nshort\n```")


def _content_of(text: str) -> list[schema.ContentToolCallContent]:
    block = schema.TextContentBlock(type="text", text=text)
    return [schema.ContentToolCallContent(type="content", content=block)]
