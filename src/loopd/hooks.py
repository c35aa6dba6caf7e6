"""Hooks: the user's own commands at four points of a turn, as Claude Code's and Codex's.

    pre_tool_use        before a tool call runs (and before it asks for approval)
    post_tool_use       after a tool call ran
    user_prompt_submit  as a user message enters a turn
    stop                as a turn ends with an answer

Each hook gets the event as one JSON object on stdin, with Claude Code's field names
(`session_id`, `cwd`, `hook_event_name`, `tool_name`, `tool_input`, `tool_use_id`,
`tool_response`, `prompt`, `stop_hook_active`, `last_assistant_message`), and answers by its
exit status: 0 goes on, its stdout added where the event allows; 2 blocks, its stderr the
reason; any other status, a command that cannot start, one killed by a signal or at its
timeout is an error that is logged and blocks nothing (Claude Code's contract: a hook that
fails, fails open). Hooks of one event run one after the other, in the order of the config;
the first that blocks ends the event's run.

Trade-offs:
- Hooks run as the user, unsandboxed, with loopd's environment, in the session's folder:
  they are the user's own commands, as in Claude Code, not the model's.
- Whatever a hook adds goes into the records the next request is built from, never beside
  them: user_prompt_submit's stdout is appended to the user message as it is logged (not a
  second user message, which some chat templates refuse), post_tool_use's to the call's
  result, and stop's reason to go on is a `hook` record that carries a user message. The log
  stays the truth, and each request still extends the previous one token for token.
- Each run is a `hook` record (what ran, the event, its status, how long, the first
  characters of its stdout and stderr; never its environment), written before what it
  decided takes effect. A run cut short by the turn's cancellation is killed and not logged.
- A stop hook that sends the model back counts as one round of `[loop] tool_iterations`: a
  hook that never lets a turn end cannot hold it forever. Sub-agents' turns run the tool
  hooks (their calls are the user's calls too), not user_prompt_submit or stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from loopd.config import Hook, HooksConfig, ToolHook
from loopd.session.records import HookEvent, HookRecord, UserRecord
from loopd.session.store import Session

__all__ = ["NO_HOOKS", "Hooks"]

READ_BYTES = 64 * 1024
"""What is kept of each of a hook's stdout and stderr; the rest is read and dropped, so a
hook that writes without end neither blocks nor fills loopd's memory."""
TO_MODEL = 10_000
"""Characters of a hook's output the model reads at most (as Claude Code caps it)."""
EXCERPT = 2_000
"""Characters of each of stdout and stderr kept in the `hook` record."""


@dataclass(frozen=True)
class _Ran:
    status: int | None
    """Its exit status, negative for a signal (as Python gives it); None: it did not start,
    or was killed at its timeout."""
    stdout: str
    stderr: str
    seconds: float
    error: str | None = None
    """Why it did not start, or that it was killed at its timeout."""

    @property
    def blocked(self) -> bool:
        return self.status == 2


@dataclass(frozen=True)
class Hooks:
    """The `[hooks]` of the config; every method runs those of its event and logs each run."""

    config: HooksConfig = field(default_factory=HooksConfig)

    async def prompt(self, session: Session, content: str) -> tuple[str, str | None]:
        """The user message as it enters the log (with the hooks' stdout), and why it is
        refused, if a hook refused it (exit 2): then it never enters the log."""
        if session.header.parent is not None:
            return content, None
        event = {"prompt": content}
        context: list[str] = []
        for hook in self.config.user_prompt_submit:
            ran = await self._run(session, hook, "user_prompt_submit", event)
            if ran.blocked:
                return content, f"a user_prompt_submit hook refused the prompt: {_reason(ran)}"
            if ran.status == 0 and ran.stdout.strip():
                context.append(ran.stdout.strip()[:TO_MODEL])
        return "\n\n".join([content, *context]), None

    async def before(self, session: Session, number: int, call_id: str, tool: Tool) -> str | None:
        """Why the call is not run, if a pre_tool_use hook blocked it (exit 2)."""
        event = {"tool_name": tool.name, "tool_input": tool.input, "tool_use_id": call_id}
        for hook in _matching(self.config.pre_tool_use, tool.name):
            ran = await self._run(session, hook, "pre_tool_use", event, call=number, tool=tool.name)
            if ran.blocked:
                return f"Not run: a pre_tool_use hook blocked this call: {_reason(ran)}"
        return None

    async def after(
        self, session: Session, number: int, call_id: str, tool: Tool, result: str
    ) -> str:
        """What the post_tool_use hooks add to the call's result: the stdout of those that
        exit 0, the stderr of those that exit 2 (the call ran: there is nothing to block)."""
        event = {
            "tool_name": tool.name,
            "tool_input": tool.input,
            "tool_use_id": call_id,
            "tool_response": result,
        }
        added = []
        for hook in _matching(self.config.post_tool_use, tool.name):
            ran = await self._run(
                session, hook, "post_tool_use", event, call=number, tool=tool.name
            )
            said = ran.stderr if ran.blocked else ran.stdout if ran.status == 0 else ""
            if said.strip():
                added.append(f"\n\n[post_tool_use hook] {said.strip()[:TO_MODEL]}")
        return "".join(added)

    async def stop(self, session: Session, answer: str | None) -> bool:
        """Whether the turn goes on: a stop hook exited 2, and its stderr, as a user message
        in its `hook` record, asks the model to go on."""
        if session.header.parent is not None or not self.config.stop:
            return False
        event = {"stop_hook_active": _went_on(session), "last_assistant_message": answer or ""}
        for hook in self.config.stop:
            ran = await self._run(session, hook, "stop", event, go_on=True)
            if ran.blocked:
                return True
        return False

    async def _run(  # noqa: PLR0913 - one run's whole context
        self,
        session: Session,
        hook: Hook,
        event: HookEvent,
        fields: dict[str, Any],
        *,
        call: int | None = None,
        tool: str | None = None,
        go_on: bool = False,
    ) -> _Ran:
        folder = session.cwd or Path.home()
        stdin = {
            "session_id": session.id,
            "cwd": str(folder),
            "hook_event_name": event,
            **fields,
        }
        ran = await run_hook(hook.command, json.dumps(stdin).encode(), folder, hook.timeout)
        feedback = None
        if go_on and ran.blocked:
            feedback = f"A stop hook asks you to go on: {_reason(ran)}"
        await session.append(
            HookRecord(
                event=event,
                command=tuple(hook.command),
                call=call,
                tool=tool,
                status=ran.status,
                seconds=round(ran.seconds, 3),
                stdout=ran.stdout[:EXCERPT],
                stderr=ran.stderr[:EXCERPT],
                error=ran.error,
                feedback=feedback,
            )
        )
        return ran


NO_HOOKS = Hooks()


@dataclass(frozen=True)
class Tool:
    """A call as hooks see it: the tool `call_tool` asks for (or `find_tool`, or the name
    the model gave where its arguments name none) and the arguments it gets."""

    name: str
    input: Any

    @classmethod
    def of(cls, name: str, arguments: str) -> Tool:
        try:
            parsed: Any = json.loads(arguments)
        except (ValueError, RecursionError):  # nested past what the parser can: as text
            return cls(name, arguments)
        if name != "call_tool" or not isinstance(parsed, dict):
            return cls(name, parsed)
        tool, inner = parsed.get("name"), parsed.get("arguments", {})
        if isinstance(inner, str):  # some models send the object as a JSON string
            with contextlib.suppress(ValueError, RecursionError):
                inner = json.loads(inner)
        return cls(tool, inner) if isinstance(tool, str) else cls(name, parsed)


def _matching(hooks: list[ToolHook], tool: str) -> list[ToolHook]:
    return [h for h in hooks if h.matcher in ("", "*") or re.fullmatch(h.matcher, tool)]


def _reason(ran: _Ran) -> str:
    return ran.stderr.strip()[:TO_MODEL] or "(the hook gave no reason)"


def _went_on(session: Session) -> bool:
    """A stop hook already sent this turn's model back to work (Claude Code's
    `stop_hook_active`: a hook that checks it cannot hold a turn forever)."""
    for record in reversed(session.records):
        if isinstance(record, UserRecord):
            return False
        if isinstance(record, HookRecord) and record.feedback is not None:
            return True
    return False


async def run_hook(command: list[str], stdin: bytes, folder: Path, timeout: float) -> _Ran:
    """Run one hook: `stdin` in, the first `READ_BYTES` of stdout and stderr out; killed
    with its whole process group at `timeout` or when the caller is cancelled."""
    start = time.monotonic()
    try:
        process = await trio.lowlevel.open_process(
            command,
            cwd=folder,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a group of its own, killed whole
        )
    except OSError as e:
        return _Ran(None, "", "", time.monotonic() - start, f"it did not start: {e}")
    out, err = bytearray(), bytearray()
    try:
        with trio.move_on_after(timeout) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_feed, process.stdin, stdin)
                nursery.start_soon(_keep, process.stdout, out)
                nursery.start_soon(_keep, process.stderr, err)
            await process.wait()
    finally:
        if process.returncode is None or deadline.cancelled_caught:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await process.wait()
    seconds = time.monotonic() - start
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if deadline.cancelled_caught:
        killed = f"killed at its timeout of {timeout:g} s"
        return _Ran(None, stdout, stderr, seconds, killed)
    return _Ran(process.returncode, stdout, stderr, seconds)


async def _feed(stream: trio.abc.SendStream | None, data: bytes) -> None:
    if stream is None:
        return
    async with stream:
        # A hook that does not read its input may exit first: that is its right.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(data)


async def _keep(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
    if stream is None:
        return
    async with stream:
        while chunk := await stream.receive_some(16384):
            into += chunk[: max(READ_BYTES - len(into), 0)]
