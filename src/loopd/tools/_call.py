"""One call of the model, from its raw name and arguments to the text it reads back.

This is the boundary around every tool call: whatever the arguments, the registry, a schema,
the port or a tool raise becomes a text for the model, never an exception in the turn (only
cancellation passes, so a cancelled turn still ends its call at once).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loopd.session.records import DataClass, Mode
from loopd.wire.events import FileChange

from ._dispatch import Local, dispatch
from ._registry import Registry
from ._types import (
    MESSAGE_LIMIT,
    Asking,
    OnAsking,
    OnDecided,
    OnOutput,
    Result,
    ToolOutput,
    ToolPort,
    ToolRequest,
    for_the_model,
)

__all__ = ["CallOrigin", "CallerTool", "ModelAnswer", "answer_call"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallOrigin:
    """Where a call comes from."""

    session: str
    number: int
    """The session's number for this call."""
    granted: frozenset[str] = frozenset()
    """Tools a person approved for the rest of the session."""
    cwd: Path | None = None
    """The session's own folder; None: all of `[tools] roots`."""
    mode: Mode = "ask"
    """The session's mode."""


CallerTool = Callable[[dict[str, Any], Asking | None], Awaitable[ToolOutput]]
"""A tool its caller runs (`delegate`, a write), given the checked arguments and what the
person approved (None: the call did not wait for approval)."""


@dataclass(frozen=True)
class ModelAnswer:
    text: str
    """What the model reads: the result, or why there is none."""
    data_class: DataClass = "public"
    untrusted: bool = False
    change: FileChange | None = None
    """What a write made of its file, when it made it."""


async def answer_call(  # noqa: PLR0913 - one call's whole context
    registry: Registry,
    port: ToolPort,
    name: str,
    arguments: str,
    origin: CallOrigin,
    *,
    find_limit: int,
    on_asking: OnAsking,
    own: Mapping[str, CallerTool] | None = None,
    on_decided: OnDecided | None = None,
    on_output: OnOutput | None = None,
) -> ModelAnswer:
    """The answer to one call as the model sent it; `own`: tools the caller runs itself, by
    name (the port still applies their policy); `on_decided`: hears a person's answer before
    the call runs; `on_output`: its output while it runs, where its tool streams any."""
    try:
        routed = dispatch(registry, name, arguments, find_limit=find_limit, mode=origin.mode)
        if isinstance(routed, Local):
            return ModelAnswer(routed.text)
        request = ToolRequest(
            origin.session,
            origin.number,
            routed.tool,
            routed.arguments,
            origin.granted,
            origin.cwd,
            origin.mode,
            on_output,
        )
        run = (own or {}).get(routed.tool)
        runner = run and partial(run, routed.arguments)
        answered = await port.call(request, on_asking, runner, on_decided)
        change = answered.answer.change if isinstance(answered.answer, Result) else None
        return ModelAnswer(*for_the_model(answered.answer), change=change)
    except Exception as e:
        log.exception(
            "call %d of session %s (%s) failed inside loopd", origin.number, origin.session, name
        )
        return ModelAnswer(f"The call failed inside loopd: {type(e).__name__}: {e}"[:MESSAGE_LIMIT])
