"""`/completion`'s stream assembled: events as the chat endpoint's, the tokens kept exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loopd.infer import Content, Progress, StreamErrorEvent, ToolCallDelta, Unread, _parse
from loopd.infer._assemble import Assembler
from loopd.infer._format import ChatFormat
from loopd.infer._parse import OutputParser
from loopd.infer._prompt_json import one_prompt
from loopd.infer._raw import RawAssembler, parser_for
from support.formats import QWEN


def chunk(content: str, tokens: list[int], predicted: int, **extra: Any) -> str:
    return json.dumps(
        {"content": content, "tokens": tokens, "tokens_predicted": predicted, **extra}
    )


def final(stop_type: str, predicted: int) -> str:
    timings = {
        "cache_n": 0,
        "prompt_n": 5,
        "prompt_ms": 1.0,
        "predicted_n": predicted,
        "predicted_ms": 1.0,
    }
    return chunk("", [], predicted, stop=True, stop_type=stop_type, timings=timings)


def assembler() -> RawAssembler:
    return RawAssembler(OutputParser(QWEN), Assembler())


def test_tokens_and_text_of_an_answer() -> None:
    raw = assembler()
    progress = chunk("", [0], 0, prompt_progress={"total": 5, "cache": 0, "processed": 5})
    events = raw.feed(progress)
    events += raw.feed(chunk("Hello", [10], 1))
    events += raw.feed(chunk(" there", [11], 2))
    events += raw.feed(chunk("", [2], 3))  # the end token: no text
    events += raw.feed(final("eos", 3))
    assert events[0] == Progress(total=5, cache=0, processed=5)
    done = raw.completion()
    assert "".join(e.text for e in events if isinstance(e, Content)) == "Hello there"
    assert done.tokens == (10, 11, 2)  # the progress chunk's token is not one
    assert done.ended
    assert done.finish_reason == "stop"


def test_tokens_the_stream_does_not_name_are_kept_as_their_text() -> None:
    """A character split over tokens: no chunk for the first piece; the next one's text
    stands in for both."""
    raw = assembler()
    raw.feed(chunk("a", [10], 1))
    raw.feed(chunk("é", [12], 3))
    raw.feed(final("limit", 3))
    done = raw.completion()
    assert done.tokens == (10, "é")
    assert not done.ended
    assert done.finish_reason == "length"


def test_the_text_of_an_end_token_is_not_content() -> None:
    """An end token that is also a delimiter comes back as text: it ends the message."""
    raw = assembler()
    raw.feed(chunk("Hi", [10], 1))
    events = raw.feed(chunk("<|im_start|>", [1], 2)) + raw.feed(final("eos", 2))
    assert raw.completion().content == "Hi"
    assert not [e for e in events if isinstance(e, Content) and "im_start" in e.text]


def test_text_goes_on_at_once() -> None:
    """Only a delimiter's text waits for the next chunk; words are passed on as they come."""
    raw = assembler()
    assert [e for e in raw.feed(chunk("Hello", [10], 1)) if isinstance(e, Content)]


def test_the_client_reads_tokens_a_tag_spelled_out_goes_on_at_once() -> None:
    """The parser the client gives the stream takes its pieces for whole tokens: Gemma 3's
    `<|im_end|>` written as text is content from its first token, as the server sent it."""
    chatml = ChatFormat("<|im_start|>assistant\n", None, False, (), None)
    raw = RawAssembler(parser_for(chatml), Assembler())
    events = raw.feed(chunk("<", [236820], 1))
    assert [e.text for e in events if isinstance(e, Content)] == ["<"]


def test_a_tool_call_becomes_deltas_and_a_call() -> None:
    raw = assembler()
    text = '<tool_call>\n{"name": "find_tool", "arguments": {"query": "x"}}\n</tool_call>'
    events = raw.feed(chunk(text, [7], 1)) + raw.feed(chunk("", [2], 2))
    events += raw.feed(final("eos", 2))
    done = raw.completion()
    assert [c.name for c in done.tool_calls] == ["find_tool"]
    assert done.tool_calls[0].arguments == '{"query": "x"}'
    assert done.finish_reason == "tool_calls"
    assert any(isinstance(e, ToolCallDelta) for e in events)


def test_an_error_in_the_stream_is_a_typed_error() -> None:
    with pytest.raises(StreamErrorEvent):
        assembler().feed(json.dumps({"error": {"code": 500, "message": "boom"}}))


def test_a_prompt_of_text_only_is_one_prompt() -> None:
    """llama-server reads a list of strings as several prompts: text pieces side by side are
    joined, and text alone goes as one string."""
    assert one_prompt(["a", "b"]) == "ab"
    assert one_prompt(["a", 1, "b", "c", 2]) == ["a", 1, "bc", 2]
    assert one_prompt(["only"]) == "only"


WHY = "Object of type set is not JSON serializable"


def test_a_parser_that_fails_never_fails_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the parser raises (a set in a call's arguments once made `json.dumps` raise),
    the text it held goes on as content, as written, and so does the rest: nothing lost,
    nothing made up, and the completion says where."""

    def broken(*_: object) -> object:
        raise TypeError(WHY)

    monkeypatch.setattr(_parse, "decode_arguments", broken)
    raw, said = assembler(), ["Looking. ", '<tool_call>\n{"name": "f", "arguments": {}}', " on"]
    events = [e for n, text in enumerate(said, 1) for e in raw.feed(chunk(text, [n], n))]
    events += raw.feed(final("eos", 4))
    assert "".join(e.text for e in events if isinstance(e, Content)) == "".join(said)
    assert not [e for e in events if isinstance(e, ToolCallDelta)]
    done = raw.completion()
    assert done.finish_reason == "stop"
    # What the parser held when it failed: the call, and the space it held back before it.
    assert done.unread == Unread(text=" " + said[1], error=f"TypeError: {WHY}")
