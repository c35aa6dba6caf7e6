"""A token-exact prompt's JSON as its slot keeps it: the same bytes as the prompt encoded whole
(`one_prompt` through `canonical`), prompt after prompt, whether each extends the last or not,
and only what a prompt adds encoded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopd.canonical import canonical
from loopd.infer import PromptRequest
from loopd.infer import _prompt_json as prompt_json
from loopd.infer._format import ChatFormat
from loopd.infer._prompt_json import Prompt, PromptJson, one_prompt
from loopd.infer._types import PromptPiece

pieces = st.lists(st.one_of(st.integers(0, 200_000), st.text(max_size=8)), max_size=12)


@given(st.lists(st.tuples(st.booleans(), pieces), min_size=1, max_size=8))
def test_each_prompt_is_encoded_as_it_would_be_whole(
    steps: list[tuple[bool, list[PromptPiece]]],
) -> None:
    """Each step extends the last prompt, or starts another (a second session on the slot)."""
    encoder, prompt = PromptJson(), list[PromptPiece]()
    for extends, added in steps:
        prompt = [*prompt, *added] if extends else added
        assert encoder.encode(prompt) == canonical(one_prompt(prompt))


@given(st.lists(st.tuples(st.sampled_from(["grows", "again", "shorter"]), pieces), max_size=8))
def test_a_prompt_on_a_growing_base_is_encoded_as_it_would_be_whole(
    steps: list[tuple[str, list[PromptPiece]]],
) -> None:
    """As a session builds them: its history a list that only grows (the trail), each prompt
    that history and what is new. A prompt may also be sent again whole (a loopd restarted), or
    be shorter than the last (a guess set right)."""
    encoder, base, tail = PromptJson(), list[PromptPiece](), tuple[PromptPiece, ...]()
    for how, added in steps:
        if how == "grows":
            base += tail  # the last request's new pieces, in the log with its answer
            prompt = Prompt(base, len(base), tail := tuple(added))
        elif how == "again":
            prompt = Prompt.of([*base, *added])
        else:
            prompt = Prompt(base, len(base) // 2, tuple(added))
        assert encoder.encode(prompt) == canonical(one_prompt(list(prompt)))


class Watched(list[PromptPiece]):
    """A history that says which of its pieces were read."""

    def __init__(self, pieces: list[PromptPiece]) -> None:
        super().__init__(pieces)
        self.lowest = len(pieces)

    def __getitem__(self, index: Any) -> Any:
        start = index.start if isinstance(index, slice) else index
        self.lowest = min(self.lowest, start or 0)
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[PromptPiece]:
        self.lowest = 0
        return super().__iter__()


def test_on_the_same_history_only_the_pieces_after_the_last_prompt_are_read() -> None:
    """The history before the slot's last prompt's new pieces is the same list, which only
    grows: it is neither copied nor compared, however long."""
    encoder, base = PromptJson(), Watched(["system", *range(100_000)])
    first = Prompt(base, len(base), (1, 2, "question"))
    encoder.encode(first)
    base.extend(first.tail)
    nxt = Prompt(base, len(base), (3, "next"))
    whole = one_prompt(list(nxt))
    base.lowest = len(base)
    assert json.loads(encoder.encode(nxt)) == whole
    assert base.lowest == len(base) - len(first.tail)  # the last prompt's new pieces, alone


def test_a_prompt_that_extends_the_last_encodes_only_what_it_adds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts: list[str] = []
    real = canonical

    def counted(text: str) -> bytes:
        texts.append(text)
        return real(text)

    monkeypatch.setattr(prompt_json, "canonical", counted)
    encoder = PromptJson()
    first: list[PromptPiece] = [f"turn {n}" if n % 2 == 0 else n for n in range(2001)]
    encoder.encode(first)
    texts.clear()
    # The last text, which the next could have joined, is written now; then the new ones.
    assert json.loads(encoder.encode([*first, 5, "next"])) == [*first, 5, "next"]
    assert texts == ["turn 2000", "next"]


def test_a_body_on_a_slot_is_the_body_alone() -> None:
    fmt = ChatFormat("<|im_start|>assistant\n", None, False, (), None)
    encoder = PromptJson()
    prompt: list[PromptPiece] = ["system and question"]
    for n in range(4):
        request = PromptRequest(prompt=prompt, format=fmt)
        assert request.body(encoder) == request.body()
        assert json.loads(request.body())["prompt"] == one_prompt(prompt)
        prompt = [*prompt, n, n + 1, f"question {n}"]


def test_a_long_run_of_prompts_on_one_slot_stays_exact() -> None:
    """Past `RUNS_KEPT` requests the runs kept are joined into one."""
    encoder, base = PromptJson(), list[PromptPiece](["system"])
    for n in range(PromptJson.RUNS_KEPT * 2 + 3):
        tail = (n, f"q{n}") if n % 3 else (f"text {n}",)
        prompt = Prompt(base, len(base), tail)
        assert encoder.encode(prompt) == canonical(one_prompt(list(prompt)))
        base.extend(tail)


def test_a_text_that_cannot_be_encoded_leaves_the_slots_json_as_it_was() -> None:
    """A lone surrogate (valid in JSON escapes, not in UTF-8) fails the request; the next one
    that extends the prompt before it is still encoded whole."""
    encoder = PromptJson()
    encoder.encode(["system", 1])
    with pytest.raises(UnicodeEncodeError):
        encoder.encode(["\ud800", 5])
    assert encoder.encode(["system", 1, 2]) == canonical(one_prompt(["system", 1, 2]))
