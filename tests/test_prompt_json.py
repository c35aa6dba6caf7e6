"""A token-exact prompt's JSON as its slot keeps it: the same bytes as the prompt encoded whole
(`one_prompt` through `canonical`), prompt after prompt, whether each extends the last or not,
and only what a prompt adds encoded."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopd.canonical import canonical
from loopd.infer import PromptRequest
from loopd.infer import _prompt_json as prompt_json
from loopd.infer._format import ChatFormat
from loopd.infer._prompt_json import PromptJson, one_prompt
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
        assert encoder.encode(prompt) == canonical(one_prompt(prompt)).decode()


def test_a_prompt_that_extends_the_last_encodes_only_what_it_adds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts: list[str] = []
    real = prompt_json._text

    def counted(text: str) -> str:
        texts.append(text)
        return real(text)

    monkeypatch.setattr(prompt_json, "_text", counted)
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
