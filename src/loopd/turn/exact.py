"""Token-exact prompts: each request is the previous one, token for token, plus what is new.

After a request, llama-server's slot holds its prompt and the tokens the model generated (less
the last, never evaluated). Sending history as messages makes the server render and tokenize
it again, and that is not what the slot holds wherever a template drops or rewrites past
reasoning or tool calls, or an answer's text tokenizes differently from how it was generated.
So loopd sends `/completion` a prompt of pieces: the text of each `prompt` record, which the
server tokenizes the same way every time, and the tokens of each answer, as generated.

Only the messages since the last answer are rendered, with the server's own template: a small
conversation of a marker user message, a stand-in for the last answer (its tool calls, marked
content) and the new messages; the text after the stand-in is what the template writes
between that answer and the next one. Its size does not grow with the history, nor does the
work of building the next prompt.

Everything needed to rebuild a prompt is in the log, so a restarted loopd sends the same
request, and nothing is rendered twice: a template that writes today's date into the system
prompt wrote it once, when the session's first request was made.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from loopd.infer import (
    OPENING,
    ChatFormat,
    ChatRequest,
    Client,
    FormatError,
    Generation,
    HttpError,
    Prompt,
    PromptRequest,
    ToolCallFormat,
    decode_arguments,
    delimiter_pattern,
    learn_format,
)
from loopd.session.baseline import messages
from loopd.session.records import AssistantRecord, Baseline, PromptRecord, Record, UsageRecord
from loopd.session.trail import PromptTrail
from loopd.turn.guess import Guessed, Request, Shapes

if TYPE_CHECKING:
    from loopd.session.store import Session

__all__ = [
    "ExactHistory",
    "Learned",
    "NextPrompt",
    "next_request",
    "past_reasoning",
]

log = logging.getLogger(__name__)

USER = "Uz7User"
ANSWER = "Az7Answer"


@dataclass(frozen=True)
class NextPrompt:
    pieces: Prompt
    """The whole prompt for `/completion`."""
    record: PromptRecord
    """What this request adds; appended with its answer."""
    format: ChatFormat
    check: Callable[[], Awaitable[NextPrompt | None]] | None = None
    """Where the new messages' rendering was guessed (`guess.Shapes`): renders them, and
    returns None where the guess was right, else the prompt to send instead."""


async def next_request(
    exact: ExactHistory | None,
    session: Session,
    generation: Generation,
    *,
    prefill: str = "",
    grammar: str = "",
) -> Request | Guessed:
    """The session's next request: token-exact when it can be, else its history as messages,
    with the `prompt` record, if any, to append with the answer; `Guessed` where the new
    messages' rendering was guessed, to be checked as it goes (`guess.send`).
    `prefill`: text the answer starts with (the model continues it); `grammar`: GBNF for the
    rest of it, token-exact requests only (the chat endpoint refuses a grammar beside tools)."""
    baseline, records = session.baseline, session.records
    date = session.header.created.strftime("%d %b %Y")

    def as_messages() -> Request:
        started = [{"role": "assistant", "content": prefill}] if prefill else []
        chat = ChatRequest(
            messages=messages(baseline, records) + started,
            tools=list(baseline.tools),
            generation=generation,
            date=date,
        )
        return chat, None

    if exact is None or not exact.client.engine.exact:  # an OpenAI-compatible server
        return as_messages()

    def prompt_request(nxt: NextPrompt) -> Request:
        record = nxt.record.model_copy(update={"text": nxt.record.text + prefill})
        request = PromptRequest(
            prompt=nxt.pieces.with_last(record.text),
            format=nxt.format,
            generation=generation,
            prefill=prefill,
            grammar=grammar,
            tools=baseline.tools,
        )
        return request, record

    try:
        nxt = await exact.next_prompt(
            baseline, records, thinking=generation.thinking, date=date, trail=session.trail
        )
    except FormatError:
        return as_messages()  # logged where it was found
    if nxt.check is None:
        return prompt_request(nxt)
    check = nxt.check

    async def checked() -> Request | None:
        try:
            right = await check()
        except FormatError:
            return as_messages()
        return None if right is None else prompt_request(right)

    return Guessed(prompt_request(nxt), checked)


def past_reasoning(records: Iterable[Record]) -> int | None:
    """Reasoning tokens the token-exact prompt holds (every answer's, as generated, since the
    last full prompt); None when the history went as messages."""
    kept: int | None = None
    for record in records:
        if isinstance(record, PromptRecord) and record.full:
            kept = 0
        elif isinstance(record, AssistantRecord) and record.tokens is None:
            kept = None
        elif isinstance(record, UsageRecord) and kept is not None:
            kept += record.reasoning_tokens
    return kept


FORMATS_KEPT = 64
"""System prompts whose format is kept: each compaction's session has a new one (its summary),
so without a bound the cache would grow for the life of a loopd."""


@dataclass
class Learned:
    """What one model's chat template has taught loopd, for the life of a loopd: every server
    of that model renders alike, so their `ExactHistory`s share one (`ExactHistory.on`)."""

    formats: dict[tuple[str, bool], ChatFormat | FormatError] = field(default_factory=dict)
    """The template's delimiters (or why it cannot be made exact), by system prompt and
    thinking."""
    texts: dict[int, str] = field(default_factory=dict)
    """The text of each end token met: a model has one or two, asked for once each."""
    shapes: Shapes = field(default_factory=Shapes)
    """Renderings kept to guess the next ones by (`guess.Shapes`)."""


class ExactHistory:
    """Builds token-exact prompts with the server's own template (one per model: servers of
    the same model share what was learned, `on`)."""

    def __init__(self, client: Client, learned: Learned | None = None) -> None:
        self.client = client
        self.learned = learned or Learned()

    def on(self, client: Client) -> ExactHistory:
        """The same, asking `client`'s server (another server of the same model)."""
        return self if client is self.client else ExactHistory(client, self.learned)

    async def format(self, baseline: Baseline, *, thinking: bool) -> ChatFormat:
        """The template's delimiters; a `FormatError` says why a template cannot be read. The
        answer, either way, holds for the life of this loopd."""
        key, formats = (baseline.system, thinking), self.learned.formats
        if key not in formats:
            try:
                learned: ChatFormat | FormatError = await self._learn(baseline, thinking=thinking)
            except FormatError as e:
                log.warning(
                    "history goes as messages: the chat template cannot be made exact: %s", e
                )
                learned = e
            if len(formats) >= FORMATS_KEPT:  # the oldest first: compactions add one each
                del formats[next(iter(formats))]
            formats[key] = learned
        known = formats[key]
        if isinstance(known, FormatError):
            raise FormatError(str(known))
        return known

    async def _learn(self, baseline: Baseline, *, thinking: bool) -> ChatFormat:
        async def render(conversation: list[dict[str, Any]], *, generation_prompt: bool) -> str:
            try:
                return await self._render(
                    baseline, conversation, generation_prompt=generation_prompt, thinking=thinking
                )
            except HttpError as e:  # this conversation is one the template refuses
                raise FormatError(str(e)) from e

        try:
            source = await self.client.chat_template()
        except HttpError as e:
            raise FormatError(f"the server does not tell its chat template ({e})") from e
        return await learn_format(render, baseline.system, source)

    async def next_prompt(
        self,
        baseline: Baseline,
        records: Sequence[Record],
        *,
        thinking: bool,
        date: str | None = None,
        trail: PromptTrail | None = None,
    ) -> NextPrompt:
        """`trail`: the records' `PromptTrail` where it is kept (a session's), else folded
        here."""
        fmt = await self.format(baseline, thinking=thinking)
        built = (trail or PromptTrail(records)).last()
        if built is None:
            return await self._first(baseline, records, fmt, thinking=thinking, date=date)
        history, answer, at = built
        # Shaped like the answer: some templates write calls only when there is no content.
        call_format = fmt.tool_call
        content_first = not (call_format and call_format.content_last)
        dropped = call_format is not None and not call_format.rendered
        shaped = not answer.tool_calls or (answer.content and content_first)
        content = ANSWER if shaped or dropped else None
        stand_in: dict[str, Any] = {"role": "assistant", "content": content}
        if answer.tool_calls:
            stand_in["tool_calls"] = messages(baseline, [answer])[1]["tool_calls"]
        conversation = [
            {"role": "system", "content": baseline.system},
            {"role": "user", "content": USER},
            stand_in,
            *messages(baseline, records[at + 1 :])[1:],
        ]
        shapes = self.learned.shapes
        shape = Shapes.key(conversation, shapes.tools(baseline.tools), thinking)

        async def render() -> str:
            text = await self._render(
                baseline, conversation, generation_prompt=True, thinking=thinking
            )
            if shape is not None:
                shapes.keep(shape, text)
            return text

        guess = shapes.guess(shape) if shape is not None else None
        if guess is None:
            return await self._after(history, answer, fmt, await render())

        async def check() -> NextPrompt | None:
            rendered = await render()
            return None if rendered == guess else await self._after(history, answer, fmt, rendered)

        return replace(await self._after(history, answer, fmt, guess), check=check)

    async def _first(
        self,
        baseline: Baseline,
        records: Sequence[Record],
        fmt: ChatFormat,
        *,
        thinking: bool,
        date: str | None,
    ) -> NextPrompt:
        """A session's first prompt, whole. Guessed where another session's first was rendered
        on the same baseline, date and thinking (`Shapes`), so a new session's first request
        goes without a round trip to the server before it; rendered beside it all the same."""
        conversation = messages(baseline, records)
        shapes = self.learned.shapes
        shape = Shapes.key(conversation, shapes.tools(baseline.tools), thinking, date)

        async def render() -> str:
            text = await self._render(
                baseline, conversation, generation_prompt=True, thinking=thinking, date=date
            )
            if shape is not None:
                shapes.keep(shape, text)
            return text

        def whole(text: str) -> NextPrompt:
            return NextPrompt(Prompt.of([text]), PromptRecord(text=text, full=True), fmt)

        guess = shapes.guess(shape) if shape is not None else None
        if guess is None:
            return whole(await render())

        async def check() -> NextPrompt | None:
            rendered = await render()
            return None if rendered == guess else whole(rendered)

        return replace(whole(guess), check=check)

    async def _after(
        self, history: Prompt, answer: AssistantRecord, fmt: ChatFormat, rendered: str
    ) -> NextPrompt:
        """The prompt after `answer`: what the template wrote after the stand-in for it."""
        try:
            cut = _end_of_answer(rendered, answer, fmt)
        except FormatError as e:
            log.warning("this request goes as messages: %s", e)
            raise
        tokens = answer.tokens or ()
        trim = 0
        if answer.ended and tokens and isinstance(tokens[-1], int):
            end = await self._text(tokens[-1])
            if end and rendered.endswith(end, 0, cut):
                cut -= len(end)  # what closed the calls is the token the model stopped at
            if end and rendered.startswith(end, cut):
                cut += len(end)
            else:  # the template ends an answer its own way; that token is not in the slot
                trim = 1
        text = rendered[cut:]
        record = PromptRecord(text=text, trim=trim)
        # On the trail's list, which only grows: nothing of the history is copied.
        return NextPrompt(history.then(*tokens[: len(tokens) - trim], text), record, fmt)

    async def _text(self, token: int) -> str:
        texts = self.learned.texts
        if token not in texts:
            texts[token] = await self.client.detokenize([token])
        return texts[token]

    async def _render(
        self,
        baseline: Baseline,
        msgs: list[dict[str, Any]],
        *,
        generation_prompt: bool,
        thinking: bool,
        date: str | None = None,
    ) -> str:
        return await self.client.apply_template(
            msgs,
            list(baseline.tools),
            add_generation_prompt=generation_prompt,
            thinking=thinking,
            date=date,
        )


def _end_of_answer(rendered: str, answer: AssistantRecord, fmt: ChatFormat) -> int:
    """Where the stand-in for the answer ends in `rendered`: after its content, its tool calls
    and their closing delimiters, before the template's end of the message."""
    at = rendered.find(USER)
    if at < 0:
        raise FormatError("the template left out the user message")
    at += len(USER)
    content = rendered.find(ANSWER, at)
    if content >= 0:
        at = content + len(ANSWER)
    call_format = fmt.tool_call
    if not answer.tool_calls or call_format is None:
        return at
    if not call_format.rendered:  # the model's calls stay in the prompt; the template's don't
        if content < 0:
            raise FormatError("the template left out an answer that made calls")
        return at
    return _end_of_calls(rendered, at, answer, call_format)


def _end_of_calls(
    rendered: str, at: int, answer: AssistantRecord, call_format: ToolCallFormat
) -> int:
    """Where the answer's calls, written from `at` on, and their closing delimiters end."""
    close = delimiter_pattern(call_format.close, spaced=True)
    for call in answer.tool_calls:
        name = rendered.find(call.name, at)
        if name < 0:
            raise FormatError(f"the template left out the call of {call.name}")
        at = name + len(call.name)
        if call_format.params is None:  # JSON arguments: they may hold the closing text
            opening = rendered.find(OPENING[call_format.notation], at)
            at = _after_arguments(rendered, opening, call.name, call_format)
        if (
            matched := close.search(rendered, at)
            if call_format.params
            else close.match(rendered, at)
        ):
            at = matched.end()
    if block := call_format.block_close and delimiter_pattern(
        call_format.block_close, spaced=True
    ).match(rendered, at):
        at = block.end()
    return at


def _after_arguments(rendered: str, start: int, name: str, call: ToolCallFormat) -> int:
    """Where the arguments that start at `start` end."""
    try:
        return decode_arguments(call.notation, rendered, max(start, 0))[1]
    except ValueError as e:
        raise FormatError(f"the template wrote the arguments of {name} oddly") from e
