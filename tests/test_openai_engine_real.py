"""loopd on an OpenAI-compatible server: the bundled llama-server's `/v1`, reached as any such
server is (history as messages, only OpenAI's fields, an API key), through a real `loopd
serve`. The key reaches the server on every request and nothing else: not loopd's log, not a
session's, not an error. (vLLM's chat endpoint, with tools, is in test_vllm_loopd.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import StartLlama
from loopd.session.records import CacheLossRecord, UsageRecord, conversation_problems
from support.daemon import Daemon
from test_sessions import records, welcome

pytestmark = pytest.mark.llama

KEY = "sk-loopd-openai-path-5c1f0e9a"
KEY_ENV = "LOOPD_TEST_API_KEY"


def as_openai(home: Path, url: str, key: str | None) -> Daemon:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    if key is not None:
        env[KEY_ENV] = key
    d = Daemon(home, url, history="exact", slots='save = "never"\n', env=env)
    text = d.config.read_text().replace(
        f'url = "{url}"\n', f'url = "{url}"\nengine = "openai"\napi_key_env = "{KEY_ENV}"\n'
    )
    d.config.write_text(text + "[loop]\nmax_tokens = 24\n")
    return d


def everything_written(d: Daemon) -> str:
    """loopd's log and every session log, as one text."""
    logs = sorted((d.home / "sessions").glob("*.jsonl"))
    return d.log.read_text() + "".join(path.read_text() for path in logs)


async def test_llama_servers_v1_as_an_openai_server_with_a_key_that_is_never_written(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama(extra_args=("--api-key", KEY))
    d = as_openai(tmp_path / "loopd", server.url, KEY)
    await d.start()
    try:
        client = await d.connect()
        session = await welcome(client, {"type": "hello", "session": "new"})
        for n, text in enumerate(["Name a colour.", "Name a fruit."]):
            lines = await client.turn(f"t{n}", text, timeout=120)
            assert lines[-1]["type"] == "turn_done", lines[-1]
        await client.send({"type": "status"})
        status = (await client.until("status"))[-1]
    finally:
        await d.end()
    assert status["engine"] == "openai"
    log = records(d, session)
    assert conversation_problems(log) == []
    # History went as messages (loopd's tools with it) and was answered.
    assert all(r.tokens is None for r in log if r.kind == "assistant")
    usages = [r for r in log if isinstance(r, UsageRecord)]
    assert len(usages) == 2
    assert not [r for r in log if isinstance(r, CacheLossRecord)]  # SmolLM2's renders alike
    assert KEY not in everything_written(d)


async def test_a_wrong_key_fails_the_turn_without_writing_either_key(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama(extra_args=("--api-key", KEY))
    wrong = "sk-wrong-key-77d0a3"
    d = as_openai(tmp_path / "loopd", server.url, wrong)
    await d.start()
    try:
        client = await d.connect()
        await welcome(client, {"type": "hello", "session": "new"})
        lines = await client.turn("t1", "Name a colour.", timeout=120)
    finally:
        await d.end()
    assert lines[-1]["type"] == "turn_failed"
    assert "401" in lines[-1]["message"]
    said = everything_written(d) + str(lines)
    assert KEY not in said
    assert wrong not in said


async def test_an_unset_key_variable_stops_loopd_at_start_naming_the_variable(
    tmp_path: Path,
) -> None:
    d = as_openai(tmp_path / "loopd", "http://127.0.0.1:9", None)
    with pytest.raises(RuntimeError, match=f"api_key_env names \\${KEY_ENV}, which is not set"):
        await d.start()
