"""The same conversation through pydantic-ai (its OpenAI-compatible provider), restart included.

Run in its own environment by bench/cache.py:
    uv run --with 'pydantic-ai-slim[openai]' python bench/peer.py URL OUT.json
The history is saved and loaded the way pydantic-ai documents (ModelMessagesTypeAdapter).
Each request's body and llama-server's timings are captured from the HTTP exchange.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from conversation import MAX_TOKENS, RESTART_AFTER, SYSTEM, TURNS
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


async def main(url: str) -> list[dict[str, Any]]:
    exchanges: list[dict[str, Any]] = []

    async def on_request(request: httpx.Request) -> None:
        exchanges.append({"body": json.loads(request.content)})

    async def on_response(response: httpx.Response) -> None:
        await response.aread()
        exchanges[-1]["timings"] = response.json().get("timings")

    http = httpx.AsyncClient(
        event_hooks={"request": [on_request], "response": [on_response]}, timeout=300
    )
    settings = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"id_slot": 0, "cache_prompt": True},
    }

    def agent() -> Agent[None, str]:
        provider = OpenAIProvider(base_url=f"{url}/v1", api_key="none", http_client=http)
        return Agent(OpenAIChatModel("local", provider=provider), system_prompt=SYSTEM)

    history: list[Any] = []
    current = agent()
    for number, text in enumerate(TURNS, start=1):
        result = await current.run(text, message_history=history, model_settings=settings)
        history = result.all_messages()
        if number == RESTART_AFTER:
            saved = ModelMessagesTypeAdapter.dump_json(history)
            current = agent()  # a new process would do the same: a new agent, the loaded history
            history = ModelMessagesTypeAdapter.validate_json(saved)
    await http.aclose()
    return exchanges


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(main(sys.argv[1]))))
