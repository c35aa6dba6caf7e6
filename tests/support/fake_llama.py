"""A scripted llama-server: replies written in the test, streamed in the real chunk format.

Each `Reply` becomes a response when its request arrives. The cache figures are computed the
way llama-server's slot behaves: the prompt is the messages rendered one after the other, the
slot then holds it and the answer as generated, and the tokens found in the cache are the
common prefix of the new prompt with the slot (bytes stand in for tokens). So a request that
does not extend the previous one shows a real cache loss, and one that does shows none. The
chunk layout copies recordings/plain.json; nothing here pretends to be a recording.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loopd.canonical import canonical
from support.replay import Exchange, load

SSE = [("content-type", "text/event-stream")]


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
    choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
    body = {
        "choices": choices,
        "created": 1796041000,
        "id": "chatcmpl-scripted",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "system_fingerprint": "b0-unknown",
        "object": "chat.completion.chunk",
        **extra,
    }
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def render(messages: list[dict[str, Any]]) -> bytes:
    """The prompt as a slot would hold it: each message after the other."""
    return b"".join(canonical(m) + b"\n" for m in messages)


@dataclass(frozen=True)
class Reply:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    """(id, name, arguments) of each call."""
    delay: float = 0.0
    """Seconds between streamed pieces."""
    kind: str = "answer"
    """`answer`, `context_full`, `server_error` (500), `stream_error` or `stall`."""

    def as_message(self) -> dict[str, Any]:
        """The answer as loopd sends it back (`loopd.session.baseline.messages`)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in self.tool_calls
            ]
        return message

    def pieces(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for text, key in ((self.reasoning, "reasoning_content"), (self.content, "content")):
            out += [{key: word} for word in _words(text or "")]
        for index, (call_id, name, arguments) in enumerate(self.tool_calls):
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            out += [
                {"tool_calls": [{"index": index, "function": {"arguments": a}}]}
                for a in _words(arguments)
            ]
        return out


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _words(text: str) -> list[str]:
    """Pieces the way a tokenizer streams them: a word with its leading space."""
    if not text:
        return []
    parts = text.split(" ")
    return [parts[0], *(f" {p}" for p in parts[1:])] if parts[0] else [f" {p}" for p in parts[1:]]


@dataclass
class FakeLlama:
    """Answers requests with the replies in order, computing cache figures as a slot would."""

    replies: list[Reply]
    slot: bytes = b""
    prompts: list[bytes] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    """Every request's body, as sent."""

    def __call__(self, request: Any) -> Exchange:
        self.bodies.append(request)
        reply = self.replies.pop(0) if self.replies else Reply(content="(the script ran out)")
        if reply.kind == "context_full":
            return load("context_full")[0]
        if reply.kind == "server_error":
            body = '{"error":{"code":500,"message":"scripted failure","type":"server_error"}}'
            return Exchange({}, 500, [("content-type", "application/json")], body, {})
        if reply.kind == "stall":
            return Exchange({}, 200, SSE, "", {"stall": True})
        prompt = render(request["messages"])
        self.prompts.append(prompt)
        cached = _common_prefix(self.slot, prompt)
        cached = min(cached, len(prompt) - 1)  # one token is always evaluated again
        pieces = reply.pieces()
        body = _chunk(
            {"role": "assistant", "content": None},
            prompt_progress={
                "total": len(prompt),
                "cache": cached,
                "processed": len(prompt),
                "time_ms": 1,
            },
        )
        body += "".join(_chunk(p) for p in pieces)
        if reply.kind == "stream_error":
            body += 'data: {"error":{"code":500,"message":"scripted","type":"server_error"}}\n\n'
            return Exchange({}, 200, SSE, body, {})
        finish = "tool_calls" if reply.tool_calls else "stop"
        # The slot keeps what the model generated: the answer as it will come back, and an end
        # token (sampled, never evaluated), so a faithful next request finds all of it cached.
        generated = render([reply.as_message()])
        timings = {
            "cache_n": cached,
            "prompt_n": len(prompt) - cached,
            "prompt_ms": 1.0,
            "predicted_n": len(generated) + 1,
            "predicted_ms": 1.0,
        }
        body += _chunk({}, finish)
        body += _chunk(None, usage={"completion_tokens": len(pieces)}, timings=timings)
        body += "data: [DONE]\n\n"
        self.slot = prompt + generated
        return Exchange({}, 200, SSE, body, {"event_delay": reply.delay})
