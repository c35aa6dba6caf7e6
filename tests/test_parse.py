"""The raw-output parser: reasoning, content and tool calls told apart by a template's tags."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loopd.infer._format import CALL_ID, PARAM_KEY, ChatFormat, ParamFormat, ToolCallFormat
from loopd.infer._notation import decode_arguments
from loopd.infer._parse import OutputParser, Piece
from loopd.infer._raw import parser_for
from loopd.infer._schema import ArgumentTypes
from support.formats import (
    COMMAND_R7B,
    FUNCTIONARY_V32,
    GEMMA_4,
    GPT_OSS,
    LFM2,
    MUSE_GLIMMER,
    QWEN,
    QWEN_CODER,
    SOLAR_OPEN,
    merged,
)

QWQ = ChatFormat(
    generation_prompt="<|im_start|>assistant\n<think>\n",
    think=("<think>", "</think>"),
    thinking_open=True,
    content_prefixes=(),
    tool_call=QWEN.tool_call,
)
LLAMA = ChatFormat(
    generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
    think=None,
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(open='{"name": "', mid='", "parameters": ', close="}"),
)


def parse(fmt: ChatFormat, pieces: list[str], tools: ArgumentTypes | None = None) -> list[Piece]:
    parser = OutputParser(fmt, tools)
    return merged([p for text in pieces for p in parser.feed(text)] + parser.finish())


def test_reasoning_then_content() -> None:
    out = parse(QWEN, ["<think>", "\nhm", "m\n</th", "ink>\n\nParis", "."])
    assert out == [Piece("reasoning", "\nhmm\n"), Piece("content", "Paris.")]


def test_a_generation_prompt_that_opens_thinking() -> None:
    out = parse(QWQ, ["Let me", " think.", "</think>", "\n\nBlue."])
    assert out == [Piece("reasoning", "Let me think."), Piece("content", "Blue.")]


def test_a_tool_call_after_content() -> None:
    raw = (
        'Looking.\n<tool_call>\n{"name": "find_tool", "arguments": {"query": "a}b"}}\n</tool_call>'
    )
    out = parse(QWEN, [raw[i : i + 3] for i in range(0, len(raw), 3)])
    assert out == [
        Piece("content", "Looking.\n"),
        Piece("call", '{"query": "a}b"}', "find_tool"),
    ]


def test_spacing_of_a_call_may_differ_from_the_template() -> None:
    raw = '<tool_call>{"name":"call_tool","arguments":{"name":"x","arguments":{}}}</tool_call>'
    assert parse(QWEN, [raw]) == [
        Piece("call", '{"name":"x","arguments":{}}', "call_tool"),
    ]


def test_two_calls() -> None:
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    out = parse(QWEN, [one, "\n", one.replace('"a"', '"b"')])
    assert out == [Piece("call", "{}", "a"), Piece("call", "{}", "b")]


def test_a_call_without_its_closing_tag_at_the_end_still_counts() -> None:
    out = parse(QWEN, ['<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n'])
    assert out == [Piece("call", '{"x": 1}', "a")]


def test_arguments_that_are_not_json_stay_content() -> None:
    raw = '<tool_call>\n{"name": "a", "arguments": {oops}\n</tool_call>'
    assert parse(QWEN, [raw]) == [Piece("content", raw)]


def test_a_format_without_an_opening_tag() -> None:
    out = parse(LLAMA, ['{"name": "find_tool", "parameters": {"query": "files"}}'])
    assert out == [Piece("call", '{"query": "files"}', "find_tool")]


def test_a_call_id_the_model_writes_matches_any_id() -> None:
    raw = '[TOOL_CALLS][{"name": "find_tool", "arguments": {"query": "x"}, "id": "Ab3dE6gH9"}]'
    assert parse(MISTRAL, [raw])[0] == Piece("call", '{"query": "x"}', "find_tool")


def test_a_call_id_the_model_leaves_out() -> None:
    """As llama.cpp reads it (Apriel 1.5 and Mistral write `"id"` in their templates)."""
    raw = '[TOOL_CALLS][{"name": "find_tool", "arguments": {"query": "x"}}]'
    assert parse(MISTRAL, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == [
        Piece("call", '{"query": "x"}', "find_tool")
    ]


def test_a_calls_close_left_out_before_the_next_call() -> None:
    """As llama.cpp reads Kimi's `{...}<|tool_call_begin|>`: the next call opens."""
    kimi = ChatFormat(
        "",
        None,
        False,
        (),
        ToolCallFormat(
            open="<|tool_calls_section_begin|><|tool_call_begin|>functions.",
            mid=f":{CALL_ID}<|tool_call_argument_begin|>",
            close="<|tool_call_end|>",
            block_close="<|tool_calls_section_end|>",
            again="<|tool_call_begin|>functions.",
        ),
    )
    call = '<|tool_call_begin|>functions.f:%d<|tool_call_argument_begin|>{"n": %d}'
    raw = "<|tool_calls_section_begin|>" + call % (0, 1) + call % (1, 2) + "<|tool_call_end|>"
    assert parse(kimi, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == [
        Piece("call", '{"n": 1}', "f"),
        Piece("call", '{"n": 2}', "f"),
    ]


def test_text_that_looks_like_a_tag_but_is_not_is_content() -> None:
    assert parse(QWEN, ["a <b> and <tool", "s> c"]) == [Piece("content", "a <b> and <tools> c")]


@given(st.text(alphabet='ab <>/\n{}"think_ol', max_size=60), st.integers(1, 7))
def test_splitting_never_changes_the_result(text: str, size: int) -> None:
    whole = parse(QWEN, [text])
    split = parse(QWEN, [text[i : i + size] for i in range(0, len(text), size)])
    assert split == whole


@pytest.mark.parametrize("fmt", [QWEN, QWQ, LLAMA])
def test_plain_text_is_content(fmt: ChatFormat) -> None:
    expected: Literal["reasoning", "content"] = "reasoning" if fmt.thinking_open else "content"
    assert parse(fmt, ["Just ", "words", "\n\nmore"]) == [Piece(expected, "Just words\n\nmore")]


MINIMAX = ChatFormat(
    generation_prompt="]~b]ai\n",
    think=None,
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open='<minimax:tool_call>\n<invoke name="',
        mid='"',
        close=">\n</invoke>\n",
        params=ParamFormat(key_open='>\n<parameter name="', key_end='">', value_end="</parameter"),
        block_close="</minimax:tool_call>",
        again='<invoke name="',
    ),
)


def test_parameters_written_one_by_one() -> None:
    raw = (
        "<tool_call>\n<function=call_tool>\n<parameter=name>\nread_file\n</parameter>\n"
        '<parameter=arguments>\n{"path": "a.md"}\n</parameter>\n</function>\n</tool_call>'
    )
    out = parse(QWEN_CODER, [raw[i : i + 5] for i in range(0, len(raw), 5)])
    assert out == [
        Piece("call", '{"name": "read_file", "arguments": {"path": "a.md"}}', "call_tool")
    ]


def _tool(name: str, **properties: object) -> dict[str, object]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"properties": properties}},
    }


SCHEMAS = ArgumentTypes(
    [
        _tool(
            "set",
            count={"type": "integer"},
            ratio={"type": "number"},
            on={"type": "boolean"},
            note={"type": "string"},
            maybe={"type": ["string", "null"]},
            limit={"oneOf": [{"type": "integer"}, {"$ref": "#/$defs/max"}]},
            tags={"anyOf": [{"type": "array"}, {"type": "string"}]},
            kind={"enum": ["a", "b"]},
            point={"type": "object"},
            items={"type": "array"},
        )
    ]
)


def _params(**values: str) -> str:
    written = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=set>\n{written}</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("count", "42", 42),
        ("ratio", "3.5", 3.5),
        ("on", "true", True),
        ("note", "42", "42"),
        ("note", "null", "null"),
        ("maybe", "null", None),
        ("maybe", "42", "42"),
        ("limit", '{"max": 3}', {"max": 3}),
        ("tags", '["x"]', ["x"]),
        ("tags", "{}", "{}"),
        ("kind", "1", "1"),
        ("count", "many", "many"),
        ("unknown", "42", "42"),
        ("unknown", '{"a": 1}', {"a": 1}),
        # An object or a list written as a Python literal (ByteDance Seed-OSS's template
        # writes such values with `| string`), where the schema asks for one.
        ("point", "{'x': 3, 'on': True}", {"x": 3, "on": True}),
        ("items", "['x', ('y', None)]", ["x", ["y", None]]),
        ("point", "{'x': 3", "{'x': 3"),
        ("point", "['x']", "['x']"),
        ("tags", "['x']", "['x']"),  # a string allowed: the text is one
    ],
)
def test_a_value_written_as_text_is_typed_by_the_tools_schema(
    key: str, text: str, value: object
) -> None:
    """As llama.cpp reads it: JSON where the schema allows no string, text where it allows only
    strings, JSON of another of its types where it allows both; a parameter no schema names,
    an object or a list when it is one."""
    (call,) = parse(QWEN_CODER, [_params(**{key: text})], SCHEMAS)
    assert json.loads(call.text) == {key: value}


def test_an_object_or_a_list_written_as_nested_tags() -> None:
    """MiniMax-M3's: where the schema allows no string, typed by its parts; else text."""
    tools = ArgumentTypes(
        [
            _tool(
                "f",
                point={"type": "object", "properties": {"x": {"type": "number"}}},
                tags={"type": "array", "items": {"type": "string"}},
                label={"anyOf": [{"type": "string"}, {"type": "object"}]},
            )
        ]
    )
    values = {
        "point": f"{NS}<x>1.5{NS}</x>",
        "tags": f"{NS}<item>1{NS}</item>{NS}<item>b{NS}</item>",
        "label": f"{NS}<text>hi{NS}</text>",
    }
    written = "".join(f">{NS}<{k}>{v}{NS}</{k}" for k, v in values.items())
    raw = f'{NS}<tool_call>\n{NS}<invoke name="f"{written}>{NS}</invoke>\n{NS}</tool_call>'
    (call,) = parse(MINIMAX_M3, [raw[i : i + 7] for i in range(0, len(raw), 7)], tools)
    assert json.loads(call.text) == {
        "point": {"x": 1.5},
        "tags": ["1", "b"],
        "label": values["label"],
    }


def test_a_block_close_with_other_whitespace_is_not_content() -> None:
    """Command R+ closes its list with `]````; models write `]\n````."""
    fmt = ChatFormat(
        "",
        None,
        False,
        (),
        ToolCallFormat(
            open='Action:\n```json\n[\n    {\n        "tool_name": "',
            mid='",\n        "parameters": ',
            close="\n    }",
            block_close="]```",
            again=',\n    {\n        "tool_name": "',
        ),
    )
    raw = 'Action:\n```json\n[{"tool_name": "f", "parameters": {"a": 1}}]\n```'
    assert parse(fmt, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == [
        Piece("call", '{"a": 1}', "f")
    ]


def test_a_call_with_no_arguments_closes_where_a_key_would_open() -> None:
    raw = f'{NS}<tool_call>\n{NS}<invoke name="f">{NS}</invoke>\n{NS}</tool_call>'
    assert parse(MINIMAX_M3, [raw[i : i + 5] for i in range(0, len(raw), 5)]) == [
        Piece("call", "{}", "f")
    ]


def test_a_value_in_cdata_holds_anything() -> None:
    """MiniCPM5's: the closing tag inside it is text."""
    fmt = ChatFormat(
        "",
        None,
        False,
        (),
        ToolCallFormat(
            open='<function name="',
            mid='"',
            close="></function>",
            params=ParamFormat(key_open='><param name="', key_end='">', value_end="</param"),
        ),
    )
    raw = '<function name="f"><param name="x"><![CDATA[a</param> b]]></param></function>'
    assert parse(fmt, [raw[i : i + 4] for i in range(0, len(raw), 4)]) == [
        Piece("call", '{"x": "a</param> b"}', "f")
    ]


def test_a_value_keeps_the_newline_it_ends_with() -> None:
    """Only the newline the template writes before `</parameter>` is a delimiter's: a file's
    last newline in an edit stays in it."""
    (call,) = parse(QWEN_CODER, [_params(note="#include\n")], SCHEMAS)
    assert json.loads(call.text) == {"note": "#include\n"}


@pytest.mark.parametrize("size", [1, 3, 100])
def test_special_tokens_that_end_the_answer_are_not_content(size: int) -> None:
    """As llama.cpp reads it; one in the middle of the answer stays."""
    raw = "Hi <|x|> there.<|END_RESPONSE|>\n<|im_end|>"
    pieces = parse(QWEN, [raw[i : i + size] for i in range(0, len(raw), size)])
    assert pieces == [Piece("content", "Hi <|x|> there.")]


# Gemma 3 270M on its GGUF's ChatML template, as llama-server streamed it token by token: it
# writes the template's end of message as text.
CHATML = ChatFormat("<|im_start|>assistant\n", None, False, (), None)
GEMMA_3_TOKENS = ["<", "|", "im", "_", "end", "|>", "\n", "<", "|", "im", "_", "start", "|>"]


def test_a_tag_written_token_by_token_goes_on_at_once() -> None:
    """Where each piece is whole tokens, a special token comes in one: a tag the model spells
    out is text, passed on at its first piece (held, it cost the answer's first seven tokens)."""
    parser = OutputParser(CHATML, tokens=True)
    assert [parser.feed(text) for text in GEMMA_3_TOKENS[:2]] == [
        [Piece("content", "<")],
        [Piece("content", "|")],
    ]


@pytest.mark.parametrize("tokens", [False, True])
def test_a_special_token_that_ends_the_answer_in_one_piece_is_not_content(tokens: bool) -> None:
    parser = OutputParser(CHATML, tokens=tokens)
    out = [p for text in ["Hi", " there.", "<|im_end|>", "\n"] for p in parser.feed(text)]
    assert merged(out + parser.finish()) == [Piece("content", "Hi there.")]


def test_a_marker_of_the_generation_prompt_written_again_is_not_content() -> None:
    raw = "<|im_start|>assistant\nParis."
    fmt = ChatFormat("<|im_start|>assistant\n", None, False, (), None)
    assert parse(fmt, [raw]) == [Piece("content", "assistant\nParis.")]


CALL = '<tool_call>\n{"name": "find_tool", "arguments": {"query": "x"}}\n</tool_call>'


def test_a_call_in_reasoning_never_closed_ends_the_reasoning() -> None:
    """As llama.cpp reads it: the answer ends with the reasoning open, so the call is one."""
    raw = f"Let me look.\n{CALL}\nDone."
    assert parse(QWQ, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == [
        Piece("reasoning", "Let me look.\n"),
        Piece("call", '{"query": "x"}', "find_tool"),
        Piece("content", "Done."),
    ]


def test_a_call_in_reasoning_that_closes_after_it_is_reasoning() -> None:
    raw = f"Let me look.\n{CALL}\nNo.</think>Blue."
    assert parse(QWQ, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == [
        Piece("reasoning", f"Let me look.\n{CALL}\nNo."),
        Piece("content", "Blue."),
    ]


def test_a_call_without_the_tag_that_opens_its_block() -> None:
    """Qwen3-Coder's `<function=...>` without `<tool_call>` first, as models write it."""
    raw = (
        "Calling.\n<function=find_tool>\n<parameter=query>\nx\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    assert parse(QWEN_CODER, [raw[i : i + 4] for i in range(0, len(raw), 4)]) == [
        Piece("content", "Calling.\n"),
        Piece("call", '{"query": "x"}', "find_tool"),
    ]


def test_several_calls_in_one_block() -> None:
    call = '<invoke name="find_tool">\n<parameter name="query">files</parameter>\n</invoke>\n'
    raw = f"<minimax:tool_call>\n{call}{call}</minimax:tool_call>"
    out = parse(MINIMAX, [raw])
    assert out == [Piece("call", '{"query": "files"}', "find_tool")] * 2


NS = "]<]minimax[>["
MINIMAX_M3 = ChatFormat(  # as learned from MiniMax-M3's template: each value closed by its key
    generation_prompt="]~b]ai\n",
    think=("<mm:think>", "</mm:think>"),
    thinking_open=False,
    content_prefixes=("</mm:think>",),
    tool_call=ToolCallFormat(
        open=f'{NS}<tool_call>\n{NS}<invoke name="',
        mid='"',
        close=f">{NS}</invoke>\n{NS}",
        params=ParamFormat(key_open=f">{NS}<", key_end=">", value_end=f"{NS}</{PARAM_KEY}"),
        block_close="</tool_call>",
        again='<invoke name="',
    ),
)


def test_a_value_closed_by_its_own_key() -> None:
    """MiniMax-M3 writes `<key>value</key>`; its close begins like another argument, and a
    value may hold what closes another key."""
    call = (
        f'{NS}<invoke name="call_tool">{NS}<name>read_file{NS}</name>'
        f'{NS}<arguments>{{"path": "{NS}</name>"}}{NS}</arguments>{NS}</invoke>\n'
    )
    raw = f"</mm:think>{NS}<tool_call>\n{call}{call}{NS}</tool_call>"
    out = parse(MINIMAX_M3, [raw[i : i + 7] for i in range(0, len(raw), 7)])
    arguments = '{"name": "read_file", "arguments": {"path": "]<]minimax[>[</name>"}}'
    assert out == [Piece("call", arguments, "call_tool")] * 2


MISTRAL = ChatFormat(  # as learned from Mistral Nemo's template: calls in one JSON list
    generation_prompt="",
    think=None,
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open='[TOOL_CALLS][{"name": "',
        mid='", "arguments": ',
        close=f', "id": "{CALL_ID}"}}',
        block_close="]",
        again=', {"name": "',
    ),
)


def test_a_list_of_calls_closes_without_leaving_content() -> None:
    raw = (
        '[TOOL_CALLS][{"name": "find_tool", "arguments": {"query": "files"}, "id": "a1b2c3d4e"}, '
        '{"name": "find_tool", "arguments": {"query": "notes"}, "id": "f5g6h7i8j"}]'
    )
    out = parse(MISTRAL, [raw[i : i + 3] for i in range(0, len(raw), 3)])
    assert out == [
        Piece("call", '{"query": "files"}', "find_tool"),
        Piece("call", '{"query": "notes"}', "find_tool"),
    ]


def test_arguments_in_gemmas_own_notation_become_json() -> None:
    q = '<|"|>'
    raw = (
        f"<|channel>thought\nRead it.<channel|><|tool_call>call:call_tool{{arguments:{{path:{q}"
        f"a, b.md{q},depth:2,all:true,tags:[{q}x{q},null]}},name:{q}read_file{q}}}<tool_call|>"
    )
    out = parse(GEMMA_4, [raw[i : i + 4] for i in range(0, len(raw), 4)])
    arguments = {
        "arguments": {"path": "a, b.md", "depth": 2, "all": True, "tags": ["x", None]},
        "name": "read_file",
    }
    assert out == [
        Piece("reasoning", "\nRead it."),
        Piece("call", json.dumps(arguments), "call_tool"),
    ]


@pytest.mark.parametrize(
    "text",
    ['{path:<|"|>a.md}', "{path:2", '{:<|"|>a<|"|>}', "{path 2}", "[1, 2]", '{a:[<|"|>x<|"|>}'],
)
def test_what_is_not_gemmas_notation_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        decode_arguments("gemma", text, 0)


# muse-glimmer writes an answer as messages, each to a recipient: itself (reasoning), the user
# (content) or a tool (a call), one after another (`<|eom|><|start|>assistant to=...`).
def _muse_call(name: str, **arguments: str) -> str:
    params = "".join(
        f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in arguments.items()
    )
    return (
        f'to={name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{params}'
        "</atem:invoke>\n</atem:function_calls>"
    )


MUSE_WEATHER = _muse_call("weather.get", city="Paris")
MUSE_TOOLS = ArgumentTypes([_tool("weather.get", city={"type": "string"}), _tool("n", n={})])


def _muse(*messages: str, end: str = "<|eot|>") -> str:
    """An answer of these messages, as the model writes it after the generation prompt."""
    return " " + "<|eom|><|start|>assistant ".join(messages) + end


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (  # the issue's: reasoning, then a call, not one call named `self<|message|>...`
            _muse("to=self<|message|>Let me check the weather.", MUSE_WEATHER),
            [
                Piece("reasoning", "Let me check the weather."),
                Piece("call", '{"city": "Paris"}', "weather.get"),
            ],
        ),
        (  # an answer with no call: no markup in the content
            _muse("to=self<|message|>A greeting.", "to=user<|message|>Hello!"),
            [Piece("reasoning", "A greeting."), Piece("content", "Hello!")],
        ),
        (  # content, then a call, the answer ending with the call's close
            _muse("to=user<|message|>Looking.", MUSE_WEATHER, end=""),
            [Piece("content", "Looking."), Piece("call", '{"city": "Paris"}', "weather.get")],
        ),
        (  # two calls, each a message of its own
            _muse("to=self<|message|>Both.", _muse_call("n", n="1"), _muse_call("n", n="2")),
            [
                Piece("reasoning", "Both."),
                Piece("call", '{"n": 1}', "n"),
                Piece("call", '{"n": 2}', "n"),
            ],
        ),
        (  # a call's markup in the reasoning or the content is text
            _muse(f"to=self<|message|>Use {MUSE_WEATHER}", f"to=user<|message|>Or {MUSE_WEATHER}"),
            [
                Piece("reasoning", f"Use {MUSE_WEATHER}"),
                Piece("content", f"Or {MUSE_WEATHER}"),
            ],
        ),
        (  # a body for a tool that is no call stays visible
            _muse("to=self<|message|>Hm.", "to=weather.get<|message|>Paris?"),
            [Piece("reasoning", "Hm."), Piece("content", "Paris?")],
        ),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 0])
def test_muse_glimmers_messages_by_their_recipients(
    raw: str, expected: list[Piece], size: int
) -> None:
    parser, step = parser_for(MUSE_GLIMMER, MUSE_TOOLS), size or len(raw)
    pieces = [p for at in range(0, len(raw), step) for p in parser.feed(raw[at : at + step])]
    assert merged([*pieces, *parser.finish()]) == expected


# What muse-glimmer writes, and pieces of it.
_MUSE_MARKUP = [
    *("<|start|>assistant ", "to=self", "to=user", "to=n", "<|message|>", "<|eom|>", "<|eot|>"),
    *_muse_call("n", n="1").split("\n"),
    *("<|", "|>", "<", "\n", " ", "=", '"', "1"),
]


@settings(deadline=None, max_examples=200)
@given(
    st.lists(st.sampled_from(_MUSE_MARKUP) | st.text(max_size=4), max_size=20), st.integers(1, 7)
)
def test_muse_glimmer_reads_the_same_in_pieces_as_whole(parts: list[str], size: int) -> None:
    text, results = "".join(parts), []
    for step in (size, max(len(text), 1)):
        parser = parser_for(MUSE_GLIMMER, MUSE_TOOLS)
        pieces = [p for i in range(0, len(text), step) for p in parser.feed(text[i : i + step])]
        results.append(merged([*pieces, *parser.finish()]))
    assert results[0] == results[1]


def test_calls_written_as_python_become_json() -> None:
    raw = (
        "Looking.<|tool_call_start|>[find_tool(query='a) b'), call_tool(name='read_file', "
        'arguments={"path": "a.md", "all": true, "depth": null})]<|tool_call_end|>'
    )
    out = parse(LFM2, [raw[i : i + 5] for i in range(0, len(raw), 5)])
    arguments = {"name": "read_file", "arguments": {"path": "a.md", "all": True, "depth": None}}
    assert out == [
        Piece("content", "Looking."),
        Piece("call", '{"query": "a) b"}', "find_tool"),
        Piece("call", json.dumps(arguments), "call_tool"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "(1, a=2)",
        "(a=b)",
        "(a=1",
        "(**k)",
        "[a=1]",
        "(a={**k})",
        "(a='x",
        "(a={1: 2})",
        "(a=" + "[" * 99 + "]" * 99 + ")",
    ],
)
def test_what_is_not_a_python_call_of_literals_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        decode_arguments("python", text, 0)


def test_a_python_string_may_hold_newlines_as_they_are() -> None:
    """LFM2 writes a here-document with real newlines inside the quotes: llama.cpp reads it."""
    command = "cat > f.py << EOF\nimport csv\nprint('ok')\nEOF"
    raw = f"<|tool_call_start|>[exec(command='{command.replace(chr(39), chr(92) + chr(39))}')]"
    raw += "<|tool_call_end|>"
    out = parse(LFM2, [raw[i : i + 3] for i in range(0, len(raw), 3)])
    assert out == [Piece("call", json.dumps({"command": command}), "exec")]


def test_python_sets_and_tuples_become_lists() -> None:
    called = "<|tool_call_start|>[todo(tags=set())]<|tool_call_end|>"
    assert parse(LFM2, [called]) == [Piece("content", called)]  # a call is not a literal
    raw = "<|tool_call_start|>[todo(tags={'urgent', 'bug'}, at=(1, 2.5), empty={})]"
    out = parse(LFM2, [raw, "<|tool_call_end|>"])
    arguments = {"tags": ["urgent", "bug"], "at": [1, 2.5], "empty": {}}
    assert out == [Piece("call", json.dumps(arguments), "todo")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [  # llama.cpp's own cases (tests/test-chat.cpp, LFM2), and Python's forms besides
        ("(code=\"def hello():\\n    print('hey')\")", {"code": "def hello():\n    print('hey')"}),
        ('(code="print(\\"hi\\")")', {"code": 'print("hi")'}),
        ('(config={"enabled": True, "count": 3})', {"config": {"enabled": True, "count": 3}}),
        ('(config={"enabled": true, "note": null})', {"config": {"enabled": True, "note": None}}),
        (
            '(title="demo", participants=["Alice", "Bob"])',
            {"title": "demo", "participants": ["Alice", "Bob"]},
        ),
        ("()", {}),
        ("( a = -1.5e2 ,\n b='\\x41\\u00e9\\q', )", {"a": -150.0, "b": "Aé\\q"}),
        ("(a=[[1], (), {'k': {2, 3}}])", {"a": [[1], [], {"k": [2, 3]}]}),
    ],
)
def test_python_arguments_read_as_llama_cpp_reads_them(text: str, expected: object) -> None:
    assert decode_arguments("python", text + "]", 0) == (expected, len(text))


FORMATS = [
    *(QWEN, QWQ, LLAMA, QWEN_CODER, MINIMAX, MINIMAX_M3, MISTRAL, GEMMA_4, LFM2, GPT_OSS),
    *(COMMAND_R7B, SOLAR_OPEN, FUNCTIONARY_V32),
]


def _delimiters(fmt: ChatFormat) -> list[str]:
    call = fmt.tool_call
    calls = [call.open, call.mid, call.close, call.block_close, call.again] if call else []
    return [*(fmt.think or ()), *fmt.content_prefixes, *calls, *(call.open.split() if call else [])]


# What a model writes: its format's delimiters, pieces of them, and the text around calls.
_MARKUP = sorted(
    {d for f in FORMATS for d in _delimiters(f) if d}
    | {'<|"|>', "(", ")", "[", "]", "{", "}", ":", ",", "=", '"', "'", "\\", "\n", "True", "1e9"}
)
_ADVERSARIAL = st.lists(
    st.sampled_from(_MARKUP) | st.text(max_size=6) | st.sampled_from(["[" * 2000, "{" * 2000]),
    max_size=24,
).map("".join)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.generation_prompt[:24])
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(text=_ADVERSARIAL, size=st.integers(1, 9))
# A call's arguments nested past Python's stack: json.loads raised RecursionError in harmony.
@example(text="to=functions.<|channel|>analysis<|message|>" + "[" * 2000, size=1)
# A call with no name, then whitespace: a call named "", and the whitespace read otherwise
# in pieces.
@example(text='"<invoke name=">\n</invoke>\n', size=1)
# A message opened and never given a header: harmony's reader looped for ever.
@example(text="<|end|><|start|>assistant" + "[" * 500, size=1)
def test_no_text_makes_a_parser_raise(fmt: ChatFormat, text: str, size: int) -> None:
    """Random and adversarial text in every format, whole and in pieces: the parser reads it
    without raising (where it would, the answer goes on: tests/test_raw.py), and cut anywhere
    it reads as whole; as pieces of whole tokens (a tag never cut), it reads without raising."""

    def read(step: int, *, tokens: bool) -> list[Piece]:
        parser = parser_for(fmt, tokens=tokens)
        pieces = [p for i in range(0, len(text), step) for p in parser.feed(text[i : i + step])]
        return merged([*pieces, *parser.finish()])

    whole = max(len(text), 1)
    assert read(size, tokens=False) == read(whole, tokens=False)
    read(size, tokens=True)


# As learned from llama.cpp's templates on a real llama-server.
GLM_47 = ChatFormat(
    generation_prompt="<|assistant|></think>",
    think=("<think>", "</think>"),
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open="<tool_call>",
        mid="",
        close="</tool_call>",
        params=ParamFormat(
            key_open="<arg_key>", key_end="</arg_key><arg_value>", value_end="</arg_value>"
        ),
    ),
)
GRANITE_33 = ChatFormat(
    generation_prompt="<|start_of_role|>assistant<|end_of_role|>",
    think=("<think>", "</think>"),
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open='<|tool_call|>[{"name": "',
        mid='", "arguments": ',
        close="}",
        block_close="]",
        again=', {"name": "',
        rendered=False,
    ),
)


@pytest.mark.parametrize(
    ("fmt", "raw"),
    [
        (
            COMMAND_R7B,
            (
                '<|START_ACTION|>\n[\n    {"tool_call_id": "0", "tool_name": "find_tool", '
                '"parameters": {"query": "weather"}}\n]<|END_ACTION|>'
            ),
        ),
        (
            GLM_47,
            "<tool_call>find_tool<arg_key>query</arg_key>\n<arg_value>weather</arg_value></tool_call>",
        ),
        (
            GRANITE_33,
            (
                '<|tool_call|>[\n  {\n    "name": "find_tool",\n'
                '    "arguments": {"query": "weather"}\n  }\n]'
            ),
        ),
    ],
    ids=["cohere", "glm", "granite"],
)
def test_whitespace_around_a_delimiters_special_tokens_and_json_punctuation(
    fmt: ChatFormat, raw: str
) -> None:
    """Whitespace the template writes none of, where it cannot change the meaning: around a
    special token (`<|START_ACTION|>\\n[`, `</arg_key>\\n<arg_value>`) and JSON's punctuation (a
    pretty-printed list of calls)."""
    expected = [Piece("call", '{"query": "weather"}', "find_tool")]
    assert parse(fmt, [raw]) == expected
    assert parse(fmt, [raw[i : i + 3] for i in range(0, len(raw), 3)]) == expected


def test_a_call_with_neither_tag_of_its_block() -> None:
    """Qwen3-Coder and Step-3.5's `<function=...>...</function>` without `<tool_call>` around
    it: the block's closing tag is left out with its opening."""
    raw = (
        "Let me look.\n<function=find_tool>\n<parameter=query>\nweather\n</parameter>\n</function>"
    )
    for pieces in ([raw], [raw[i : i + 2] for i in range(0, len(raw), 2)]):
        assert parse(QWEN_CODER, pieces) == [
            Piece("content", "Let me look.\n"),
            Piece("call", '{"query": "weather"}', "find_tool"),
        ]


def test_two_calls_with_neither_tag_of_their_block() -> None:
    call = "<function=find_tool>\n<parameter=query>\n{q}\n</parameter>\n</function>\n"
    raw = call.format(q="a") + call.format(q="b") + "Done."
    assert parse(QWEN_CODER, [raw[i : i + 5] for i in range(0, len(raw), 5)]) == [
        Piece("call", '{"query": "a"}', "find_tool"),
        Piece("call", '{"query": "b"}', "find_tool"),
        Piece("content", "Done."),
    ]


def test_gemma_4s_opening_without_its_word() -> None:
    """`<|tool_call>:name{...}<tool_call|>`, which some quantized Gemma 4 checkpoints write for
    `<|tool_call>call:name{...}<tool_call|>`."""
    raw = 'Checking.<|tool_call>:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    for pieces in ([raw], [raw[i : i + 3] for i in range(0, len(raw), 3)]):
        assert parse(GEMMA_4, pieces) == [
            Piece("content", "Checking."),
            Piece("call", '{"city": "Paris"}', "get_weather"),
        ]


@pytest.mark.parametrize(
    "bad",
    [
        "<|tool_call>call:get_weather<tool_call|>",  # no arguments: the name ran on
        '<|tool_call>call:get_weather{city:<|"|>Par<tool_call|>',  # a string never closed
    ],
)
def test_a_malformed_call_stays_content_and_the_good_call_after_it_is_read(bad: str) -> None:
    good = '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>'
    for pieces in ([bad + good], [(bad + good)[i : i + 4] for i in range(0, len(bad + good), 4)]):
        assert parse(GEMMA_4, pieces) == [
            Piece("content", bad),
            Piece("call", '{"zone": "UTC"}', "get_time"),
        ]


def test_a_call_without_a_name_is_content() -> None:
    raw = 'See: <minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>'
    assert parse(MINIMAX, [raw]) == [Piece("content", raw)]


@pytest.mark.parametrize(
    ("fmt", "raw"),
    [
        (
            COMMAND_R7B,
            "<|START_ACTION|>[\n"
            + ",\n".join(
                f'    {{"tool_call_id": "{n}", "tool_name": "find_tool", '
                f'"parameters": {{"query": "{q}"}}}}'
                for n, q in ((0, "a"), (1, "b"), (2, "c"))
            )
            + "\n]<|END_ACTION|>",
        ),
        (
            SOLAR_OPEN,
            "<|tool_calls|>"
            + "".join(
                f"<|tool_call:begin|>{i}<|tool_call:name|>find_tool"
                f'<|tool_call:args|>{{"query": "{q}"}}<|tool_call:end|>'
                for i, q in (("k3x9q2m0aa", "a"), ("p0w2e7r1zz", "b"), ("a1b2c3d4e5", "c"))
            )
            + "<|calls|>",
        ),
    ],
    ids=["command-r7b", "solar-open"],
)
def test_calls_numbered_by_the_model_are_read_whatever_their_numbers(
    fmt: ChatFormat, raw: str
) -> None:
    """The template numbers a block's calls in their openings (Command R7B's `"0"`, `"1"`, ...)
    or names each with an id the model makes up (Solar Open): a third call is read too, and
    any id the model writes."""
    expected = [Piece("call", f'{{"query": "{q}"}}', "find_tool") for q in "abc"]
    assert parse(fmt, [raw]) == expected
    assert parse(fmt, [raw[i : i + 4] for i in range(0, len(raw), 4)]) == expected


FUNCTIONARY_ANSWERS = [
    ("all\nParis.", [Piece("content", "Paris.")]),
    ('find_tool\n{"query": "weather"}', [Piece("call", '{"query": "weather"}', "find_tool")]),
    (
        'all\nLet me look.>>>find_tool\n{"query": "weather"}',
        [Piece("content", "Let me look."), Piece("call", '{"query": "weather"}', "find_tool")],
    ),
    (
        'find_tool\n{"query": "a"}>>>find_tool\n{"query": "b"}',
        [
            Piece("call", '{"query": "a"}', "find_tool"),
            Piece("call", '{"query": "b"}', "find_tool"),
        ],
    ),
    # Not a call, though the prompt opened one: what the model wrote, as content.
    ("Paris is the capital.\nOf France.", [Piece("content", "Paris is the capital.\nOf France.")]),
]


@pytest.mark.parametrize(("raw", "expected"), FUNCTIONARY_ANSWERS)
def test_a_call_whose_opening_the_generation_prompt_wrote(raw: str, expected: list[Piece]) -> None:
    """Functionary v3.2's generation prompt ends with `>>>`, which opens a call (`>>>name\n`)
    and its content (`>>>all\n`): the answer starts with a call's name or with `all`."""
    assert FUNCTIONARY_V32.prompt_opens_call
    assert parse(FUNCTIONARY_V32, [raw]) == expected
    assert parse(FUNCTIONARY_V32, [raw[i : i + 2] for i in range(0, len(raw), 2)]) == expected


def test_a_muse_glimmer_call_without_arguments() -> None:
    """`<atem:invoke name="NAME">` closed at once: read as a call of no arguments, not as
    content whose name runs across the invoke tag."""
    raw = _muse(_muse_call("list_sessions"))
    for step in (3, len(raw)):
        parser = parser_for(MUSE_GLIMMER, MUSE_TOOLS)
        pieces = [p for at in range(0, len(raw), step) for p in parser.feed(raw[at : at + step])]
        assert merged([*pieces, *parser.finish()]) == [Piece("call", "{}", "list_sessions")]
