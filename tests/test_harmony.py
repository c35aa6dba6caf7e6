"""gpt-oss's harmony format read as messages: channels, recipients, several messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopd.infer._messages import MessageParser
from loopd.infer._parse import Piece
from loopd.infer._raw import parser_for
from support.formats import GPT_OSS, merged


def read(text: str, size: int = 0) -> list[Piece]:
    parser = MessageParser(GPT_OSS)
    step = size or max(len(text), 1)
    out = [p for at in range(0, len(text), step) for p in parser.feed(text[at : at + step])]
    return merged(out + parser.finish())


def test_a_harmony_format_gets_the_harmony_parser() -> None:
    assert isinstance(parser_for(GPT_OSS), MessageParser)


def test_reasoning_then_the_final_answer() -> None:
    text = (
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi."
    )
    assert read(text) == [Piece("reasoning", "Hm."), Piece("content", "Hi.")]


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.read_file <|constrain|>json",
        " to=functions.read_file<|channel|>commentary <|constrain|>json",
        "<|channel|>analysis to=functions.read_file",
        "<|channel|> commentary to=functions.read_file<|constrain|>  json",
    ],
)
def test_a_call_has_its_recipient_before_or_after_the_channel(header: str) -> None:
    text = (
        "<|channel|>analysis<|message|>Read it.<|end|>"
        f'<|start|>assistant{header}<|message|>{{"path": "a"}}<|call|>'
    )
    assert read(text, 3) == [
        Piece("reasoning", "Read it."),
        Piece("call", '{"path": "a"}', "read_file"),
    ]


def test_two_calls_in_one_answer() -> None:
    call = '<|start|>assistant to=functions.f<|channel|>commentary<|message|>{"n": %d}<|end|>'
    assert read(call % 1 + call % 2, 4) == [
        Piece("call", '{"n": 1}', "f"),
        Piece("call", '{"n": 2}', "f"),
    ]


def test_a_message_for_a_tool_loopd_does_not_have_is_dropped() -> None:
    text = (
        "<|channel|>analysis<|message|>Run.<|end|>"
        "<|start|>assistant to=container.exec<|channel|>commentary<|message|>ls"
    )
    assert read(text) == [Piece("reasoning", "Run.")]


def test_to_assistant_is_no_recipient() -> None:
    text = "<|channel|>commentary to=assistant<|channel|>final<|message|>Hi."
    assert read(text) == [Piece("content", "Hi.")]


def test_text_without_harmony_is_content() -> None:
    assert read("Just words.", 2) == [Piece("content", "Just words.")]


def test_a_call_whose_arguments_are_not_an_object_stays_visible() -> None:
    text = "<|channel|>commentary to=functions.f<|message|>not json<|call|>"
    assert read(text) == [Piece("content", "not json")]


def test_an_answer_that_starts_after_a_prefilled_end() -> None:
    """loopd's tests open a call in the template's own words, `<|end|>` first."""
    text = (
        "<|end|><|start|>assistant to=functions.find_tool<|channel|>commentary json"
        '<|message|>{"query": "x"}'
    )
    assert read(text, 5) == [Piece("call", '{"query": "x"}', "find_tool")]


ANSWER = (
    "<|channel|>analysis<|message|>Think <|end|><|start|>assistant<|channel|>commentary "
    'to=functions.f <|constrain|>json<|message|>{"a": "<|en"}<|call|>'
)


@given(st.integers(min_value=1, max_value=len(ANSWER)))
def test_splitting_never_changes_the_result(size: int) -> None:
    assert read(ANSWER, size) == read(ANSWER)


def test_the_split_answer_reads_as_written() -> None:
    assert read(ANSWER) == [Piece("reasoning", "Think "), Piece("call", '{"a": "<|en"}', "f")]


def test_a_message_opened_and_never_given_a_header_is_content() -> None:
    """`<|start|>` opens a header and ends a body alike: past the header's window it is
    content, read once (the reader used to hand it back and forth for ever)."""
    text = "<|end|><|start|>assistant" + "[" * 500
    assert read(text, size=1) == [Piece("content", text.removeprefix("<|end|>"))]
