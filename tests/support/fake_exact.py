"""A scripted llama-server for token-exact history: `/completion` with a prompt of text and
token ids, `/apply-template`, `/tokenize`, `/detokenize` and `/props` with a chat template.

The template is a ChatML stand-in written here (Qwen 2.5's shapes: `<think>` before content,
each call a JSON object in `<tool_call>`, results in `<tool_response>`), and the tokenizer is
one token per character, its special tokens one each, so a prompt's ids are known exactly.
The replies are `support.fake_llama.Reply`s, written out as the raw text a model writes with
that template, streamed one token a chunk in `/completion`'s shape and ended by `<|im_end|>`,
the end-of-generation token, as a real model ends its answer.

Each slot (`id_slot`) holds token ids as llama-server's does: after a request, its prompt and
the tokens generated less the last (sampled, never evaluated); a request's cache figure is the
common prefix of its prompt with them, less one token (always evaluated again). Every
`/completion` is kept (`sent`) with its prompt and what was generated for it, so a test can
check that each prompt extends the previous prompt and answer token for token (`check`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from loopd.session.baseline import messages
from loopd.session.records import AssistantRecord, Baseline, PromptRecord, Record
from loopd.session.trail import PromptTrail
from support.fake_llama import Reply
from support.replay import Exchange, load

SPECIAL = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
"""Each one token: ids 1 to 6."""
EOS = 2
"""`<|im_end|>`: the model's end of generation, and the template's end of every message."""
TEXT = 16
"""A character's id is its code point plus this."""
GENERATION_PROMPT = "<|im_start|>assistant\n"
SOURCE = (
    "{# A ChatML stand-in: <|im_start|>ROLE\\nCONTENT<|im_end|>; reasoning in <think> and "
    "</think>; tools offered in the system message; each call a JSON object in <tool_call>; "
    "tool results in <tool_response>. #}"
)
"""What `/props` gives as the template's source."""
JSON = [("content-type", "application/json")]
SSE = [("content-type", "text/event-stream")]


def tokenize(text: str) -> list[int]:
    """One token per character; a special token's text is one token."""
    ids: list[int] = []
    at = 0
    while at < len(text):
        special = next((n for n, s in enumerate(SPECIAL) if text.startswith(s, at)), None)
        if special is not None:
            ids.append(special + 1)
            at += len(SPECIAL[special])
        else:
            ids.append(ord(text[at]) + TEXT)
            at += 1
    return ids


def detokenize(ids: Sequence[int]) -> str:
    return "".join(SPECIAL[t - 1] if t < TEXT else chr(t - TEXT) for t in ids)


def prompt_ids(prompt: str | Sequence[str | int]) -> list[int]:
    """A `/completion` prompt as the server reads it: each text tokenized, each id as it is."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    ids: list[int] = []
    for piece in prompt:
        ids += tokenize(piece) if isinstance(piece, str) else [piece]
    return ids


def _arguments(arguments: object) -> str:
    """A call's arguments as the template writes them: JSON arguments re-serialised (llama-server
    parses them for the template), anything else as given."""
    if not isinstance(arguments, str):
        return json.dumps(arguments)
    try:
        return json.dumps(json.loads(arguments))
    except ValueError:
        return arguments


def _calls(text: str, calls: Sequence[tuple[str, str]]) -> str:
    """`text`, then each call (name, arguments) as the model writes it, one per line."""
    for name, arguments in calls:
        text += ("\n" if text else "") + (
            f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
        )
    return text


def render(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, generation_prompt: bool
) -> str:
    """The stand-in template. A last assistant message is left open and nothing follows it
    (llama-server takes it for a prefill)."""
    out = ""
    for n, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system" and tools:
            listed = "\n".join(json.dumps(t) for t in tools)
            content += f"\n\n# Tools\n<tools>\n{listed}\n</tools>"
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
            calls = [
                (c["function"]["name"], _arguments(c["function"]["arguments"]))
                for c in m.get("tool_calls") or []
            ]
            content = _calls(text + content, calls)
            if n == len(messages) - 1:
                return out + f"<|im_start|>assistant\n{content}"
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return out + (GENERATION_PROMPT if generation_prompt else "")


def raw_answer(reply: Reply) -> str:
    """What the model writes for `reply` with this template (its call ids are loopd's)."""
    text = f"<think>\n{reply.reasoning}\n</think>\n\n" if reply.reasoning else ""
    return _calls(text + (reply.content or ""), [(n, a) for _, n, a in reply.tool_calls])


@dataclass
class Sent:
    """One `/completion` as the server saw it."""

    slot: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    """The tokens streamed for it (none where it failed before its stream)."""

    @property
    def text(self) -> str:
        return detokenize(self.prompt)


def _chunk(**fields: Any) -> str:
    return f"data: {json.dumps(fields, separators=(',', ':'))}\n\n"


@dataclass
class ExactLlama:
    """Answers `/completion` requests with the replies in order (a `ReplayServer` responder)
    and the side endpoints of token-exact history (`side`)."""

    replies: list[Reply]
    slots: int = 1
    held: dict[int, list[int]] = field(default_factory=dict)
    """What each slot holds."""
    sent: list[Sent] = field(default_factory=list)
    chat: int = 0
    """Requests that came to the chat endpoint instead (history as messages)."""

    def side(self) -> dict[str, Any]:
        """The JSON endpoints besides `/completion`, for `ReplayServer(side=...)`."""
        return {
            "/props": lambda _: {
                "model_path": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "total_slots": self.slots,
                "chat_template": SOURCE,
                "default_generation_settings": {"n_ctx": 8192},
            },
            "/apply-template": lambda body: {
                "prompt": render(
                    body["messages"],
                    body.get("tools") or [],
                    generation_prompt=body.get("add_generation_prompt", True),
                )
            },
            "/tokenize": lambda body: {"tokens": tokenize(body["content"])},
            "/detokenize": lambda body: {"content": detokenize(body["tokens"])},
        }

    def __call__(self, request: Any) -> Exchange:
        if "prompt" not in request:
            self.chat += 1
            body = (
                '{"error":{"code":500,"message":"history went as messages","type":"server_error"}}'
            )
            return Exchange({}, 500, JSON, body, {})
        reply = self.replies.pop(0) if self.replies else Reply(content="(the script ran out)")
        slot = request.get("id_slot", 0)
        sent = Sent(slot, prompt_ids(request["prompt"]))
        self.sent.append(sent)
        if reply.kind == "context_full":
            return load("context_full")[0]
        if reply.kind == "server_error":
            body = '{"error":{"code":500,"message":"scripted failure","type":"server_error"}}'
            return Exchange({}, 500, JSON, body, {})
        if reply.kind == "stall":
            return Exchange({}, 200, SSE, "", {"stall": True})
        prompt = sent.prompt
        before = self.held.get(slot, [])
        # One token is always evaluated again.
        cached = min(_common(before, prompt), len(prompt) - 1)
        generated = [*tokenize(raw_answer(reply)), EOS]
        limit = request.get("n_predict", -1)
        stop_type = "eos"
        if 0 < limit < len(generated):
            generated, stop_type = generated[:limit], "limit"
        progress = {"total": len(prompt), "cache": cached, "processed": len(prompt), "time_ms": 1}
        body = _chunk(content="", tokens=[], tokens_predicted=0, prompt_progress=progress)
        if reply.kind == "stream_error":
            generated = generated[: len(generated) // 2]
        for n, token in enumerate(generated, start=1):
            text = "" if token == EOS and stop_type == "eos" else detokenize([token])
            body += _chunk(content=text, tokens=[token], tokens_predicted=n, stop=False)
        sent.generated = generated
        self.held[slot] = prompt + generated[:-1]
        if reply.kind == "stream_error":
            body += _chunk(error={"code": 500, "message": "scripted", "type": "server_error"})
            return Exchange({}, 200, SSE, body, {})
        timings = {
            "cache_n": cached,
            "prompt_n": len(prompt) - cached,
            "prompt_ms": 1.0,
            "predicted_n": len(generated),
            "predicted_ms": 1.0,
        }
        body += _chunk(
            content="",
            tokens=[],
            stop=True,
            stop_type=stop_type,
            tokens_predicted=len(generated),
            timings=timings,
        )
        return Exchange({}, 200, SSE, body, {"event_delay": reply.delay})


@dataclass(frozen=True)
class Kept:
    """An answer the log keeps with its tokens."""

    prompt: list[int]
    """Its request's prompt, as the log says it was sent."""
    answer: list[int]
    new: str
    """The text the template writes for what came since the answer before (all of the
    prompt, for the first), as `render` writes it."""


def kept(baseline: Baseline, records: Sequence[Record]) -> list[Kept]:
    """Each answer the log keeps with its tokens, in order."""
    trail, out = PromptTrail(), []
    tools = list(baseline.tools)
    before: tuple[int, AssistantRecord] | None = None
    """The answer before, and where it is."""
    prompt_at = 0
    for at, record in enumerate(records):
        trail.add(record)
        if isinstance(record, PromptRecord):
            prompt_at = at
        if not isinstance(record, AssistantRecord) or (built := trail.last()) is None:
            continue
        prompt, answer, _ = built
        if answer is not record:
            continue
        full = cast("PromptRecord", records[prompt_at]).full
        if full or before is None:
            new = render(messages(baseline, records[:prompt_at]), tools, generation_prompt=True)
        else:
            since = messages(baseline, records[before[0] + 1 : prompt_at])[1:]
            ended = before[1].ended and (before[1].tokens or ())[-1:] == (EOS,)
            new = ("\n" if ended else "<|im_end|>\n") + render(since, tools, generation_prompt=True)
        out.append(Kept(prompt_ids(list(prompt)), prompt_ids(list(answer.tokens or ())), new))
        before = (at, record)
    return out


def check(sent: Sequence[Sent], baseline: Baseline, records: Sequence[Record]) -> None:
    """Every request's prompt extends the previous prompt and answer, token for token, with
    what the template writes for what came since.

    The answers the log keeps are found among the requests: the prompt it says was sent,
    exactly, and tokens the server generated for it. That prompt is the one before it and its
    answer, every token, then the template's text for the messages since (the whole rendered
    conversation, for the first). Every request after the first kept one starts with the
    latest kept one's prompt and answer; one whose answer was not kept (a server error, a full
    context) is extended by the next as far as its generation prompt, the one thing a next
    message replaces."""
    answered: dict[int, list[int]] = {}
    at = 0
    last: Kept | None = None
    for k in kept(baseline, records):
        found = [
            i
            for i in range(at, len(sent))
            if sent[i].prompt == k.prompt and sent[i].generated[: len(k.answer)] == k.answer
        ]
        assert found, f"the log keeps an answer to a prompt never sent: {detokenize(k.prompt)!r}"
        extended = last.prompt + last.answer if last else []
        assert k.prompt[: len(extended)] == extended, _diverged(extended, k.prompt)
        new = detokenize(k.prompt[len(extended) :])
        assert new == k.new, f"the template writes {k.new!r} after the answer, the prompt {new!r}"
        at = found[-1]
        answered[at] = k.answer
        at += 1
        last = k
    gen = tokenize(GENERATION_PROMPT)
    kept_so_far: list[int] | None = None
    for i, request in enumerate(sent):
        if kept_so_far is not None:
            assert request.prompt[: len(kept_so_far)] == kept_so_far, _diverged(
                kept_so_far, request.prompt
            )
        if i + 1 < len(sent) and i not in answered:
            assert request.prompt[-len(gen) :] == gen
            before = request.prompt[: -len(gen)]
            after = sent[i + 1].prompt
            assert after[: len(before)] == before, _diverged(before, after)
        if i in answered:
            kept_so_far = request.prompt + answered[i]


def _common(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _diverged(expected: list[int], prompt: list[int]) -> str:
    at = _common(expected, prompt)
    return (
        f"the prompt leaves the one it extends at token {at}: "
        f"{detokenize(expected[at : at + 40])!r} became {detokenize(prompt[at : at + 40])!r}"
    )
