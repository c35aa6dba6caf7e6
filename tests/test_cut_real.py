"""An answer cut short on a real llama-server (SmolLM2-135M on the CPU) is kept: its text and
token ids in the log, found in the slot by the next request, marked as cut in `bxctl log`'s
transcript."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conftest import StartLlama
from loopd.config import LoopConfig
from loopd.infer import Client, Content, slot_tokens
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    PromptRecord,
    TurnEndRecord,
    UsageRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.session.transcript import transcript
from loopd.tools import Registry
from loopd.turn import Runtime, run_turn
from loopd.turn.exact import ExactHistory
from loopd.wire.events import TurnEvent
from support.ports import NoTools

pytestmark = pytest.mark.llama

LONG = "Write a long story about a dragon who learns to bake bread."
"""SmolLM2 at temperature 0 writes on for far more than the pieces the test waits for."""
PIECES = 12
"""Content pieces passed on before the cancel."""


async def test_a_cancelled_answer_is_kept_and_the_next_request_finds_it_in_the_slot(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama(n_ctx=4096)
    async with Client(server.url) as client:
        rt = Runtime(
            loop=LoopConfig(max_tokens=400),
            inference=client,
            port=NoTools(),
            registry=Registry(),
            sampling={"temperature": 0, "seed": 1},
            exact=ExactHistory(client),
        )
        with await Store(tmp_path).create(make_baseline("Be brief.")) as session:
            shown: list[str] = []
            with trio.CancelScope() as scope:

                def cancel_once_content_streams(event: TurnEvent) -> None:
                    if isinstance(event, Content):
                        shown.append(event.text)
                        if len(shown) == PIECES:
                            scope.cancel()

                await run_turn(session, rt, LONG, cancel_once_content_streams)
            await run_turn(session, rt, "Thanks. Name a colour.", lambda _: None)
            records = list(session.records)

    kinds = [r.kind for r in records]
    assert kinds[:6] == ["user", "prompt", "assistant", "usage", "turn_end", "user"]
    cut, cut_usage, ended = records[2], records[3], records[4]
    assert isinstance(cut, AssistantRecord)
    assert isinstance(cut_usage, UsageRecord)
    assert isinstance(ended, TurnEndRecord)
    assert ended.reason == "cancelled"
    assert (cut.cut, cut.ended) == ("cancelled", False)
    assert cut.content == "".join(shown)  # what the person saw, no more and no less
    assert cut.tokens is not None
    assert len(cut.tokens) == PIECES  # a token a piece: SmolLM2 writes no reasoning
    assert all(isinstance(t, int) for t in cut.tokens)
    assert cut_usage.timings is not None
    assert cut_usage.timings.predicted_n == PIECES

    # The next request extends the cut answer's tokens: everything the slot held is cached.
    usages = [r for r in records if isinstance(r, UsageRecord)]
    assert len(usages) == 2
    after = usages[1].timings
    assert after is not None
    # All the slot held of the log's tokens: the prompt and the answer, less the last token
    # (sampled, never evaluated), or with it where the server evaluated it before it heard of
    # the cancel (it does not wait for the client to read a token to go on to the next).
    held = slot_tokens(cut_usage.timings)
    assert after.cache_n in (held, held + 1)
    assert not [r for r in records if r.kind == "cache_loss"]
    prompts = [r for r in records if isinstance(r, PromptRecord)]
    assert len(prompts) == 2
    assert not prompts[1].full  # extended, not rendered anew

    assert conversation_problems(records) == []
    lines = [line.plain for line in transcript(records)]
    assert f"model: {cut.content}" in lines
    assert "  (answer cut short: cancelled)" in lines
