"""The token-exact transcript read back from a log: what each request extends."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bxctl.text import context_line
from loopd.infer import ChatFormat, FormatError, PromptPiece, ToolCall, ToolCallFormat
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    PromptRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.trail import PromptTrail
from loopd.turn.exact import ExactHistory, Learned, NextPrompt, past_reasoning


def transcript(records: list[Record]) -> tuple[list[PromptPiece], AssistantRecord] | None:
    """The prompt up to the last answer, and that answer, as the log's trail holds them."""
    built = PromptTrail(records).last()
    return None if built is None else (list(built[0]), built[1])


def answer(*tokens: int | str, ended: bool = True) -> AssistantRecord:
    return AssistantRecord(content="x", tokens=tokens, ended=ended)


def test_no_prompt_yet_means_nothing_to_extend() -> None:
    assert transcript([UserRecord(content="hi")]) is None


def test_prompts_and_answers_alternate_into_one_prompt() -> None:
    first, second = answer(1, 2, 3), answer(4, "é", 5)  # text stands in for unnamed ids
    records: list[Record] = [
        UserRecord(content="hi"),
        PromptRecord(text="<s>hi", full=True),
        first,
        UserRecord(content="more"),
        PromptRecord(text="more", trim=1),
        second,
    ]
    assert transcript(records) == (["<s>hi", 1, 2, "more"], second)


def test_a_full_prompt_starts_over() -> None:
    last = answer(9)
    records: list[Record] = [
        PromptRecord(text="a", full=True),
        answer(1),
        PromptRecord(text="everything again", full=True),
        last,
    ]
    assert transcript(records) == (["everything again"], last)


def test_an_answer_that_went_as_a_message_needs_a_full_prompt() -> None:
    """History sent as messages in between (`history = "template"`): no tokens to extend."""
    call = ToolCall(id="c", name="find_tool", arguments="{}")
    records: list[Record] = [
        PromptRecord(text="a", full=True),
        answer(1),
        AssistantRecord(content=None, tool_calls=(call,)),
        ToolResultRecord(call=1, tool_call_id="c", name="find_tool", content="r"),
    ]
    assert transcript(records) is None


def test_a_prompt_without_its_answer_needs_a_full_prompt() -> None:
    """A crash between writing a prompt and its answer: the next prompt renders it all."""
    records: list[Record] = [
        PromptRecord(text="a", full=True),
        answer(1),
        PromptRecord(text="b"),
        PromptRecord(text="c"),
        answer(2),
    ]
    assert transcript(records) is None


LOG_RECORDS = st.one_of(
    st.builds(UserRecord, content=st.just("q")),
    st.builds(
        PromptRecord, text=st.sampled_from(["p", "q"]), full=st.booleans(), trim=st.integers(0, 1)
    ),
    st.builds(
        AssistantRecord,
        content=st.just("a"),
        tokens=st.none() | st.lists(st.integers(0, 9) | st.just("t"), max_size=3).map(tuple),
    ),
    st.builds(UsageRecord, timings=st.none()),
)


def read_whole(records: list[Record]) -> tuple[list[PromptPiece], AssistantRecord] | None:
    """The prompt up to the last answer, read out of every record at once: the trail must
    agree with it (written apart from the trail, as every request read it before)."""
    pieces: list[PromptPiece] | None = None
    answer: AssistantRecord | None = None
    for record in records:
        if isinstance(record, PromptRecord):
            if record.full:
                pieces, answer = [], None
            elif pieces is None or answer is None:
                pieces = None
                continue
            else:
                tokens = answer.tokens or ()
                pieces = [*pieces, *tokens[: len(tokens) - record.trim]]
            pieces = [*pieces, record.text]
            answer = None
        elif isinstance(record, AssistantRecord) and pieces is not None:
            if record.tokens is None or answer is not None:
                pieces = None
            else:
                answer = record
    return None if pieces is None or answer is None else (pieces, answer)


@given(st.lists(LOG_RECORDS, max_size=12))
def test_the_trail_folded_record_by_record_is_the_log_read_whole_after_every_record(
    records: list[Record],
) -> None:
    """A session keeps its trail as records are added; after every record it says what reading
    the whole log says, and each prompt it gave stays what it was as the trail grows."""
    trail, given = PromptTrail(), []
    for n, record in enumerate(records, start=1):
        trail.add(record)
        kept = trail.last()
        assert (None if kept is None else (list(kept[0]), kept[1])) == read_whole(records[:n])
        if kept is not None:
            assert records[kept[2]] is kept[1]
            given.append((kept[0], list(kept[0])))
    assert all(list(prompt) == then for prompt, then in given)


class Unread(list[Record]):
    """A log the next prompt may not read through: iterating it fails."""

    def __iter__(self) -> Any:
        raise AssertionError("the whole history was read again")


async def test_the_next_prompt_does_not_read_the_history_again() -> None:
    """Building a request costs the same after ten thousand records as after ten: the prompt
    so far comes from the session's trail, and only the records after the last answer are
    read."""

    class Renders:
        async def apply_template(self, messages: list[dict[str, Any]], *_: Any, **__: Any) -> str:
            return "".join(f"<{m['role']}>{m['content']}</s>" for m in messages) + "<assistant>"

        async def detokenize(self, _tokens: list[int]) -> str:
            return "</s>"

    baseline = make_baseline("Be brief.")
    learned = Learned(formats={(baseline.system, True): ChatFormat("", None, False, (), None)})
    exact = ExactHistory(Renders(), learned)  # type: ignore[arg-type]
    records: list[Record] = []
    for n in range(1000):
        records += [
            UserRecord(content=f"q{n}"),
            PromptRecord(text=f"p{n}", full=n == 0),
            answer(n, n + 1),
            UsageRecord(timings=None),
        ]
    records.append(UserRecord(content="last"))
    trail = PromptTrail(records)
    nxt = await exact.next_prompt(baseline, Unread(records), thinking=True, trail=trail)
    assert nxt.pieces[:4] == ["p0", 0, 1, "p1"]
    assert nxt.pieces[-3:] == [999, 1000, "<user>last</s><assistant>"]


def test_past_reasoning_counts_what_the_exact_prompt_holds() -> None:
    usage = UsageRecord(timings=None, reasoning_tokens=7)
    records: list[Record] = [PromptRecord(text="a", full=True), answer(1), usage]
    assert past_reasoning(records) == 7
    assert past_reasoning([*records, PromptRecord(text="b"), answer(2), usage]) == 14
    as_message = AssistantRecord(content="x")
    assert past_reasoning([*records, as_message, usage]) is None  # the template decides


def test_the_context_line_says_how_much_is_past_reasoning() -> None:
    assert context_line(1000, 250) == "1000 tokens in the slot, 250 of them past reasoning (25%)"
    assert context_line(1000, None) == "1000 tokens in the slot (history sent as messages)"


async def test_an_end_tokens_text_is_asked_of_the_server_once() -> None:
    asked: list[list[int]] = []

    class Detokenizer:  # the one request ExactHistory makes for it
        async def detokenize(self, tokens: list[int]) -> str:
            asked.append(tokens)
            return "<|im_end|>"

    exact = ExactHistory(Detokenizer())  # type: ignore[arg-type]
    for _ in range(3):
        assert await exact._text(2) == "<|im_end|>"
    assert asked == [[2]]


async def test_another_server_of_the_model_shares_what_the_first_was_asked() -> None:
    asked: list[str] = []

    class Detokenizer:
        def __init__(self, name: str) -> None:
            self.name = name

        async def detokenize(self, _tokens: list[int]) -> str:
            asked.append(self.name)
            return "<|im_end|>"

    first = ExactHistory(Detokenizer("first"))  # type: ignore[arg-type]
    assert await first._text(2) == "<|im_end|>"
    other = first.on(Detokenizer("other"))  # type: ignore[arg-type]
    assert other.learned is first.learned
    assert await other._text(2) == "<|im_end|>"
    assert asked == ["first"]


class GemmaLike:
    """Renders as Gemma 4's template does where it matters here: calls, then their results,
    then the content, all in the model's turn. (A stand-in for the server, whose template
    SmolLM2 cannot be made to answer with content beside a call.)"""

    async def apply_template(
        self, messages: list[dict[str, Any]], _tools: list[Any], **_: object
    ) -> str:
        out, content = "", ""
        for m in messages:
            if m["role"] == "assistant":
                out += "<|turn>model\n"
                for call in m.get("tool_calls", []):
                    out += f"<|tool_call>call:{call['function']['name']}{{}}<tool_call|>"
                content = m["content"] or ""
            elif m["role"] == "tool":
                out += (
                    f'<|tool_response>response:r{{value:<|"|>{m["content"]}<|"|>}}<tool_response|>'
                )
            else:
                out += f"{content}<turn|>\n" if content else ""
                out += f"<|turn>{m['role']}\n{m['content']}<turn|>\n"
                content = ""
        return out + (f"{content}<turn|>\n" if content else "")

    async def detokenize(self, _tokens: list[int]) -> str:
        return "<turn|>"


async def next_after_a_call(
    client: object, call_format: ToolCallFormat, answer: AssistantRecord
) -> NextPrompt:
    """The request after `answer`, a find_tool call, and its result, in this format."""
    baseline = make_baseline("Be brief.")
    fmt = ChatFormat("", None, False, (), call_format)
    exact = ExactHistory(client, Learned(formats={(baseline.system, True): fmt}))  # type: ignore[arg-type]
    records: list[Record] = [
        UserRecord(content="Hi."),
        PromptRecord(text="prompt", full=True),
        answer,
        ToolResultRecord(call=1, tool_call_id="c1", name="find_tool", content="found"),
    ]
    return await exact.next_prompt(baseline, records, thinking=True)


FIND = ToolCall(id="c1", name="find_tool", arguments="{}")


async def test_content_written_after_the_calls_is_not_where_the_answer_ends() -> None:
    """Gemma 4 writes an answer's content after its calls and their results: the text after
    an answer with both is the results, as the model goes on in its turn."""
    gemma = ToolCallFormat(
        open="<|tool_call>call:", mid="", close="<tool_call|>", notation="gemma", content_last=True
    )
    answer = AssistantRecord(content="Let me look.", tool_calls=(FIND,), tokens=(5, 6, 7))
    nxt = await next_after_a_call(GemmaLike(), gemma, answer)
    assert nxt.record.text == '<|tool_response>response:r{value:<|"|>found<|"|>}<tool_response|>'


class FunctionaryLike:
    """Renders as Functionary v3.1's template does: a call message ends with `<|eom_id|>`,
    the token the model stops at after its calls."""

    async def apply_template(
        self, messages: list[dict[str, Any]], _tools: list[Any], **_: object
    ) -> str:
        head = "<|start_header_id|>{}<|end_header_id|>\n\n"
        out = ""
        for m in messages:
            if m["role"] == "assistant":
                calls = "".join(
                    f"<function={c['function']['name']}>{{}}</function>" for c in m["tool_calls"]
                )
                out += head.format("assistant") + calls + "<|eom_id|>"
            else:
                role = "ipython" if m["role"] == "tool" else m["role"]
                out += head.format(role) + m["content"] + "<|eot_id|>"
        return out + head.format("assistant")

    async def detokenize(self, _tokens: list[int]) -> str:
        return "<|eom_id|>"


async def test_the_token_the_model_stopped_at_stays_when_the_template_closes_calls_with_it() -> (
    None
):
    """Where a template writes the model's end-of-generation token after its calls, that token
    is in the slot: the next request starts after it, and nothing is trimmed, whatever was
    learned of the block's close."""
    call_format = ToolCallFormat(
        open="<function=", mid=">", close="</function>", block_close="<|eom_id|>"
    )
    answer = AssistantRecord(content=None, tool_calls=(FIND,), tokens=(5, 6, 128008), ended=True)
    nxt = await next_after_a_call(FunctionaryLike(), call_format, answer)
    assert nxt.record.trim == 0
    assert nxt.record.text == (
        "<|start_header_id|>ipython<|end_header_id|>\n\nfound<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert nxt.pieces == ["prompt", 5, 6, 128008, nxt.record.text]


class DropsAnswersWithCalls:
    """Renders only the messages of a template that leaves out a whole answer with calls."""

    async def apply_template(
        self, messages: list[dict[str, Any]], _tools: list[Any], **_: object
    ) -> str:
        kept = [m for m in messages if not m.get("tool_calls")]
        return "".join(f"<{m['role']}>{m['content']}</s>" for m in kept) + "<assistant>"

    async def detokenize(self, _tokens: list[int]) -> str:
        return "</s>"


async def test_a_template_that_drops_an_answer_with_calls_is_refused_not_guessed() -> None:
    """Where a template renders no past call, the answer ends after its content; where it
    leaves out the whole answer there is no such place, and the request goes as messages."""
    known = ToolCallFormat(open="<call>", mid="", close="</call>", rendered=False)
    answer = AssistantRecord(content=None, tool_calls=(FIND,), tokens=(5, 6, 7), ended=True)
    with pytest.raises(FormatError, match="left out an answer that made calls"):
        await next_after_a_call(DropsAnswersWithCalls(), known, answer)


class DropsCalls(DropsAnswersWithCalls):
    async def apply_template(
        self, messages: list[dict[str, Any]], _tools: list[Any], **_: object
    ) -> str:
        out = "".join(f"<{m['role']}>{m['content'] or ''}</s>" for m in messages)
        return out + "<assistant>"

    async def detokenize(self, _tokens: list[int]) -> str:
        return "<|eos|>"


async def test_the_models_own_calls_stay_where_the_template_renders_none() -> None:
    """LFM2.5-Instruct, Granite 3.3 and DeepSeek R1 render no past call: the next request
    holds the model's tokens, then the template's text after the answer."""
    known = ToolCallFormat(open="<call>", mid="", close="</call>", rendered=False)
    answer = AssistantRecord(content=None, tool_calls=(FIND,), tokens=(5, 6, 7), ended=True)
    nxt = await next_after_a_call(DropsCalls(), known, answer)
    assert nxt.record.trim == 1  # the model's end token is not the template's `</s>`
    assert nxt.pieces == ["prompt", 5, 6, "</s><tool>found</s><assistant>"]


class _Refusing(ExactHistory):
    """Learns nothing (every template refused), and counts what it was asked to learn."""

    asked: list[str]

    async def _learn(self, baseline: Any, *, thinking: bool) -> ChatFormat:  # noqa: ARG002
        self.asked.append(baseline.system)
        raise FormatError("refused")


async def test_the_format_cache_keeps_the_newest_system_prompts_only() -> None:
    from loopd.infer import Client  # noqa: PLC0415
    from loopd.turn.exact import FORMATS_KEPT  # noqa: PLC0415 - only this test needs the bound

    async with Client("http://127.0.0.1:9") as client:  # never asked: `_learn` answers
        history = _Refusing(client)
        history.asked = []
        for n in range(FORMATS_KEPT + 1):
            with pytest.raises(FormatError):
                await history.format(make_baseline(f"prompt {n}"), thinking=True)
        for n in (FORMATS_KEPT, 0):  # the newest is kept, the oldest went
            with pytest.raises(FormatError):
                await history.format(make_baseline(f"prompt {n}"), thinking=True)
    assert history.asked == [f"prompt {n}" for n in range(FORMATS_KEPT + 1)] + ["prompt 0"]


class CountedRenders:
    """Renders as a plain template would, and counts the renderings asked."""

    def __init__(self) -> None:
        self.asked = 0

    async def apply_template(self, messages: list[dict[str, Any]], *_: Any, **__: Any) -> str:
        self.asked += 1
        return "".join(f"<{m['role']}>{m['content']}</s>" for m in messages) + "<assistant>"


def _first_turn_exact(renders: Any) -> tuple[ExactHistory, Any]:
    baseline = make_baseline("Be brief.")
    learned = Learned(formats={(baseline.system, True): ChatFormat("", None, False, (), None)})
    return ExactHistory(renders, learned), baseline


async def test_a_new_sessions_first_prompt_is_guessed_from_the_last_sessions_first() -> None:
    """No round trip to the server before a new session's first request: the first prompt of
    an earlier session on the same baseline, date and thinking, with the new words in it."""
    renders = CountedRenders()
    exact, baseline = _first_turn_exact(renders)
    first = await exact.next_prompt(baseline, [UserRecord(content="Hi.")], thinking=True, date="d")
    assert (first.check, renders.asked) == (None, 1)
    nxt = await exact.next_prompt(baseline, [UserRecord(content="Why?")], thinking=True, date="d")
    assert renders.asked == 1  # nothing asked on the way to the request
    assert list(nxt.pieces) == ["<system>Be brief.</s><user>Why?</s><assistant>"]
    assert nxt.record.full
    assert nxt.check is not None
    assert await nxt.check() is None  # rendered beside the request: the guess was right
    assert renders.asked == 2


async def test_a_wrong_guess_of_a_first_prompt_is_corrected_by_its_check() -> None:
    class ReadsTheWords(CountedRenders):  # a template that writes the question its own way
        async def apply_template(self, messages: list[dict[str, Any]], *a: Any, **k: Any) -> str:
            rendered = await super().apply_template(messages, *a, **k)
            return rendered.replace("?", " ?")

    exact, baseline = _first_turn_exact(ReadsTheWords())
    await exact.next_prompt(baseline, [UserRecord(content="Hi.")], thinking=True, date="d")
    nxt = await exact.next_prompt(baseline, [UserRecord(content="Why?")], thinking=True, date="d")
    assert nxt.check is not None
    right = await nxt.check()
    assert right is not None
    assert list(right.pieces) == ["<system>Be brief.</s><user>Why ?</s><assistant>"]


async def test_a_first_prompt_of_another_day_is_rendered_not_guessed() -> None:
    renders = CountedRenders()
    exact, baseline = _first_turn_exact(renders)
    await exact.next_prompt(baseline, [UserRecord(content="Hi.")], thinking=True, date="d1")
    nxt = await exact.next_prompt(baseline, [UserRecord(content="Why?")], thinking=True, date="d2")
    assert (nxt.check, renders.asked) == (None, 2)
