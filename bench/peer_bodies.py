"""The request bodies pydantic-ai sends for a conversation, request by request.

Run in its own environment by bench/templates.py:
    uv run --with 'pydantic-ai-slim[openai]' python bench/peer_bodies.py < IN.json > OUT.json
IN is a conversation as plain steps (`system`, `user`, `assistant` with `content`, `reasoning`,
`tool_calls` and `asked`, `tool` results); OUT has, for each assistant step asked for, the
body pydantic-ai's
OpenAI-compatible model sends to get it: the history before it, as pydantic-ai's own messages
(`ModelRequest`, `ModelResponse` with thinking, text and tool-call parts) turn it into. Nothing
is sent anywhere: the transport keeps the body and answers with an empty completion.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from typing import Any

import httpx
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition

# Its notice that plain httpx clients will go in its next major version: not this bench's news.
warnings.filterwarnings("ignore", message=".*httpx.AsyncClient.*deprecated")

EMPTY = {
    "id": "x",
    "object": "chat.completion",
    "created": 0,
    "model": "local",
    "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""}}
    ],
}


def history(steps: list[dict[str, Any]]) -> list[ModelMessage]:
    """pydantic-ai's messages for the steps, the way a run of its agent would hold them."""
    out: list[ModelMessage] = []
    pending: list[Any] = []
    for step in steps:
        if step["role"] == "assistant":
            if pending:
                out.append(ModelRequest(parts=pending))
                pending = []
            parts: list[Any] = []
            if step.get("reasoning"):
                parts.append(ThinkingPart(content=step["reasoning"]))
            if step.get("content") is not None:  # an empty answer is an answer too
                parts.append(TextPart(content=step["content"]))
            parts += [
                ToolCallPart(c["name"], c["arguments"], tool_call_id=c["id"])
                for c in step.get("tool_calls", [])
            ]
            out.append(ModelResponse(parts=parts))
        elif step["role"] == "system":
            pending.append(SystemPromptPart(content=step["content"]))
        elif step["role"] == "user":
            pending.append(UserPromptPart(content=step["content"]))
        else:
            pending.append(
                ToolReturnPart(step["name"], step["content"], tool_call_id=step["tool_call_id"])
            )
    if pending:
        out.append(ModelRequest(parts=pending))
    return out


async def bodies(steps: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[Any]:
    sent: list[Any] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=EMPTY)

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    provider = OpenAIProvider(base_url="http://local/v1", api_key="none", http_client=http)
    model = OpenAIChatModel("local", provider=provider)
    parameters = ModelRequestParameters(
        function_tools=[
            ToolDefinition(
                name=t["function"]["name"],
                description=t["function"]["description"],
                parameters_json_schema=t["function"]["parameters"],
            )
            for t in tools
        ]
    )
    for at, step in enumerate(steps):
        if step["role"] == "assistant" and step.get("asked", True):
            await model.request(history(steps[:at]), None, parameters)
    await http.aclose()
    return sent


if __name__ == "__main__":
    given = json.load(sys.stdin)
    json.dump(asyncio.run(bodies(given["steps"], given["tools"])), sys.stdout)
