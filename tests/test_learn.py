"""Learning a template's format where its renderings do not show its calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loopd.infer import FormatError, learn_format
from loopd.infer._messages import MessageParser
from loopd.infer._raw import parser_for
from support.formats import MUSE_GLIMMER


async def render_without_calls(
    conversation: list[dict[str, Any]], *, generation_prompt: bool
) -> str:
    """A ChatML template that writes an assistant's content and never its tool calls."""
    text = "".join(
        f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in conversation
    )
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


async def test_a_template_that_offers_tools_but_writes_no_call_is_refused_loudly() -> None:
    """loopd could not tell the model's calls from content: history goes as messages, where
    llama-server's own parser reads them, and the reason says so."""
    with pytest.raises(FormatError, match="offers tools but writes no past call"):
        await learn_format(
            render_without_calls, "Be brief.", "{% if tools %}{{ tools }}{% endif %}"
        )


async def test_a_template_without_tools_has_no_calls() -> None:
    fmt = await learn_format(render_without_calls, "Be brief.", "{{ messages }}")
    assert fmt.tool_call is None


@pytest.mark.parametrize(
    ("source", "opens", "notation"),
    [
        ("List of tools: [{{ tools }}]", "<|tool_call_start|>[", "python"),
        (
            "respond only with <|tool_call|> followed by a JSON list of tools used",
            "<|tool_call|>[",
            "json",
        ),
        (
            "{{ '<\uff5ctool\u2581calls\u2581begin\uff5c>' }}{{ tools }}",
            "<\uff5ctool\u2581calls\u2581begin\uff5c>",
            "json",
        ),
    ],
)
async def test_a_known_familys_calls_are_known_from_its_source(
    source: str, opens: str, notation: str
) -> None:
    """LFM2, Granite 3.3 and DeepSeek R1 templates never render a past call; their syntax is
    known by what their source says, as llama.cpp knows it."""
    fmt = await learn_format(render_without_calls, "Be brief.", source)
    assert fmt.tool_call is not None
    assert fmt.tool_call.open.startswith(opens)
    assert fmt.tool_call.notation == notation


async def render_muse(conversation: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    """muse-glimmer's template, in short: each message to a recipient, reasoning as a message
    to itself, and no content beside calls."""
    text = ""
    for m in conversation:
        if m["role"] != "assistant":
            text += f"<|start|>{m['role']}<|message|>{m['content']}<|eot|>"
            continue
        if m.get("reasoning_content"):
            text += f"<|start|>assistant to=self<|message|>{m['reasoning_content']}<|eom|>"
        calls = [c["function"] for c in m.get("tool_calls", [])]
        for i, call in enumerate(calls):
            params = "".join(
                f'<atem:parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}'
                "</atem:parameter>\n"
                for k, v in json.loads(call["arguments"]).items()
            )
            text += (
                f"<|start|>assistant to={call['name']}<|message|><atem:function_calls>\n"
                f'<atem:invoke name="{call["name"]}">\n{params}</atem:invoke>\n'
                f"</atem:function_calls>{'<|eom|>' if i + 1 < len(calls) else '<|eot|>'}"
            )
        if not calls:
            text += f"<|start|>assistant to=user<|message|>{m['content']}<|eot|>"
    return text + ("<|start|>assistant" if generation_prompt else "")


async def test_reasoning_written_as_a_message_to_itself_is_learned() -> None:
    """muse-glimmer's reasoning shows only beside calls, which its template writes without
    content: its known pair (`to=self`) is learned from that rendering, and the answer is read
    as messages."""
    fmt = await learn_format(render_muse, "Be brief.")
    assert fmt == MUSE_GLIMMER
    assert fmt.messages
    assert isinstance(parser_for(fmt), MessageParser)
