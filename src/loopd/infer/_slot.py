"""One slot of one llama-server: everything that runs on a slot goes through it (a completion,
a save or restore of its KV cache, its count of tokens), so turns, compaction, slot files and
the daemon all speak to a slot the same way."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ._client import AnyRequest, Client, Cut, EventSink, RetryPolicy, Sent, SlotFile
from ._prompt_json import PromptJson
from ._types import Completion

__all__ = ["Slot"]


@dataclass(frozen=True)
class Slot:
    client: Client
    number: int
    prompts: PromptJson = field(default_factory=PromptJson, compare=False, repr=False)
    """The last token-exact prompt sent on it, as JSON: the next one mostly extends it."""

    @property
    def retry(self) -> RetryPolicy:
        """The backoff between tries on this slot's server."""
        return self.client.retry

    @property
    def reached(self) -> bool:
        """Some answer has come from this slot's server since loopd started."""
        return self.client.reached

    async def chat(
        self,
        request: AnyRequest,
        on_event: EventSink,
        *,
        sent: Sent | None = None,
        cut: Cut | None = None,
    ) -> Completion:
        """`request` on this slot, whatever slot it names: one try (`Client.chat`)."""
        return await self.client.chat(
            self._pinned(request), on_event, sent=sent, prompts=self.prompts, cut=cut
        )

    async def chat_with_retry(self, request: AnyRequest, on_event: EventSink) -> Completion:
        """`request` on this slot, whatever slot it names."""
        return await self.client.chat_with_retry(
            self._pinned(request), on_event, prompts=self.prompts
        )

    def _pinned(self, request: AnyRequest) -> AnyRequest:
        if request.generation.slot == self.number:  # a turn's request names its lease's slot
            return request
        return replace(request, generation=replace(request.generation, slot=self.number))

    async def slot_file(self, action: str, filename: str) -> SlotFile:
        """Save this slot's KV cache to `filename`, or restore it from there."""
        return await self.client.slot_file(self.number, action, filename)

    async def slot_held(self) -> int | None:
        """Tokens this slot holds now; None when the server does not say."""
        return await self.client.slot_held(self.number)
