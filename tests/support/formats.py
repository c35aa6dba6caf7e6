"""Formats as loopd learns them from real templates, and a way to read a parser's pieces, for
the sans-IO parser and grammar tests."""

from __future__ import annotations

from collections.abc import Iterable

from loopd.infer._format import CALL_ID, ChatFormat, ParamFormat, ToolCallFormat
from loopd.infer._parse import Piece

QWEN = ChatFormat(
    generation_prompt="<|im_start|>assistant\n",
    think=("<think>", "</think>"),
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open='<tool_call>\n{"name": "', mid='", "arguments": ', close="}\n</tool_call>"
    ),
)
QWEN_CODER = ChatFormat(
    generation_prompt="<|im_start|>assistant\n",
    think=None,
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open="<tool_call>\n<function=",
        mid="",
        close=">\n</function>\n</tool_call>",
        params=ParamFormat(key_open=">\n<parameter=", key_end=">\n", value_end="\n</parameter"),
    ),
)
GPT_OSS = ChatFormat(  # as learned from gpt-oss's template
    generation_prompt="<|start|>assistant",
    think=("<|channel|>analysis<|message|>", "<|end|>"),
    thinking_open=False,
    content_prefixes=("<|channel|>final<|message|>",),
    tool_call=ToolCallFormat(
        open="<|end|><|start|>assistant to=functions.",
        mid="<|channel|>commentary json<|message|>",
        close="",
    ),
)

GEMMA_4 = ChatFormat(  # as learned from Gemma 4's template: arguments in its own notation
    generation_prompt="<|turn>model\n",
    think=("<|channel>thought", "<channel|>"),
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open="<|tool_call>call:", mid="", close="<tool_call|>", notation="gemma", content_last=True
    ),
)
LFM2 = ChatFormat(  # as learned from LFM2.5's template: calls written as Python
    generation_prompt="<|im_start|>assistant\n",
    think=("<think>", "</think>"),
    thinking_open=False,
    content_prefixes=(),
    tool_call=ToolCallFormat(
        open="<|tool_call_start|>[",
        mid="",
        close="",
        block_close="]<|tool_call_end|>",
        again=",",
        notation="python",
    ),
)


def merged(pieces: Iterable[Piece]) -> list[Piece]:
    """Pieces as a reader sees them: text of one kind joined, each call on its own."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.kind != "call" and out[-1].kind == p.kind:
            out[-1] = Piece(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


MUSE_GLIMMER = ChatFormat(
    generation_prompt="<|start|>assistant",
    think=("to=self<|message|>", "<|eom|>"),
    thinking_open=False,
    content_prefixes=("to=user<|message|>",),
    tool_call=ToolCallFormat(
        open="to=",
        mid='<|message|><atem:function_calls>\n<atem:invoke name="\x00id\x00"',
        close=">\n</atem:invoke>\n</atem:function_calls>",
        params=ParamFormat(
            key_open='>\n<atem:parameter name="', key_end='">', value_end="</atem:parameter"
        ),
        again="<|eom|><|start|>assistant to=",
    ),
)
KIMI_K3 = ChatFormat(
    generation_prompt='<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    thinking_open=True,
    content_prefixes=("<|open|>response<|sep|>",),
    tool_call=ToolCallFormat(
        open='<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="',
        mid='" index="\x00id\x00"',
        close="<|sep|><|close|>call<|sep|>",
        params=ParamFormat(
            key_open='<|sep|><|open|>argument key="',
            key_end='" type="\x00id\x00"<|sep|>',
            value_end="<|close|>argument",
        ),
        again='<|open|>call tool="',
    ),
)


FUNCTIONARY_V32 = ChatFormat(  # as learned from Functionary v3.2's template
    generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n>>>",
    think=None,
    thinking_open=False,
    content_prefixes=("all",),
    tool_call=ToolCallFormat(open=">>>", mid="\n", close=""),
)

COMMAND_R7B = ChatFormat(
    generation_prompt="",
    think=("<|START_THINKING|>", "<|END_THINKING|>"),
    thinking_open=False,
    content_prefixes=("<|START_RESPONSE|>",),
    tool_call=ToolCallFormat(
        open=f'<|START_ACTION|>[\n    {{"tool_call_id": "{CALL_ID}", "tool_name": "',
        mid='", "parameters": ',
        close="}",
        block_close="]<|END_ACTION|>",
        again=f',\n    {{"tool_call_id": "{CALL_ID}", "tool_name": "',
    ),
)
SOLAR_OPEN = ChatFormat(
    generation_prompt="<|begin|>assistant",
    think=None,
    thinking_open=False,
    content_prefixes=("<|content|>",),
    tool_call=ToolCallFormat(
        open=f"<|tool_calls|><|tool_call:begin|>{CALL_ID}<|tool_call:name|>",
        mid="<|tool_call:args|>",
        close="<|tool_call:end|>",
        block_close="<|calls|>",
        again=f"<|tool_call:begin|>{CALL_ID}<|tool_call:name|>",
    ),
)
