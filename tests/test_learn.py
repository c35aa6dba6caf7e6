"""Learning a template's format where its renderings do not show its calls."""

from __future__ import annotations

from typing import Any

import pytest

from loopd.infer import FormatError, learn_format


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
