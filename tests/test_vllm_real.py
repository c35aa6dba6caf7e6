"""The real vLLM of the session fixture answers as the tests that use it expect: its model by
name, tokens both ways, and a streamed completion of token ids whose prefix is then cached in
whole blocks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from support.vllm import BLOCK_SIZE, RunningVllm

pytestmark = pytest.mark.vllm


def _post(server: RunningVllm, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server: RunningVllm, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [
            json.loads(line.removeprefix("data: "))
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def test_models_and_tokens(vllm_server: RunningVllm) -> None:
    models = httpx.get(f"{vllm_server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [vllm_server.model]
    chat = [{"role": "user", "content": "Hi"}]
    rendered = _post(vllm_server, "/tokenize", {"messages": chat, "add_generation_prompt": True})
    text = _post(vllm_server, "/detokenize", {"tokens": rendered["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    again = _post(vllm_server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert again["tokens"] == rendered["tokens"]


def test_stream_of_token_ids_is_cached_in_blocks(vllm_server: RunningVllm) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    prompt = _post(vllm_server, "/tokenize", {"messages": chat})["tokens"]
    body = {
        "model": vllm_server.model,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        "skip_special_tokens": False,
        "max_tokens": 20,
        "temperature": 0,
    }
    first = _stream(vllm_server, {**body, "prompt": prompt})
    generated = [t for c in first for choice in c["choices"] for t in choice["token_ids"]]
    assert first[-1]["choices"] == []
    assert first[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert first[-1]["usage"]["completion_tokens"] == len(generated)
    longer = prompt + generated + prompt[-3:]
    second = _stream(vllm_server, {**body, "prompt": longer})
    cached = second[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) + len(generated) - 1) // BLOCK_SIZE * BLOCK_SIZE
