"""Guessed renderings on a real llama-server (SmolLM2-135M on the CPU) under real templates:
after the first answers, each question is sent at once from the previous question's rendering
(`loopd.turn.guess`), checked by the server's own rendering as it goes. What was sent is what
the template renders, the cache holds all that the slot held, and a wrong guess (Llama 3.1's
template trims the user's words) is cancelled with nothing of it reaching the client."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from conftest import ROOT, StartLlama
from loopd.config import LoopConfig, ToolsConfig
from loopd.infer import Client, Content, slot_tokens
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    PromptRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.store import Store
from loopd.tools import open_tool_port
from loopd.turn import Runtime, run_turn
from loopd.turn.exact import ExactHistory, Learned
from loopd.turn.guess import Shapes
from loopd.wire.events import TurnEvent

pytestmark = pytest.mark.llama

ALL_TEMPLATES = Path(os.environ.get("LOOPD_TEMPLATES") or ROOT / ".cache/llama-templates")
QUESTIONS = ("Hello.", "What is two and two?", "  And three and three?  \n", "Thanks.")


class CountedShapes(Shapes):
    def __init__(self) -> None:
        super().__init__()
        self.guessed = 0

    def guess(self, key: tuple[str, str]) -> str | None:
        found = super().guess(key)
        self.guessed += found is not None
        return found


@pytest.mark.parametrize(
    "template",
    ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct", "openai-gpt-oss-120b"],
)
async def test_guessed_requests_are_what_the_template_renders_and_cost_nothing(
    llama: StartLlama, tmp_path: Path, template: str
) -> None:
    server = await llama(n_ctx=4096, template=ALL_TEMPLATES / f"{template}.jinja")
    store = Store(tmp_path / "sessions")
    session = await store.create(make_baseline("Be brief."))
    shapes = CountedShapes()
    turns: list[list[TurnEvent]] = []
    async with Client(server.url) as client, open_tool_port(ToolsConfig(roots=[tmp_path])) as port:
        exact = ExactHistory(client, Learned(shapes=shapes))
        rt = Runtime(
            loop=LoopConfig(max_tokens=12),
            inference=client,
            port=port,
            registry=port.registry,
            sampling={"temperature": 0, "seed": 1},
            exact=exact,
        )
        for question in QUESTIONS:
            turns.append([])
            await run_turn(session, rt, question, turns[-1].append)
        records = list(session.records)
        # What each request sent is what the template renders for it (a loopd with nothing
        # kept, as after a restart, renders every request).
        for at, record in enumerate(records):
            if isinstance(record, PromptRecord) and not record.full:
                again = await ExactHistory(client).next_prompt(
                    session.baseline, records[:at], thinking=True
                )
                assert again.check is None
                assert (again.record.text, again.record.trim) == (record.text, record.trim)
    session.close()
    # The second question's rendering is the first kept; the third is guessed wrong (the
    # template trims it, or not), the fourth right again.
    assert shapes.guessed == 2
    answers = [r for r in records if isinstance(r, AssistantRecord)]
    assert len(answers) == len(QUESTIONS) == len([r for r in records if isinstance(r, UserRecord)])
    for events, answer in zip(turns, answers, strict=True):  # nothing of a wrong guess
        said = "".join(e.text for e in events if isinstance(e, Content))
        assert said == (answer.content or "").lstrip()
    usages = [r.timings for r in records if isinstance(r, UsageRecord)]
    for at, (previous, new) in enumerate(itertools.pairwise(usages), start=1):
        assert previous is not None
        assert new is not None
        # After a wrong guess the slot holds some of the cancelled request too, which the
        # right one may share beyond the last answer.
        wrong_guess = at == QUESTIONS.index("  And three and three?  \n")
        assert new.cached == slot_tokens(previous) or (
            wrong_guess and new.cached > slot_tokens(previous)
        )
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
