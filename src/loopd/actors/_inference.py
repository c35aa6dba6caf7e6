"""The inference actor: owns the model's slot, so requests reach it one at a time.

A turn asks through `InferenceHandle.chat_with_retry`, which queues a job and waits for its
answer. A job that must wait for an earlier one hears `Queued` at once. Each job carries a
cancel scope made by its caller: if the caller is cancelled while its job runs, the caller
cancels that scope, which ends the HTTP stream at once (llama-server then frees the slot).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import outcome
import trio

from loopd.infer import ChatRequest, Client, Completion, EventSink, Queued

__all__ = ["InferenceHandle", "inference_actor"]


@dataclass
class _Job:
    request: ChatRequest
    on_event: EventSink
    reply: trio.MemorySendChannel[outcome.Outcome[Completion]]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class InferenceHandle:
    """The side of the actor a turn holds; it satisfies `loopd.turn.Inference`."""

    def __init__(self, jobs: trio.MemorySendChannel[_Job]) -> None:
        self._jobs = jobs
        self.waiting = 0
        """Jobs sent and not yet started: the queue a status report shows."""
        self.busy = False

    async def chat_with_retry(self, request: ChatRequest, on_event: EventSink) -> Completion:
        reply_send, reply_receive = trio.open_memory_channel[outcome.Outcome[Completion]](1)
        job = _Job(request, on_event, reply_send)
        if self.busy or self.waiting:
            on_event(Queued())
        self.waiting += 1
        try:
            await self._jobs.send(job)
            async with reply_receive:
                result = await reply_receive.receive()
        finally:
            job.scope.cancel()  # a no-op once the job is done; ends it if we were cancelled
        return result.unwrap()


async def inference_actor(
    client: Client, *, task_status: trio.TaskStatus[InferenceHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run jobs in order until cancelled."""
    send, receive = trio.open_memory_channel[_Job](math.inf)
    handle = InferenceHandle(send)
    task_status.started(handle)
    async with receive:
        async for job in receive:
            handle.waiting -= 1
            if job.scope.cancel_called:
                continue  # its caller gave up while it waited
            handle.busy = True
            try:
                with job.scope:
                    result: outcome.Outcome[Completion]
                    try:
                        result = outcome.Value(
                            await client.chat_with_retry(job.request, job.on_event)
                        )
                    except Exception as e:  # noqa: BLE001 - the caller gets it, typed as it was
                        result = outcome.Error(e)
                    with contextlib.suppress(trio.BrokenResourceError):  # the caller left
                        job.reply.send_nowait(result)
            finally:
                handle.busy = False
                job.reply.close()
