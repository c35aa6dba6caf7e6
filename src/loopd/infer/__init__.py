"""The llama-server client: streamed chat completions pinned to a slot, with typed events.

The client itself (`Client`, `Slot` and their kin: httpx, trio) is imported when first named,
so what only needs the types (the records, the wire format, bxctl) starts without it."""

from importlib import import_module
from typing import TYPE_CHECKING

from ._assemble import THINKING_CAP_GRACE
from ._cache import CacheOutcome, Hit, Loss, Unreported, cache_limit, cache_outcome, slot_tokens
from ._errors import (
    BadAnswer,
    ConnectError,
    ConnectionLost,
    HttpError,
    InferError,
    InferTimeout,
    StreamBroken,
    StreamError,
    StreamErrorEvent,
    is_context_full,
    is_retryable,
)
from ._format import (
    CALL_ID,
    ChatFormat,
    FormatError,
    ToolCallFormat,
    delimiter_pattern,
)
from ._health import ServerHealth
from ._learn import learn_format
from ._notation import GEMMA_QUOTE, OPENING, decode_arguments
from ._prompt_json import Prompt
from ._types import (
    BUDGET_MESSAGE,
    ChatEvent,
    ChatRequest,
    Completion,
    Content,
    Generation,
    Progress,
    PromptPiece,
    PromptRequest,
    Queued,
    Reasoning,
    Repeating,
    Retrying,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
    Unread,
    Waiting,
)

if TYPE_CHECKING:
    from ._client import (
        Access,
        AnyRequest,
        Client,
        Cut,
        EventSink,
        RetryPolicy,
        Sent,
        SlotFile,
        Timeouts,
        is_output,
    )
    from ._engines import TITLES, Engine, EngineName, ServerFacts
    from ._slot import Slot

_LAZY = {
    **dict.fromkeys(
        (
            "Access",
            "AnyRequest",
            "Client",
            "Cut",
            "EventSink",
            "RetryPolicy",
            "Sent",
            "SlotFile",
            "Timeouts",
            "is_output",
        ),
        "._client",
    ),
    **dict.fromkeys(("Engine", "EngineName", "ServerFacts", "TITLES"), "._engines"),
    "Slot": "._slot",
}


def __getattr__(name: str) -> object:
    if (module := _LAZY.get(name)) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups find it without this
    return value


__all__ = [
    "BUDGET_MESSAGE",
    "CALL_ID",
    "GEMMA_QUOTE",
    "OPENING",
    "THINKING_CAP_GRACE",
    "TITLES",
    "Access",
    "AnyRequest",
    "BadAnswer",
    "CacheOutcome",
    "ChatEvent",
    "ChatFormat",
    "ChatRequest",
    "Client",
    "Completion",
    "ConnectError",
    "ConnectionLost",
    "Content",
    "Cut",
    "Engine",
    "EngineName",
    "EventSink",
    "FormatError",
    "Generation",
    "Hit",
    "HttpError",
    "InferError",
    "InferTimeout",
    "Loss",
    "Progress",
    "Prompt",
    "PromptPiece",
    "PromptRequest",
    "Queued",
    "Reasoning",
    "Repeating",
    "RetryPolicy",
    "Retrying",
    "Sent",
    "ServerFacts",
    "ServerHealth",
    "Slot",
    "SlotFile",
    "StreamBroken",
    "StreamError",
    "StreamErrorEvent",
    "ThinkingCapped",
    "Timeouts",
    "Timings",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "Unread",
    "Unreported",
    "Waiting",
    "cache_limit",
    "cache_outcome",
    "decode_arguments",
    "delimiter_pattern",
    "is_context_full",
    "is_output",
    "is_retryable",
    "learn_format",
    "slot_tokens",
]
