"""The call grammar on a real llama-server (SmolLM2-135M on the CPU) under real templates.

SmolLM2 never opens a call by itself, so the lazy trigger does not fire here: the grammar's
constrained part is shown by applying the same grammar from the answer's first token (the
model must write a call), and every template's token-exact request with the lazy grammar is
shown to be accepted by the server (the grammar compiles, its trigger is a valid pattern).
That the trigger fires on a call and on nothing else is shown on every template's renderings,
and, sampled, on answers SmolLM2 writes in muse-glimmer's and Kimi-K3's formats.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, TEMPLATES, StartLlama
from loopd.infer import ChatFormat, Client, Completion, FormatError, Generation, PromptRequest
from loopd.infer._format import CALL_ID
from loopd.infer._grammar import HARMONY_RECIPIENT, call_grammar
from loopd.infer._learn import CONTENT, REASONING, Render, _Probe
from loopd.session.baseline import TOOLS, make_baseline
from loopd.turn.exact import ExactHistory
from support.gbnf import prefix_allowed
from support.template_servers import SYSTEM, TemplateServers

pytestmark = pytest.mark.llama

# SmolLM2 at temperature 0 says one thing over and over; a repetition penalty lets it finish
# a string within the token budget.
SAMPLING = {"temperature": 0, "repeat_penalty": 1.5, "repeat_last_n": 256}

# Templates whose calls are a name and JSON arguments, on which SmolLM2 under the grammar ends
# its strings within the budget (under Qwen3's and Hermes 2 Pro's it writes one string until
# the budget runs out: the grammar holds, the call is never closed).
JSON_CALLS = [
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-QwQ-32B",
    "meta-llama-Llama-3.1-8B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Kimi-K2-Instruct",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "CohereForAI-c4ai-command-r-plus-tool_use",
]
OTHER_JSON_CALLS = ["Qwen-Qwen3-0.6B", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"]
PARAMETER_CALLS = ["Qwen3.5-4B", "GLM-4.6", "MiniMax-M2", "MiniMax-M3"]
# Templates whose calls are written in a notation of their own: Gemma 4's, Python (LFM2), or a
# harmony message (gpt-oss). Under Gemma 4's, SmolLM2 writes one string until the budget runs out.
NOTATION_CALLS = [
    "google-gemma-4-31B-it",
    "LFM2.5-8B-A1B",
    "LFM2.5-Instruct",
    "openai-gpt-oss-120b",
]


async def _answer(
    llama: StartLlama, template: str, *, forced: bool | None, max_tokens: int = 300
) -> tuple[ChatFormat, Completion]:
    """One token-exact answer to a question about notes: `forced`, the call grammar from the
    first token; False, no grammar at all; None, the lazy grammar loopd sends."""
    server = await llama(n_ctx=4096, template=TEMPLATES / f"{template}.jinja")
    async with Client(server.url) as client:
        fmt = await ExactHistory(client).format(make_baseline("Be brief."), thinking=False)
        prompt = await client.apply_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Notes?"}],
            list(TOOLS),
            add_generation_prompt=True,
            thinking=False,
        )
        grammar = call_grammar(fmt, TOOLS)
        assert grammar is not None
        request = PromptRequest(
            prompt=[prompt],
            format=fmt,
            tools=TOOLS if forced is not False else (),
            grammar=grammar.gbnf if forced else "",
            generation=Generation(max_tokens=max_tokens, sampling=SAMPLING, thinking=False),
        )
        return fmt, await client.chat(request, lambda _: None)


def _are_calls(done: Completion) -> bool:
    """One call or more (the grammar lets a model write several), each with the arguments its
    tool's schema asks for."""
    for call in done.tool_calls:
        arguments = json.loads(call.arguments)
        if call.name == "find_tool":
            ok = isinstance(arguments.get("query"), str)
        else:
            ok = isinstance(arguments.get("name"), str) and isinstance(
                arguments.get("arguments"), dict
            )
        if not ok:
            return False
    return bool(done.tool_calls)


@pytest.mark.parametrize("template", JSON_CALLS + NOTATION_CALLS[1:])
async def test_under_the_call_grammar_the_model_writes_a_call_loopd_reads(
    llama: StartLlama, template: str
) -> None:
    _, done = await _answer(llama, template, forced=True)
    assert _are_calls(done), done


async def test_without_the_grammar_the_model_writes_no_call(llama: StartLlama) -> None:
    """What the test above shows is the grammar's doing."""
    _, done = await _answer(llama, JSON_CALLS[0], forced=False)
    assert not done.tool_calls


@pytest.mark.parametrize(
    "template", JSON_CALLS + OTHER_JSON_CALLS + PARAMETER_CALLS + NOTATION_CALLS
)
async def test_the_server_takes_the_lazy_grammar_of_every_template(
    llama: StartLlama, template: str
) -> None:
    """A grammar that did not compile, or a trigger that is not a preserved token, is a 400.
    The server says so before its first token, so a few tokens show it (300 took about 4 s
    more on each template)."""
    _, done = await _answer(llama, template, forced=None, max_tokens=8)
    assert done.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("template", [*PARAMETER_CALLS, "google-gemma-4-31B-it"])
async def test_under_the_grammar_a_call_follows_the_templates_syntax(
    llama: StartLlama, template: str
) -> None:
    """SmolLM2 rarely ends a text value (a Gemma 4 string too) within the budget; what it
    writes is the template's opening, a tool's name and its first key, or a whole call."""
    fmt, done = await _answer(llama, template, forced=True)
    assert fmt.tool_call is not None
    written = (done.content or "").lstrip()
    opening = fmt.tool_call.open.lstrip() + "find_tool" + fmt.tool_call.mid
    assert done.tool_calls or written.startswith(opening) or "call_tool" in written


# Every template of llama.cpp's, with the formats loopd learns from them.
ALL_TEMPLATES = Path(os.environ.get("LOOPD_TEMPLATES") or ROOT / ".cache/llama-templates")


def _render(client: Client) -> Render:
    async def render(conversation: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return await client.apply_template(
            conversation, list(TOOLS), add_generation_prompt=generation_prompt, thinking=True
        )

    return render


@pytest.mark.parametrize("template", sorted(p.name for p in ALL_TEMPLATES.glob("*.jinja")))
async def test_the_trigger_fires_on_the_templates_call_and_on_nothing_else(
    template_servers: TemplateServers, template: str
) -> None:
    """What follows the prompt as the template renders it: an answer to the user, a reasoning
    block that ends and an answer, and a call of an offered tool, which alone the trigger
    matches, where the call's opening starts."""
    try:
        fmt = await template_servers.format(ALL_TEMPLATES / template, thinking=True)
    except FormatError:
        pytest.skip("history goes as messages: loopd sends no grammar")
    grammar = call_grammar(fmt, TOOLS)
    if grammar is None or fmt.tool_call is None:
        pytest.skip("loopd makes no grammar for this template's calls")
    async with Client(await template_servers.url(ALL_TEMPLATES / template)) as client:
        probe = await _Probe.start(_render(client), SYSTEM)
        answers = [probe.plain]
        # A reasoning block that ends, then the answer (Devstral's template writes the
        # reasoning in the content's place: nothing to show there).
        with contextlib.suppress(FormatError):
            answers.append(
                await probe.assistant({"content": CONTENT, "reasoning_content": REASONING})
            )
        arguments = json.dumps({"query": "notes"})
        call = {  # an id of nine letters and digits, as Mistral's templates ask
            "id": "c00000001",
            "type": "function",
            "function": {"name": "find_tool", "arguments": arguments},
        }
        called = await probe.assistant({"content": CONTENT, "tool_calls": [call]})
    opening = fmt.tool_call.open.lstrip()
    if not fmt.tool_call.rendered:  # the template writes no past call: its family's syntax
        called = opening.replace(CALL_ID, "c00000001") + "find_tool" + fmt.tool_call.mid
    trigger = re.compile(grammar.watched)
    assert [trigger.search(a) for a in answers] == [None] * len(answers)
    found = trigger.search(called)
    assert found is not None, (grammar.trigger, called)
    # Harmony's call is a message whose recipient opens what the grammar constrains.
    start = HARMONY_RECIPIENT if fmt.harmony else opening.split(CALL_ID)[0]
    assert called.startswith(start, found.start())
    if fmt.tool_call.rendered and (fmt.harmony or fmt.tool_call.notation != "json"):
        # From there the grammar allows the call as the template writes it.
        assert prefix_allowed(grammar.gbnf, called[found.start() :]), called


# Earlier answers to copy, for a model that does not know the template: each a reasoning
# block that ends, then an answer to the user.
FEW_SHOT = [
    message
    for question, thought, answer in [
        ("Hi.", "A greeting.", "Hello!"),
        ("Thanks.", "Thanks.", "You are welcome."),
        ("Bye.", "A farewell.", "Goodbye!"),
    ]
    for message in (
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer, "reasoning_content": thought},
    )
]


@pytest.mark.parametrize(
    ("template", "opening"), [("muse-glimmer", "to="), ("Kimi-K3", "<|close|>")]
)
async def test_an_answer_with_tools_offered_is_not_forced_into_a_call(
    llama: StartLlama, template: str, opening: str
) -> None:
    """Sampled as a model samples, SmolLM2 copies the earlier answers: it ends a reasoning
    block and answers the user, writing the first word of a call's opening (`opening`, the
    old trigger, which forced every such answer into a call). Under the lazy grammar its answer
    is token for token the one it writes with no grammar at all."""
    server = await llama(n_ctx=8192, template=ALL_TEMPLATES / f"{template}.jinja", parallel=2)
    async with Client(server.url) as client:
        fmt = await ExactHistory(client).format(make_baseline("Be brief."), thinking=True)
        prompt = await client.apply_template(
            [
                {"role": "system", "content": "Be brief."},
                *FEW_SHOT,
                {"role": "user", "content": "Hi."},
            ],
            list(TOOLS),
            add_generation_prompt=True,
            thinking=True,
        )
        sampling = {"temperature": 0.7, "seed": 7, "top_k": 20}
        answers = []
        for slot, tools in enumerate((TOOLS, ())):  # each from an empty slot, computed alike
            request = PromptRequest(
                prompt=[prompt],
                format=fmt,
                tools=tools,
                generation=Generation(slot=slot, max_tokens=60, sampling=sampling, thinking=True),
            )
            done = await client.chat(request, lambda _: None)
            assert done.tokens is not None
            answers.append(
                (done, await client.detokenize([t for t in done.tokens if isinstance(t, int)]))
            )
    (lazy, text), (free, free_text) = answers
    assert call_grammar(fmt, TOOLS) is not None
    assert opening in text, text
    assert lazy.tokens == free.tokens, (text, free_text)
    assert not lazy.tool_calls
