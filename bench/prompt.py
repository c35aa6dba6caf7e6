"""A long session's next token-exact request as loopd builds it, against the same built from
the whole history: its prompt from the trail the session keeps (`PromptTrail`) against one
read out of every record of the log, and its body on the history (a list that only grows) with
the slot's kept JSON of the last prompt (`Slot.prompts`) against the body encoded whole. A
session's answers go to the server as token ids, and reading, copying, comparing or encoding
every one of them anew costs time that grows with the session, on the way to every first
token. The template is a stand-in in this process: rendering the new messages is the server's
work, the same either way."""

from __future__ import annotations

import random
import statistics
import time
from functools import partial
from typing import Any

import trio

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat
from loopd.infer._prompt_json import Prompt, PromptJson
from loopd.infer._types import PromptPiece
from loopd.session.baseline import make_baseline
from loopd.session.records import AssistantRecord, PromptRecord, Record, UsageRecord, UserRecord
from loopd.session.trail import PromptTrail
from loopd.turn.exact import ExactHistory, Learned

ANSWER_TOKENS = (1_000, 20_000, 200_000)
ROUNDS = 30
FORMAT = ChatFormat(
    "<|im_start|>assistant\n", None, thinking_open=False, content_prefixes=(), tool_call=None
)
TURN = "<|im_end|>\n<|im_start|>user\nwhat next?<|im_end|>\n<|im_start|>assistant\n"


def session(answer_tokens: int) -> list[PromptPiece]:
    """A prompt of turns of 100-token answers, ending with a question."""
    rng = random.Random(answer_tokens)
    prompt: list[PromptPiece] = ["<|im_start|>system\nYou are helpful.<|im_end|>\n"]
    for _ in range(answer_tokens // 100):
        prompt += [TURN, *(rng.randrange(49_152) for _ in range(100))]
    return [*prompt, TURN]


def _whole_ms(request: PromptRequest) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        request.body()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


NEW = (*range(100), TURN)
"""What the next request adds: the last answer's tokens and the next question."""


def _kept_ms(last: list[PromptPiece]) -> float:
    times = []
    for _ in range(ROUNDS):
        # The slot's last request, before the clock: the history, then its question; then
        # that question in the history too, as the session's trail holds it after the answer.
        history = last[:-1]
        slot = PromptJson()
        slot.encode(Prompt(history, len(history), (last[-1],)))
        history.append(last[-1])
        start = time.perf_counter()
        PromptRequest(prompt=Prompt(history, len(history), NEW), format=FORMAT).body(slot)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


class _Template:
    """ChatML, rendered here: the server's part of building a prompt, out of the figure."""

    async def apply_template(self, messages: list[dict[str, Any]], *_: Any, **__: Any) -> str:
        turns = (f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return "".join(turns) + "<|im_start|>assistant\n"

    async def detokenize(self, _tokens: list[int]) -> str:
        return "<|im_end|>"


def log(answer_tokens: int) -> list[Record]:
    """A session's records: turns of 100-token answers, then a question."""
    rng = random.Random(answer_tokens)
    records: list[Record] = []
    for n in range(answer_tokens // 100):
        answer = tuple(rng.randrange(49_152) for _ in range(100))
        records += [
            UserRecord(content="what next?"),
            PromptRecord(text=TURN, full=n == 0),
            AssistantRecord(content="...", tokens=answer, ended=True),
            UsageRecord(timings=None),
        ]
    return [*records, UserRecord(content="what next?")]


async def _prompt_ms(records: list[Record], *, kept: bool) -> float:
    baseline = make_baseline("You are helpful.")
    learned = Learned(formats={(baseline.system, True): FORMAT})  # as learned from ChatML
    exact = ExactHistory(_Template(), learned)  # type: ignore[arg-type]
    trail = PromptTrail(records)  # the session's, kept as its records came
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        await exact.next_prompt(baseline, records, thinking=True, trail=trail if kept else None)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run() -> dict[str, Any]:
    sizes = {}
    for tokens in ANSWER_TOKENS:
        last = session(tokens)
        whole = _whole_ms(PromptRequest(prompt=[*last, *NEW], format=FORMAT))
        kept = _kept_ms(last)
        records = log(tokens)
        read = trio.run(partial(_prompt_ms, records, kept=False))
        trail = trio.run(partial(_prompt_ms, records, kept=True))
        sizes[str(tokens)] = {
            "whole_ms": whole,
            "kept_ms": kept,
            "ratio": kept / whole,
            "read_ms": read,
            "trail_ms": trail,
            "prompt_ratio": trail / read,
        }
    return {"sizes": sizes}


def rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for tokens, f in figures["sizes"].items():
        turns = int(tokens) // 100
        if "trail_ms" in f:
            out.append(
                (
                    f"the next prompt after {turns:,} turns ({int(tokens):,} answer tokens)",
                    f"{f['trail_ms']:.2f} ms",
                    f"the log read whole: {f['read_ms']:.2f} ms",
                    f"{f['prompt_ratio']:.2f}x",
                )
            )
        out.append(
            (
                f"the next body after {int(tokens):,} answer tokens",
                f"{f['kept_ms']:.2f} ms",
                f"encoded whole: {f['whole_ms']:.2f} ms",
                f"{f['ratio']:.2f}x",
            )
        )
    return out
