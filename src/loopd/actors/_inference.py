"""The inference actor: owns the model's slot, so requests reach it one at a time.

A turn asks through `InferenceHandle.chat_with_retry`, which puts a job in the actor's inbox
and waits for its answer; jobs run in the order they came. Each job carries a cancel scope
made by its caller: if the caller is cancelled while its job runs, the caller cancels that
scope, which ends the HTTP stream at once (llama-server then frees the slot). A job whose
caller left before it started is skipped.

The thinking cap is the server's reasoning budget first; when a server ignores it, the
client's stream reader ends the stream once the reasoning runs past the cap (counted in the
pieces the server streams, one token each), keeping what was said (`loopd.infer`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import outcome
import trio

from loopd.infer import AnyRequest, Client, Completion, EventSink

__all__ = ["InferenceHandle", "inference_actor"]


@dataclass
class _Job:
    request: AnyRequest
    on_event: EventSink
    reply: trio.MemorySendChannel[outcome.Outcome[Completion]]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class InferenceHandle:
    """The side of the actor a turn holds; it satisfies `loopd.turn.Inference`."""

    def __init__(self, jobs: trio.MemorySendChannel[_Job]) -> None:
        self._jobs = jobs

    async def chat_with_retry(self, request: AnyRequest, on_event: EventSink) -> Completion:
        reply_send, reply_receive = trio.open_memory_channel[outcome.Outcome[Completion]](1)
        job = _Job(request, on_event, reply_send)
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
    task_status.started(InferenceHandle(send))
    async with receive:
        async for job in receive:
            with job.reply:
                if job.scope.cancel_called:
                    continue  # its caller gave up while it waited
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
