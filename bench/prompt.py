"""The body of a long session's next token-exact request as loopd builds it (the history a list
that only grows, the slot's kept JSON of the last prompt, `Slot.prompts`), against the same
body built whole: a session's answers go to the server as token ids, and copying, comparing or
encoding every one of them anew costs time that grows with the session, on the way to every
first token."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat
from loopd.infer._prompt_json import Prompt, PromptJson
from loopd.infer._types import PromptPiece

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


def run() -> dict[str, Any]:
    sizes = {}
    for tokens in ANSWER_TOKENS:
        last = session(tokens)
        whole = _whole_ms(PromptRequest(prompt=[*last, *NEW], format=FORMAT))
        kept = _kept_ms(last)
        sizes[str(tokens)] = {"whole_ms": whole, "kept_ms": kept, "ratio": kept / whole}
    return {"sizes": sizes}


def rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [
        (
            f"the next body after {int(tokens):,} answer tokens",
            f"{f['kept_ms']:.2f} ms",
            f"encoded whole: {f['whole_ms']:.2f} ms",
            f"{f['ratio']:.2f}x",
        )
        for tokens, f in figures["sizes"].items()
    ]
