"""The errors of the inference client: a small, exact set, each saying whose fault it is.

InferError                  anything that kept a request from completing
 ├── ConnectError           no connection to llama-server (retried)
 ├── HttpError              llama-server answered with an error status (503 is retried)
 ├── InferTimeout           llama-server stopped answering within a deadline (it names which)
 ├── BadAnswer              a JSON endpoint answered 200 without what was asked
 └── StreamError            the answer began but could not be read to its end
      ├── StreamBroken      cut, garbled, or not an event stream at all
      │    └── ConnectionLost   the connection broke, before the answer or during it
      └── StreamErrorEvent  llama-server reported an error inside the stream
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BadAnswer",
    "ConnectError",
    "ConnectionLost",
    "HttpError",
    "InferError",
    "InferTimeout",
    "StreamBroken",
    "StreamError",
    "StreamErrorEvent",
    "is_context_full",
    "is_retryable",
]


class InferError(Exception):
    """A request to llama-server did not complete."""


class ConnectError(InferError):
    """No connection could be made: the server is down, starting, or the address is wrong."""

    def __init__(self, message: str, down: str | None = None) -> None:
        super().__init__(message)
        self.down = down
        """Why loopd knows the server is away (it is being restarted), if it knows."""


class HttpError(InferError):
    """The server answered with a status other than 200; `body` is its text, as sent."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"the server answered HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body

    def error_type(self) -> str | None:
        """The `error.type` of llama-server's JSON envelope, when the body is one."""
        try:
            payload: Any = json.loads(self.body)
        except ValueError:
            return None
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            kind = payload["error"].get("type")
            return kind if isinstance(kind, str) else None
        return None


class InferTimeout(InferError):
    """The server accepted the request but said nothing within the deadline."""


class BadAnswer(InferError):
    """A JSON endpoint (`/apply-template`, `/detokenize`, a slot action) answered 200 with
    something other than what it is for: a server of another version, or not llama-server."""


class StreamError(InferError):
    """The answer started but could not be read to its end."""


class StreamBroken(StreamError):
    """The stream was cut, ended without `[DONE]`, or was not the stream we asked for."""


class ConnectionLost(StreamBroken):
    """The connection broke: the server died or restarted, or a kept-alive connection it had
    closed was used again. A turn tries again where no output had been passed on yet."""


class StreamErrorEvent(StreamError):
    """llama-server sent `data: {"error": ...}` in the stream; `error` is that object."""

    def __init__(self, error: Any) -> None:
        message = error.get("message") if isinstance(error, dict) else None
        super().__init__(f"the server reported an error in the stream: {message or error}")
        self.error = error


# What vLLM and OpenAI-compatible servers say of a prompt that does not fit (their 400s have
# no type of their own): vLLM's "maximum context length is ...", and its "max_tokens must be
# at least 1" for a prompt that fills the window whole; OpenAI's code.
_FULL = ("maximum context length", "max_tokens must be at least 1", "context_length_exceeded")


def is_context_full(error: BaseException) -> bool:
    """True for the 400 a server sends when the prompt does not fit in its context:
    llama-server's `exceed_context_size_error`, or vLLM's and OpenAI's words for it."""
    if not isinstance(error, HttpError) or error.status != 400:
        return False
    return error.error_type() == "exceed_context_size_error" or any(
        words in error.body for words in _FULL
    )


def is_retryable(error: InferError) -> bool:
    """Worth another try: the server was unreachable, or is still loading its model (503)."""
    if isinstance(error, ConnectError):
        return True
    return isinstance(error, HttpError) and error.status == 503
