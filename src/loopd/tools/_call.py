"""One call of the model, from its raw name and arguments to the text it reads back.

This is the boundary around every tool call: whatever the arguments, the registry, a schema,
the port or a tool raise becomes a text for the model, never an exception in the turn (only
cancellation passes, so a cancelled turn still ends its call at once).
"""

from __future__ import annotations

import logging

from loopd.records import DataClass

from ._dispatch import Local, dispatch
from ._port import MESSAGE_LIMIT, ToolPort, ToolRequest, for_the_model
from ._registry import Registry

__all__ = ["answer_call"]

log = logging.getLogger(__name__)


async def answer_call(  # noqa: PLR0913 - one call's whole context
    registry: Registry,
    port: ToolPort,
    name: str,
    arguments: str,
    *,
    session: str,
    number: int,
    find_limit: int,
) -> tuple[str, DataClass, bool]:
    """The text for call `number` of `session`, its data class and whether it is untrusted."""
    try:
        routed = dispatch(registry, name, arguments, find_limit=find_limit)
        if isinstance(routed, Local):
            return routed.text, "public", False
        request = ToolRequest(session, number, routed.tool, routed.arguments)
        return for_the_model(await port.call(request))
    except Exception as e:
        log.exception("call %d of session %s (%s) failed inside loopd", number, session, name)
        text = f"The call failed inside loopd: {type(e).__name__}: {e}"[:MESSAGE_LIMIT]
        return text, "public", False
