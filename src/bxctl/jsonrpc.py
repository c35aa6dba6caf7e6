"""JSON-RPC 2.0 on a pair of byte streams, one message a line: the peer `bxctl acp` is to the
editor that starts it.

Requests are answered each in a task of its own, so a long one (a prompt) never holds up the
next (its cancel); notifications are taken in order, as they come. Requests to the other side
wait for its answer by id. Whatever comes in that is not JSON-RPC gets an error, and the peer
goes on: a line that is not JSON, one over the cap (skipped to its end), a method it does not
offer, params that do not fit the method's model.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from pydantic import BaseModel, ValidationError

from loopd.wire.lines import TooLong
from loopd.wire.reader import LineReader

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "Method",
    "Notification",
    "Peer",
    "RpcError",
    "Then",
]

log = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

_ENDED = "the other side closed its input"

Method = tuple[type[BaseModel], Callable[[Any], Awaitable[BaseModel]]]
"""A request's params model, and what answers it."""
Notification = tuple[type[BaseModel], Callable[[Any], Awaitable[None]]]
Then = Callable[[Any, Any], Awaitable[None]]
"""What follows a method's answer, given its request and its result: notifications about what
the answer made, which the other side can place only once it has the answer."""


class RpcError(Exception):
    """An error answer: its code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Peer:
    def __init__(  # noqa: PLR0913 - what it offers, and how its errors read
        self,
        output: trio.abc.SendStream,
        *,
        name: str,
        methods: Mapping[str, Method],
        notifications: Mapping[str, Notification],
        errors: Mapping[type[Exception], int],
        max_line: int,
        then: Mapping[str, Then] | None = None,
    ) -> None:
        self.output, self.name = output, name
        self.methods, self.notifications, self.errors = methods, notifications, errors
        self.then = then or {}
        """By method: what runs after its (successful) answer is written."""
        self.max_line = max_line
        """`errors`: exceptions a method may raise that are an answer, with their codes."""
        self._writing = trio.Lock()
        self._asked: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        """Requests to the other side that wait for its answer, by id."""
        self._ids = itertools.count(1)
        self._ended = False
        """The other side's input ended: nothing more will be answered."""

    async def serve(self, stdin: trio.abc.ReceiveStream) -> None:
        """Take messages until the input ends, then answer the requests still running (the
        other side may still read); a request of ours that waits then fails, since nobody is
        left to answer it."""
        lines = LineReader(stdin, self.max_line)
        async with trio.open_nursery() as nursery:
            while (line := await lines.next()) is not None:
                if isinstance(line, TooLong):
                    await self.error(
                        None, INVALID_REQUEST, f"a line may be at most {line.cap} bytes"
                    )
                else:
                    await self._take(line, nursery)
            self._ended = True
            for answered, reply in self._asked.values():
                reply.append({"error": {"code": INTERNAL_ERROR, "message": _ENDED}})
                answered.set()

    async def notify(self, method: str, params: BaseModel) -> None:
        await self._write({"method": method, "params": dumped(params)})

    async def ask(self, method: str, params: BaseModel) -> dict[str, Any]:
        """A request to the other side; its result. Raises `RpcError` for an error answer, or
        when the other side has stopped sending."""
        if self._ended:
            raise RpcError(INTERNAL_ERROR, f"{method}: {_ENDED}")
        rpc_id = next(self._ids)
        answered: tuple[trio.Event, list[dict[str, Any]]] = (trio.Event(), [])
        self._asked[rpc_id] = answered
        try:
            await self._write({"id": rpc_id, "method": method, "params": dumped(params)})
            await answered[0].wait()
        finally:
            del self._asked[rpc_id]
        reply = answered[1][0]
        if "error" in reply:
            raise RpcError(INTERNAL_ERROR, f"{method} was answered with an error: {reply['error']}")
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    async def error(self, rpc_id: object, code: int, message: str) -> None:
        await self._write({"id": rpc_id, "error": {"code": code, "message": message}})

    async def _write(self, message: dict[str, Any]) -> None:
        async with self._writing:
            await self.output.send_all(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")

    async def _take(self, line: bytes, nursery: trio.Nursery) -> None:
        try:
            message = json.loads(line)
        except ValueError as e:  # also a line that is not UTF-8
            await self.error(None, PARSE_ERROR, f"not JSON: {e}")
            return
        if not isinstance(message, dict):
            await self.error(None, INVALID_REQUEST, "a message is a JSON object")
            return
        rpc_id, method = message.get("id"), message.get("method")
        if method is None:  # an answer to one of ours
            if isinstance(rpc_id, int) and (asked := self._asked.get(rpc_id)) is not None:
                asked[1].append(message)
                asked[0].set()
            elif "result" not in message and "error" not in message:
                await self.error(rpc_id, INVALID_REQUEST, "neither a request nor an answer")
        elif not isinstance(method, str):
            await self.error(rpc_id, INVALID_REQUEST, "method is a string")
        elif "id" not in message:
            await self._notified(method, message.get("params"))
        elif method not in self.methods:
            await self.error(rpc_id, METHOD_NOT_FOUND, f"{self.name} does not offer {method}")
        else:
            nursery.start_soon(self._answer, rpc_id, method, message.get("params"))

    async def _notified(self, method: str, params: object) -> None:
        """A notification has no answer, not even an error: one not offered, or with params
        that do not fit, is dropped."""
        if method not in self.notifications:
            return
        kind, take = self.notifications[method]
        try:
            notification = kind.model_validate(params or {})
        except ValidationError:
            return
        await take(notification)

    async def _answer(self, rpc_id: object, method: str, params: object) -> None:
        kind, handler = self.methods[method]
        try:
            request = kind.model_validate(params or {})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "params"
            await self.error(rpc_id, INVALID_PARAMS, f"{method}: {where}: {first['msg']}")
            return
        try:
            result = await handler(request)
        except RpcError as e:
            await self.error(rpc_id, e.code, e.message)
        except Exception as e:  # the other side is told; the other requests go on
            code = next((c for kind, c in self.errors.items() if isinstance(e, kind)), None)
            if code is None:
                log.exception("%s failed", method)
                code, e = (
                    INTERNAL_ERROR,
                    RuntimeError(f"{self.name} failed: {type(e).__name__}: {e}"),
                )
            await self.error(rpc_id, code, str(e))
        else:
            await self._write({"id": rpc_id, "result": dumped(result)})
            if (then := self.then.get(method)) is not None:
                await then(request, result)


def dumped(model: BaseModel) -> dict[str, Any]:
    """A model as the wire carries it: by its aliases, without the fields left unset."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
