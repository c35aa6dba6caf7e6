"""The events of a turn, as clients see them: the inference events passed on one to one, and
the turn's own (a tool call starting, its result, a cache loss)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field

from loopd.infer import Content, Progress, Queued, Reasoning, Retrying, ThinkingCapped, Waiting
from loopd.records import DataClass

__all__ = ["CacheLoss", "ToolCallStarted", "ToolResult", "TurnEvent"]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)


class ToolCallStarted(_Event):
    """The model called a tool; it is about to be answered."""

    kind: Literal["tool_call_started"] = "tool_call_started"
    name: str
    """The tool the model named (`find_tool`, `call_tool`, or another it made up)."""
    call: int
    """The session's number for this call."""
    tool: str | None = None
    """For `call_tool`: the tool it asks for, when the arguments name one."""


class ToolResult(_Event):
    """The answer to a call is in the log."""

    kind: Literal["tool_result"] = "tool_result"
    name: str
    call: int
    data_class: DataClass = Field(alias="class")
    untrusted: bool
    truncated: bool
    preview: str
    """The first line of the result, shortened."""


class CacheLoss(_Event):
    """The request found fewer tokens in the KV cache than the previous prompt held."""

    kind: Literal["cache_loss"] = "cache_loss"
    expected: int
    cached: int


TurnEvent = Annotated[
    Queued
    | Waiting
    | Progress
    | Reasoning
    | Content
    | ThinkingCapped
    | Retrying
    | ToolCallStarted
    | ToolResult
    | CacheLoss,
    Discriminator("kind"),
]
