"""The body of a long session's next token-exact request, built with the JSON its slot kept of
the last prompt (`Slot.prompts`), against the same body built whole: a session's answers go to
the server as token ids, and encoding every one of them anew costs time that grows with the
session, on the way to every first token."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat
from loopd.infer._prompt_json import PromptJson
from loopd.infer._types import PromptPiece

ANSWER_TOKENS = (1_000, 5_000, 20_000)
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


def _kept_ms(last: list[PromptPiece], request: PromptRequest) -> float:
    times = []
    for _ in range(ROUNDS):
        slot = PromptJson()
        slot.encode(last)  # the slot's last request, before the clock
        start = time.perf_counter()
        request.body(slot)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run() -> dict[str, Any]:
    sizes = {}
    for tokens in ANSWER_TOKENS:
        last = session(tokens)
        request = PromptRequest(prompt=[*last, *range(100), TURN], format=FORMAT)
        whole, kept = _whole_ms(request), _kept_ms(last, request)
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
