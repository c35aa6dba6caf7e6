"""Slot files: the slot's KV cache saved per session, so a session that comes back (after a
switch, a restart of loopd, or a llama-server that died) costs only its new tokens.

A file is an optimisation, never the truth: deleting one loses time, never data. It is named
by its session (`<id>.bin`, in llama-server's `--slot-save-path`) and trusted only as far as
llama-server checks it: a file of another model does not load (the slot is left empty); one
that is stale or another session's loads, and llama-server reuses only the tokens it shares
with the next prompt. Either way the next request's `cache_loss` record says what was lost,
and the restore's token count, compared with what the session's slot held, is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from loopd.infer import HttpError, InferError, SlotFile, slot_tokens
from loopd.store import Session

__all__ = ["SlotFiles"]

log = logging.getLogger(__name__)

SlotAction = Callable[[str, str], Awaitable[SlotFile]]
"""`(action, filename)`: `InferenceHandle.slot_file`, or a client's on an idle slot."""

# llama-server without --slot-save-path answers slot actions with this.
NOT_SUPPORTED = 501


@dataclass
class SlotFiles:
    action: SlotAction
    save_when: str
    """`[slots] save`: `turn`, `stop` or `never`."""
    directory: Path | None
    """Where llama-server writes the files, when loopd can see it (the embedded server)."""
    keep_bytes: int
    unsupported: bool = False
    """The server has no `--slot-save-path`: said once, then not tried again."""

    @staticmethod
    def filename(session_id: str) -> str:
        return f"{session_id}.bin"

    async def save(self, session_id: str) -> SlotFile | None:
        """Save the slot for session `session_id` (unless `[slots] save = "never"`)."""
        if self.save_when == "never" or self.unsupported:
            return None
        name = self.filename(session_id)
        try:
            saved = await self.action("save", name)
        except InferError as e:
            self._failed("save", e)
            return None
        log.info(
            "saved the slot of session %s: %d tokens, %d bytes",
            session_id,
            saved.tokens,
            saved.bytes,
        )
        self._evict(keep=name)
        return saved

    async def restore(self, session: Session) -> SlotFile | None:
        """Load the slot saved for `session`, if there is one; None when none was loaded."""
        name = self.filename(session.id)
        if self.save_when == "never" or self.unsupported:
            return None
        if self.directory and not (self.directory / name).is_file():
            return None  # nothing saved: a new session, or one never saved
        try:
            restored = await self.action("restore", name)
        except InferError as e:
            self._failed("restore", e)
            return None
        usage = session.last_usage()
        held = slot_tokens(usage.timings) if usage and usage.timings else None
        if held is not None and restored.tokens != held:
            log.warning(
                "the slot file of session %s holds %d tokens where the session's slot held %d: "
                "it is stale or not this session's; what does not match is computed again",
                session.id,
                restored.tokens,
                held,
            )
        else:
            log.info("restored the slot of session %s: %d tokens", session.id, restored.tokens)
        return restored

    def _failed(self, action: str, error: InferError) -> None:
        if isinstance(error, HttpError) and error.status == NOT_SUPPORTED:
            self.unsupported = True
            log.info("llama-server keeps no slot files (no --slot-save-path): %s", error)
        elif action == "restore" and isinstance(error, HttpError) and self.directory is None:
            log.info("no slot file to restore on llama-server: %s", error)  # an external server
        else:
            log.warning("could not %s the slot: %s", action, error)

    def _evict(self, keep: str) -> None:
        """Oldest files first, until those left fit `keep_bytes` (the one just saved stays)."""
        if self.directory is None:
            return
        files = sorted(self.directory.glob("*.bin"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.keep_bytes:
                break
            if path.name != keep:
                total -= path.stat().st_size
                path.unlink(missing_ok=True)
                log.info("removed the slot file %s ([slots] keep_bytes)", path.name)
