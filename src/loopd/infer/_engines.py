"""The engines loopd speaks to, behind one seam: llama.cpp's llama-server, vLLM, and any
OpenAI-compatible server. `Client` holds one and never branches on which it has.

- llama-server: token-exact on `/completion`, a prompt of text and token ids mixed, the tokens
  generated named by `return_tokens`; templates rendered by `/apply-template`; the cache
  figure `timings.cache_n`, per token; slots (`/slots`) pinned with `id_slot` and saved to
  files; model and context from `/props` and `/slots`.
- vLLM: token-exact on `/v1/completions`, the prompt as token ids alone (each text tokenized
  first by `/tokenize`, kept), the tokens generated named by `return_token_ids`; templates
  rendered by `/tokenize` of the messages and `/detokenize`; the cache figure
  `usage.prompt_tokens_details.cached_tokens`, in whole blocks (`/metrics` says their size);
  no slots: every request shares one prefix cache; model and context from `/v1/models`.
- any OpenAI-compatible server: history as messages on `/v1/chat/completions`, its tool calls
  read by the server; the cache figure where `usage` reports one, else none.

Which engine a server is, is found from the server itself (`identify`): `/props` is
llama-server's; `/v1/models` names vLLM as its models' owner; any other answer there is an
OpenAI-compatible server.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import Field, TypeAdapter

from loopd.canonical import canonical

from ._assemble import Assembler, Loose, Usage, read_chunk
from ._errors import BadAnswer, HttpError, InferError, StreamBroken
from ._format import FormatError
from ._grammar import structural_tag
from ._raw import RawAssembler, RawChunk, parser_for
from ._schema import ArgumentTypes
from ._types import (
    ChatEvent,
    ChatRequest,
    Completion,
    PromptRequest,
    template_kwargs,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._prompt_json import PromptJson
    from ._types import PromptPiece

__all__ = ["ENGINES", "Engine", "EngineName", "JsonApi", "Reader", "ServerFacts", "identify"]

log = logging.getLogger(__name__)

EngineName = Literal["llama", "vllm", "openai"]


class JsonApi(Protocol):
    """The small JSON requests an engine makes of its server (`Client`'s)."""

    base_url: str

    async def get_json(self, path: str) -> dict[str, Any]: ...

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...

    async def get_text(self, path: str) -> str: ...

    async def get_any(self, path: str) -> object:
        """Any JSON, or None where the server answers an error or no JSON."""
        ...


class Reader(Protocol):
    """A stream's `data:` payloads in, events and one `Completion` out (sans-IO)."""

    @property
    def done(self) -> bool: ...

    def feed(self, data: str) -> list[ChatEvent]: ...

    def past_limit(self) -> list[ChatEvent] | None: ...

    def completion(self, *, cut_by_client: bool = False) -> Completion: ...


@dataclass(frozen=True)
class ServerFacts:
    """What a server says of itself, for `status` and `check-config`."""

    engine: EngineName
    model: str | None
    context: int | None
    """Each request's context window in tokens, when the server says."""
    slots: int | None = None
    """llama-server's slots; None where the server has none (or does not list them)."""
    block: int | None = None
    """vLLM's cache block, in tokens."""
    started: float | None = None
    """When the server's process started (seconds since the epoch), where it says."""


class Engine:
    """What one kind of server is asked, and how its answers are read."""

    name: ClassVar[EngineName]
    exact: ClassVar[bool] = False
    """It takes token-exact prompts: the history is sent as the tokens the slot holds."""
    slot_files: ClassVar[bool] = False
    """Each slot holds a cache of its own, which can be saved to a file and restored."""
    health: ClassVar[str] = "/health"
    """The path that answers 200 once the server can take requests."""

    def __init__(self, api: JsonApi, model: str | None = None, block: int | None = None) -> None:
        self.api = api
        self.wanted = model
        """The model `[server] model` names; None: the server's first."""
        self.model = model
        """The model asked for: `wanted`, else the one `describe` found."""
        self.block = block
        """The cache's grain: `[server] block_size`, else what `describe` read."""
        self.facts: ServerFacts | None = None
        """What `describe` found last; None before it answered."""

    async def describe(self) -> ServerFacts:
        """What the server says of itself (kept as `facts`)."""
        raise NotImplementedError

    async def slots(self) -> list[Any] | None:
        """The slots `GET /slots` lists (llama-server's); None for an engine without them."""
        return None

    def end(self, request: ChatRequest | PromptRequest) -> str:
        """What a whole stream ends with, for the error of one that ended before it."""
        del request
        return "[DONE]"

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        thinking: bool,
        date: str | None,
    ) -> str:
        """The prompt the server's chat template makes of these messages (`exact` engines)."""
        raise NotImplementedError

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens` (`exact` engines)."""
        raise NotImplementedError

    async def chat_template(self) -> str:
        """The chat template's source, where the server tells it; else empty."""
        return ""

    async def request(
        self, request: ChatRequest | PromptRequest, prompts: PromptJson | None
    ) -> tuple[str, bytes]:
        """The path and body of a streamed request; `prompts`: the JSON its slot kept of the
        last token-exact prompt (llama-server's)."""
        raise NotImplementedError

    def reader(self, request: ChatRequest | PromptRequest) -> tuple[Reader, list[ChatEvent]]:
        """The reader of the request's stream, and the events of what the prompt itself
        began the answer with (a prefill)."""
        return _assembler(request, self.block), []

    @property
    def title(self) -> str:
        return f"the {TITLES[self.name]} at {self.api.base_url}"


TITLES: dict[EngineName, str] = {
    "llama": "llama-server",
    "vllm": "vLLM server",
    "openai": "OpenAI-compatible server",
}


def _assembler(request: ChatRequest | PromptRequest, block: int | None) -> Assembler:
    g = request.generation
    return Assembler(thinking_cap=g.budget, repetition_cap=g.repetition_cap, block=block)


def _rendering(add_generation_prompt: bool, thinking: bool, date: str | None) -> dict[str, Any]:
    """What a request for a template's rendering asks besides the messages, alike on every
    engine that renders: the generation prompt, thinking on or off, the pinned date."""
    # Also as a template variable: llama-server leaves it undefined when false, and a
    # template that defaults an undefined one to true (RWKV World's) would add it anyway.
    kwargs = template_kwargs(thinking=thinking, date=date)
    return {
        "add_generation_prompt": add_generation_prompt,
        "chat_template_kwargs": {**kwargs, "add_generation_prompt": add_generation_prompt},
    }


def chat_body(request: ChatRequest, model: str | None) -> bytes:
    """A chat request as any OpenAI-compatible server reads it: none of llama-server's own
    fields, which a strict server refuses."""
    g = request.generation
    payload: dict[str, Any] = {
        **g.sampling,
        "messages": request.messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    if request.tools:
        payload["tools"] = request.tools
    if g.max_tokens is not None:
        payload["max_tokens"] = g.max_tokens
    return canonical(payload)


class LlamaServer(Engine):
    """llama.cpp's llama-server: token-exact on `/completion`, slots pinned and saved."""

    name = "llama"
    exact = True
    slot_files = True

    async def describe(self) -> ServerFacts:
        props = await self.api.get_json("/props")
        path = props.get("model_path")
        model = path.rsplit("/", 1)[-1] if isinstance(path, str) else None
        slots = await self.slots()
        windows = (s.get("n_ctx") for s in slots or () if isinstance(s, dict))
        context = next((n for n in windows if isinstance(n, int)), None)
        count = None if slots is None else len(slots)
        self.facts = ServerFacts("llama", model, context, count)
        return self.facts

    async def slots(self) -> list[Any] | None:
        slots = await self.api.get_any("/slots")
        return slots if isinstance(slots, list) else None

    def end(self, request: ChatRequest | PromptRequest) -> str:
        return "its last chunk" if isinstance(request, PromptRequest) else "[DONE]"

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        thinking: bool,
        date: str | None,
    ) -> str:
        body = {
            "messages": messages,
            "tools": tools,
            **_rendering(add_generation_prompt, thinking, date),
        }
        prompt = (await self.api.post_json("/apply-template", body)).get("prompt")
        if not isinstance(prompt, str):
            raise BadAnswer("llama-server's /apply-template answered without a prompt")
        return prompt

    async def detokenize(self, tokens: list[int]) -> str:
        text = (await self.api.post_json("/detokenize", {"tokens": tokens})).get("content")
        if not isinstance(text, str):
            raise BadAnswer("llama-server's /detokenize answered without content")
        return text

    async def chat_template(self) -> str:
        template = (await self.api.get_json("/props")).get("chat_template")
        return template if isinstance(template, str) else ""

    async def request(
        self, request: ChatRequest | PromptRequest, prompts: PromptJson | None
    ) -> tuple[str, bytes]:
        if isinstance(request, PromptRequest):
            return "/completion", request.body(prompts)
        return "/v1/chat/completions", request.body()

    def reader(self, request: ChatRequest | PromptRequest) -> tuple[Reader, list[ChatEvent]]:
        assembler = _assembler(request, None)
        if not isinstance(request, PromptRequest):
            return assembler, []
        raw = RawAssembler(parser_for(request.format, ArgumentTypes(request.tools)), assembler)
        return raw, raw.prime(request.prefill)


LOADING = 503
"""llama-server's status while it loads its model."""
BLOCK_SIZE = r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"'
"""The block size in vLLM's `/metrics`: a label of its cache's configuration."""
TOKENIZED_KEPT = 4096
"""Texts whose tokens a vLLM engine keeps: each turn adds one or two (the prompt records'), so a
session's are tokenized once, not on every request."""


class Vllm(Engine):
    """vLLM: token-exact on `/v1/completions` with the prompt as token ids; no slots, the
    prefix cache shared by every request, kept in blocks."""

    name = "vllm"
    exact = True

    def __init__(self, api: JsonApi, model: str | None = None, block: int | None = None) -> None:
        super().__init__(api, model, block)
        self.context: int | None = None
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        """The ids of the texts tokenized, by the model and the server's run that made them."""

    async def describe(self) -> ServerFacts:
        entry = await _first_model(self.api, self.wanted)
        context = entry.get("max_model_len")
        self.context = context if isinstance(context, int) else None
        try:
            metrics = await self.api.get_text("/metrics")
        except InferError as e:
            log.warning("%s does not say its block size (/metrics: %s)", self.title, e)
            metrics = ""
        if block := re.search(BLOCK_SIZE, metrics, re.MULTILINE):
            self.block = int(block.group(1))
        started = re.search(r"^process_start_time_seconds ([0-9.e+]+)$", metrics, re.MULTILINE)
        facts = ServerFacts(
            "vllm",
            self.wanted or _str(entry.get("id")),
            self.context,
            block=self.block,
            started=float(started.group(1)) if started else None,
        )
        if self.facts and (facts.model, facts.started) != (self.facts.model, self.facts.started):
            self._tokens.clear()  # another model, or another run of it: tokenized anew
        self.model, self.facts = facts.model, facts
        return facts

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        thinking: bool,
        date: str | None,
    ) -> str:
        body: dict[str, Any] = {
            "messages": messages,
            **_rendering(add_generation_prompt, thinking, date),
            "add_special_tokens": False,  # the template writes them
        }
        if tools:
            body["tools"] = tools
        if self.model is not None:
            body["model"] = self.model
        tokens = (await self.api.post_json("/tokenize", body)).get("tokens")
        if not isinstance(tokens, list):
            raise BadAnswer("vLLM's /tokenize answered without tokens")
        return await self.detokenize(tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        body: dict[str, Any] = {"tokens": tokens}
        if self.model is not None:
            body["model"] = self.model
        text = (await self.api.post_json("/detokenize", body)).get("prompt")
        if not isinstance(text, str):
            raise BadAnswer("vLLM's /detokenize answered without its text")
        return text

    async def ids(self, pieces: Sequence[PromptPiece]) -> list[int]:
        """The prompt as token ids alone (vLLM takes no mix of text and ids): each text
        tokenized by the server, as its chat endpoint tokenizes a rendered prompt."""
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += await self._tokenized(piece)
        return ids

    async def _tokenized(self, text: str) -> list[int]:
        if (known := self._tokens.get(text)) is not None:
            self._tokens.move_to_end(text)
            return known
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self.model is not None:
            body["model"] = self.model
        tokens = (await self.api.post_json("/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BadAnswer("vLLM's /tokenize answered without tokens")
        self._tokens[text] = tokens
        if len(self._tokens) > TOKENIZED_KEPT:
            self._tokens.popitem(last=False)
        return tokens

    async def request(
        self, request: ChatRequest | PromptRequest, prompts: PromptJson | None
    ) -> tuple[str, bytes]:
        del prompts  # the body is all ids: nothing of llama-server's mixed JSON is kept
        if not isinstance(request, PromptRequest):
            return "/v1/chat/completions", chat_body(request, self.model)
        g = request.generation
        ids = await self.ids(request.prompt)
        payload: dict[str, Any] = {
            **g.sampling,
            "prompt": ids,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            # Delimiters that are special tokens reach the parser as text.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        }
        if self.model is not None:
            payload["model"] = self.model
        if g.max_tokens is not None:
            payload["max_tokens"] = g.max_tokens
        elif self.context is not None:  # vLLM's default is 16 tokens
            payload["max_tokens"] = max(self.context - len(ids), 1)
        if request.grammar:
            payload["structured_outputs"] = {"grammar": request.grammar}
        elif (calls := structural_tag(request.format, request.tools)) is not None:
            payload["structured_outputs"] = {"structural_tag": calls}
        return "/v1/completions", canonical(payload)

    def reader(self, request: ChatRequest | PromptRequest) -> tuple[Reader, list[ChatEvent]]:
        assembler = _assembler(request, self.block)
        if not isinstance(request, PromptRequest):
            return assembler, []
        raw = RawAssembler(parser_for(request.format, ArgumentTypes(request.tools)), assembler)
        return VllmRaw(raw, self.block), raw.prime(request.prefill)


class _VllmChoice(Loose):
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _VllmChunk(Loose):
    choices: list[_VllmChoice] = Field(default_factory=list)
    usage: Usage | None = None
    error: object | None = None


_VLLM_CHUNK = TypeAdapter(_VllmChunk)


@dataclass
class VllmRaw:
    """vLLM's `/v1/completions` stream read into `RawAssembler`'s chunks: each chunk's new
    text and the ids of its tokens; the finish reason, then the usage (`include_usage`), then
    `[DONE]`."""

    raw: RawAssembler
    block: int | None
    _counted: int = 0
    _finish: tuple[str, int | str | None] | None = None

    @property
    def done(self) -> bool:
        return self.raw.done

    def feed(self, data: str) -> list[ChatEvent]:
        if data == "[DONE]":
            if self._finish is None:
                raise StreamBroken("the vLLM server ended the stream without a finish reason")
            return self._end(None) if not self.raw.done else []  # no usage: no figures
        chunk = read_chunk(_VLLM_CHUNK, data)
        events: list[ChatEvent] = []
        for choice in chunk.choices:
            ids = choice.token_ids or []
            if choice.text and not ids:  # the next prompt could not extend this answer
                raise StreamBroken(
                    f"the vLLM server sent text without its token ids ({choice.text[:80]!r}): "
                    "it must be vLLM 0.10.2 or newer, which knows return_token_ids"
                )
            if ids:
                self._counted += len(ids)
                events += self.raw.take(
                    RawChunk(content=choice.text, tokens=ids, tokens_predicted=self._counted)
                )
            if choice.finish_reason is not None:
                if choice.finish_reason not in {"stop", "length"}:  # `abort`, `error`
                    raise StreamBroken(
                        f"the vLLM server ended the answer with {choice.finish_reason!r}"
                    )
                self._finish = (choice.finish_reason, choice.stop_reason)
        if chunk.usage is not None and self._finish is not None:
            events += self._end(chunk.usage)
        return events

    def _end(self, usage: Usage | None) -> list[ChatEvent]:
        reason, stop = self._finish or ("stop", None)  # fed only once a finish came
        # An end of generation (`stop_reason` None) or a stop token ended the message; a stop
        # text did not (it is not among loopd's requests); `length`: a limit.
        ended = reason == "stop" and (stop is None or isinstance(stop, int))
        stop_type = "eos" if ended else ("word" if reason == "stop" else "limit")
        clock = self.raw.inner.clock
        timings = usage.timings(*clock.ms(), self.block) if usage is not None else None
        return self.raw.take(RawChunk(stop=True, stop_type=stop_type, timings=timings))

    def past_limit(self) -> list[ChatEvent] | None:
        return self.raw.past_limit()

    def completion(self, *, cut_by_client: bool = False) -> Completion:
        return self.raw.completion(cut_by_client=cut_by_client)


class OpenAICompatible(Engine):
    """Any server of OpenAI's chat completions (Ollama, LM Studio, SGLang, a hosted API):
    history as messages, its tool calls read by the server."""

    name = "openai"
    health = "/v1/models"  # hosted APIs have no /health

    async def request(
        self, request: ChatRequest | PromptRequest, prompts: PromptJson | None
    ) -> tuple[str, bytes]:
        del prompts  # it keeps no slot
        if isinstance(request, PromptRequest):  # `next_request` sends messages here
            raise FormatError(f"{self.title} takes no token-exact prompt")
        return "/v1/chat/completions", chat_body(request, self.model)

    async def describe(self) -> ServerFacts:
        entry = await _first_model(self.api, self.wanted)
        self.model = self.wanted or _str(entry.get("id"))
        context = next(
            (v for k in ("max_model_len", "context_length") if isinstance(v := entry.get(k), int)),
            None,
        )
        self.facts = ServerFacts("openai", self.model, context)
        return self.facts


async def _first_model(api: JsonApi, wanted: str | None) -> dict[str, Any]:
    """The entry of `/v1/models` for `wanted`, else the first."""
    models = (await api.get_json("/v1/models")).get("data")
    entries = [m for m in models or () if isinstance(m, dict)] if isinstance(models, list) else []
    if wanted is not None:
        for entry in entries:
            if entry.get("id") == wanted:
                return entry
        names = ", ".join(str(e.get("id")) for e in entries) or "none"
        raise BadAnswer(
            f"{api.base_url} serves no model {wanted!r} ([server] model); it serves {names}"
        )
    if not entries:
        raise BadAnswer(f"{api.base_url}/v1/models lists no model")
    return entries[0]


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


ENGINES: dict[EngineName, type[Engine]] = {
    "llama": LlamaServer,
    "vllm": Vllm,
    "openai": OpenAICompatible,
}


async def identify(api: JsonApi) -> EngineName:
    """Which engine answers at `api`: llama-server's `/props`, else the owner `/v1/models`
    names. Raises `BadAnswer` where the server answers neither, `ConnectError` where it
    cannot be reached, and llama-server's 503 while it loads its model (its `/v1/models`
    answers meanwhile, and would be taken for another server's)."""
    try:
        props = await api.get_json("/props")
    except HttpError as e:
        if e.status == LOADING:  # llama-server loading its model: ask again once it answers
            raise
        props = {}
    except BadAnswer:
        props = {}
    if "default_generation_settings" in props or "total_slots" in props:
        return "llama"
    try:
        models = (await api.get_json("/v1/models")).get("data")
    except (HttpError, BadAnswer) as e:
        raise BadAnswer(
            f"{api.base_url} is neither llama-server (no /props) nor an OpenAI-compatible "
            f"server (/v1/models: {e}); set [server] url to one, or [server] engine"
        ) from e
    owners = (
        {m.get("owned_by") for m in models or () if isinstance(m, dict)}
        if isinstance(models, list)
        else set()
    )
    if "llamacpp" in owners:  # a llama-server whose /props wants the key loopd lacks
        return "llama"
    return "vllm" if "vllm" in owners else "openai"
