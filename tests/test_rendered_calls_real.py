"""Three calls as each of llama.cpp's templates renders them, read back by loopd's parser.

For every template whose past calls are rendered, one assistant message with content and three
tool calls is rendered by the template itself on a real llama-server; the text the model would
have written (the rendering after the generation prompt) goes through the parser of the format
loopd learns from the template, whole and in pieces of three characters. The calls it reads
must be the three rendered, in order, with the same names and arguments. What follows the
message in the rendering (the tool results, the next turn's markup) is read too; only the
calls are asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from loopd.infer import ChatFormat, Client, FormatError
from loopd.infer._learn import CONTENT, Render, _clean, _common_prefix, _Probe
from loopd.infer._parse import Piece
from loopd.infer._raw import parser_for
from loopd.infer._schema import ArgumentTypes
from loopd.session.baseline import TOOLS
from support.template_servers import SYSTEM, TemplateServers

pytestmark = pytest.mark.llama

ALL_TEMPLATES = Path(os.environ.get("LOOPD_TEMPLATES") or ROOT / ".cache/llama-templates")

# The three calls: names and arguments, each with an id of nine letters and digits, as
# Mistral's templates ask.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("find_tool", {"query": "notes"}),
    ("find_tool", {"query": "weather in Paris"}),
    ("call_tool", {"name": "read_file", "arguments": {"path": "today.md"}}),
]
MESSAGE = {
    "content": CONTENT,
    "tool_calls": [
        {
            "id": f"c0000000{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        for i, (name, arguments) in enumerate(CALLS, start=1)
    ],
}

# Templates whose rendering of the three calls no parser could read back as three calls.
UNREADABLE: dict[str, str] = {
    **dict.fromkeys(
        [
            "meta-llama-Llama-3.1-8B-Instruct",
            "meta-llama-Llama-3.2-3B-Instruct",
            "meta-llama-Llama-3.3-70B-Instruct",
        ],
        "the template refuses a message with more than one call (raise_exception)",
    ),
    **dict.fromkeys(
        ["GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "openai-gpt-oss-120b"],
        "the template writes only a message's first call (message.tool_calls[0])",
    ),
    "openbmb-MiniCPM5-1B": "an object argument is written as nothing: `{{ param_value }}` of a "
    "mapping prints no text in llama.cpp's Jinja",
}


def _render(client: Client) -> Render:
    async def render(conversation: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return await client.apply_template(
            conversation, list(TOOLS), add_generation_prompt=generation_prompt, thinking=True
        )

    return render


def _params() -> list[Any]:
    params = []
    for path in sorted(ALL_TEMPLATES.glob("*.jinja")):
        name = path.name.removesuffix(".jinja")
        reason = UNREADABLE.get(name)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def _written(fmt: ChatFormat, gen: str, rendered: str) -> str:
    """The text the model would have written: the rendering after the generation prompt.

    Where the rendering does not start with the generation prompt, it is cut after the turn's
    header the two share, up to a tag that only one of them goes on with: the rest of the
    prompt is then what the template writes only when asking for an answer (Apriel's "Here
    are my reasoning steps:", which the past message leaves out with its reasoning; the
    `<think>` of GLM 4.7, Laguna and Nemotron 3, whose past message has `</think>` or
    `<think></think>` there, so the model's own `</think>` is in the text). Where that prompt
    opens a reasoning block that the template leaves out of a past message altogether (QwQ,
    Bielik, MiniMax M2, Cohere2MoE's `<|START_THINKING|>`), the model, which writes nothing
    before closing it here, writes its end tag first: it is put back before the rest.
    """
    if rendered.startswith(gen):
        return rendered[len(gen) :]
    header = _clean(_common_prefix([gen, rendered]))
    written = rendered[len(header) :]
    if fmt.thinking_open and fmt.think and not written.lstrip().startswith(fmt.think[1]):
        written = fmt.think[1] + written
    return written


def _calls(fmt: ChatFormat, text: str, size: int) -> list[tuple[str, Any]]:
    """The calls the parser reads in `text` fed in pieces of `size` characters."""
    parser = parser_for(fmt, ArgumentTypes(TOOLS), tokens=False)
    pieces: list[Piece] = []
    for at in range(0, len(text), size):
        pieces += parser.feed(text[at : at + size])
    pieces += parser.finish()
    return [(p.name, json.loads(p.text)) for p in pieces if p.kind == "call"]


@pytest.mark.parametrize("template", _params())
async def test_the_templates_three_calls_are_read_back(
    template_servers: TemplateServers, template: str
) -> None:
    path = ALL_TEMPLATES / f"{template}.jinja"
    try:
        fmt = await template_servers.format(path, thinking=True)
    except FormatError:
        pytest.skip("history goes as messages: loopd parses no raw text")
    if fmt.tool_call is None:
        pytest.skip("loopd reads no calls in this template's format")
    if not fmt.tool_call.rendered:
        pytest.skip("the template writes no past call")
    async with Client(await template_servers.url(path)) as client:
        probe = await _Probe.start(_render(client), SYSTEM)
        rendered = await probe.assistant(MESSAGE)
    written = _written(fmt, probe.gen, rendered)
    expected = [(name, arguments) for name, arguments in CALLS]
    for size in (len(written), 3):
        assert _calls(fmt, written, size) == expected, (size, fmt, written)
