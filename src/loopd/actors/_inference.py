"""The inference actor: owns the model's slot, so requests reach it one at a time.

A turn asks through `InferenceHandle.chat_with_retry`, which puts a job in the actor's inbox
and waits for its answer; jobs run in the order they came. Saving and restoring the slot's KV
cache (`slot_file`) are jobs too, so they never overlap a request on the slot. Each job
carries a cancel scope made by its caller: if the caller is cancelled while its job runs, the
caller cancels that scope, which ends the HTTP stream at once (llama-server then frees the
slot). A job whose caller left before it started is skipped.

The thinking cap is the server's reasoning budget first; when a server ignores it, the
client's stream reader ends the stream once the reasoning runs past the cap (counted in the
pieces the server streams, one token each), keeping what was said (`loopd.infer`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

import outcome
import trio

from loopd.inbox import answer, run_for
from loopd.infer import AnyRequest, Client, Completion, EventSink, SlotFile

__all__ = ["InferenceHandle", "inference_actor"]

T = TypeVar("T")


@dataclass
class _Job:
    work: Callable[[Client], Awaitable[Any]]
    reply: trio.MemorySendChannel[outcome.Outcome[Any]]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class InferenceHandle:
    """The side of the actor a turn holds; it satisfies `loopd.turn.Inference`."""

    def __init__(self, jobs: trio.MemorySendChannel[_Job], slot: int) -> None:
        self._jobs = jobs
        self.slot = slot

    async def chat_with_retry(self, request: AnyRequest, on_event: EventSink) -> Completion:
        return await self._run(lambda client: client.chat_with_retry(request, on_event))

    async def slot_file(self, action: str, filename: str) -> SlotFile:
        """Save the slot's cache to `filename` or restore it from there (`Client.slot_file`)."""
        return await self._run(lambda client: client.slot_file(self.slot, action, filename))

    async def slot_held(self) -> int | None:
        """Tokens the slot holds now (`Client.slot_held`)."""
        return await self._run(lambda client: client.slot_held(self.slot))

    async def slot_count(self) -> int | None:
        """How many slots the server has (`Client.slot_count`)."""
        return await self._run(lambda client: client.slot_count())

    async def _run(self, work: Callable[[Client], Awaitable[T]]) -> T:
        reply_send, reply_receive = trio.open_memory_channel[outcome.Outcome[Any]](1)
        job = _Job(work, reply_send)
        try:
            await self._jobs.send(job)
            async with reply_receive:
                result = await reply_receive.receive()
        finally:
            job.scope.cancel()  # a no-op once the job is done; ends it if we were cancelled
        return cast("T", result.unwrap())


async def inference_actor(
    client: Client,
    slot: int = 0,
    *,
    task_status: trio.TaskStatus[InferenceHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run jobs on `slot` in order until cancelled."""
    send, receive = trio.open_memory_channel[_Job](math.inf)
    task_status.started(InferenceHandle(send, slot))
    async with receive:
        async for job in receive:
            with job.reply:
                await run_for(job.scope, partial(job.work, client), partial(answer, job.reply))
