"""An editor's `session/cancel` mid-answer on the real llama-server: the answer is kept as far as
it came, the next prompt finds it in the slot, `bxctl log` and a load of the session show it cut."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from acp import text_block

from loopd.infer import slot_tokens
from loopd.session.records import AssistantRecord, UsageRecord, conversation_problems
from test_acp import Editor, with_editor
from test_bxctl import bxctl
from test_hands import notes_folder
from test_sessions import embedded, records

pytestmark = pytest.mark.llama


async def test_an_editors_cancel_keeps_the_answer_and_the_next_prompt_finds_it_cached(
    tmp_path: Path,
) -> None:
    notes = notes_folder(tmp_path)
    d = embedded(tmp_path / "loopd")
    config = d.config.read_text().replace("max_tokens = 12", "max_tokens = 400")
    d.config.write_text(config + f'[tools]\nroots = ["{notes}"]\n')
    await d.start()
    try:

        async def cancel_then_ask(conn: Any, editor: Editor) -> tuple[str, Any, Any]:
            session = (await conn.new_session(cwd=str(notes))).session_id
            story = [text_block("Write a long story about a dragon who learns to bake bread.")]
            prompt = asyncio.ensure_future(conn.prompt(session_id=session, prompt=story))
            while len(editor.told("agent_message_chunk")) < 8:  # noqa: ASYNC110 - the editor's list
                await asyncio.sleep(0.02)
            await conn.cancel(session_id=session)
            cancelled = await prompt
            after = await conn.prompt(session_id=session, prompt=[text_block("Name a colour.")])
            return str(session), cancelled, after

        session, cancelled, after = await with_editor(d, cancel_then_ask)

        async def load(conn: Any, editor: Editor) -> list[str]:
            await conn.load_session(cwd=str(notes), session_id=session)
            return [u.content.text for u in editor.told("agent_message_chunk")]

        replayed = await with_editor(d, load)
        code, log, _ = await bxctl(d, "log", session)
    finally:
        await d.end()
    assert cancelled.stop_reason == "cancelled"
    kept = records(d, session)
    cut = next(r for r in kept if isinstance(r, AssistantRecord))
    assert cut.cut == "cancelled"
    assert cut.content
    assert cut.tokens
    assert all(isinstance(t, int) for t in cut.tokens)
    usages = [r.timings for r in kept if isinstance(r, UsageRecord)]
    assert len(usages) == 2
    assert usages[0] is not None
    assert usages[1] is not None
    held = slot_tokens(usages[0])  # the cut prompt and its tokens, less the last
    assert usages[1].cache_n in (held, held + 1)  # with it, where the server had evaluated it
    assert after.usage.cached_read_tokens == usages[1].cache_n
    assert conversation_problems(kept) == []
    assert "\n\n(answer cut short: cancelled)" in replayed
    assert code == 0
    assert "(answer cut short: cancelled)" in log
