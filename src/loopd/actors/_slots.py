"""Slot files: a slot's KV cache saved per session, so a session that comes back (after its
slot went to another session, a restart of loopd, or a llama-server that died) costs only its
new tokens.

A file is an optimisation, never the truth: deleting one loses time, never data. llama-server
writes it in its `--slot-save-path`, named by the session (`<id>.bin`); loopd keeps a note of
each save beside its sessions (`slot-files/<id>.json`), since it cannot always see the
server's folder, and restores only a file it saved. A restore that fails empties the slot, so
loopd never tries one blindly. Which slot holds which session is the slot pool's business
(`loopd.actors`): it says when a cache must be saved (its slot goes to another session) and
when one must be restored (a session takes a slot that does not hold its cache).

With several models (`[models.NAME]`) a session may hold a cache on a server of each, so its
files are named by the model too (`<id>.<model>.bin`).

A file is trusted only as far as llama-server checks it: one of another model does not load
(the slot is left empty); one that is stale or another session's loads, and llama-server
reuses only the tokens it shares with the next prompt. Either way the next request's
`cache_loss` record says what was lost, and the restore's token count, compared with what the
session's slot held, is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loopd.infer import HttpError, InferError, Slot, SlotFile, slot_tokens
from loopd.session.store import Session

__all__ = ["SlotFiles"]

log = logging.getLogger(__name__)

# llama-server without --slot-save-path answers slot actions with this.
NOT_SUPPORTED = 501


@dataclass
class SlotFiles:
    save_when: str
    """`[slots] save`: `turn`, `stop` or `never` (no files at all)."""
    notes: Path
    """loopd's note of each save: `<id>.json`."""
    directory: Path | None
    """Where llama-server writes the files, when loopd can see it (the embedded server):
    there, loopd keeps them under `keep_bytes`."""
    keep_bytes: int
    unsupported: set[str] = field(default_factory=set)
    """Servers without `--slot-save-path`: said once each, then not tried again. Shared by the
    sessions' tasks, and right so: it only grows, and each read and add is whole between two
    awaits (trio runs one task at a time), so a task sees a server either in it or not; owning
    it in an actor would make every save ask first, for nothing."""
    models: Mapping[str, str] = field(default_factory=dict)
    """Each server's model, by its URL, where loopd serves several: in the files' names."""

    def _name(self, slot: Slot, session_id: str) -> str:
        """The file of `session_id`'s cache on `slot`'s server: one per model it ran on."""
        model = self.models.get(slot.client.base_url)
        return session_id if model is None else f"{session_id}.{model}"

    def enabled(self, slot: Slot) -> bool:
        return (
            self.save_when != "never"
            and slot.client.engine.slot_files
            and slot.client.base_url not in self.unsupported
        )

    def server_of(self, session_id: str) -> str | None:
        """The server that saved the file of `session_id`, if loopd saved one."""
        try:
            note = json.loads((self.notes / f"{session_id}.json").read_text())
        except (OSError, ValueError):
            return None
        server = note.get("server") if isinstance(note, dict) else None
        return server if isinstance(server, str) else None

    async def save(self, slot: Slot, session_id: str) -> SlotFile | None:
        """Save `slot`, which holds the cache of session `session_id`."""
        if not self.enabled(slot):
            return None
        name = self._name(slot, session_id)
        try:
            saved = await slot.slot_file("save", f"{name}.bin")
        except InferError as e:
            self._failed(slot, "save", e)
            return None
        self._note(name, saved, slot.client.base_url)
        log.info("saved the slot of session %s: %d tokens", session_id, saved.tokens)
        self._evict(keep=name)
        return saved

    async def restore(
        self, slot: Slot, session: Session, source: str | None = None
    ) -> SlotFile | None:
        """Load into `slot` the cache saved for `session`, if one was, else (for a fork) that
        of `source`, whose cache its next request extends; None when nothing was loaded."""
        of = session.id
        if source is not None and not self._saved(self._name(slot, of)):
            of = source
        if not self.enabled(slot) or not self._saved(self._name(slot, of)):
            return None
        try:
            restored = await slot.slot_file("restore", f"{self._name(slot, of)}.bin")
        except InferError as e:
            self._failed(slot, "restore", e)
            return None
        usage = session.last_usage()
        held = slot_tokens(usage.timings) if usage and usage.timings else None
        if of != session.id and held is not None and restored.tokens >= held:
            log.info(
                "restored the slot of session %s for its fork %s: %d tokens, %d of them the fork's",
                of,
                session.id,
                restored.tokens,
                held,
            )
        elif held is not None and restored.tokens != held:
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

    def missing(self, slot: Slot, session_id: str) -> str:
        """Why the cache of `session_id` could not be restored into `slot`."""
        server = slot.client.base_url
        if self.save_when == "never":
            return 'loopd keeps no slot files ([slots] save = "never")'
        if server in self.unsupported:
            return f"llama-server at {server} keeps no slot files (no --slot-save-path)"
        if not self._saved(self._name(slot, session_id)):
            return f"the slot file of session {session_id} is gone (or was never saved)"
        return f"the slot file of session {session_id} could not be restored (loopd's log says why)"

    def _saved(self, session_id: str) -> bool:
        return (self.notes / f"{session_id}.json").is_file()

    def _note(self, session_id: str, saved: SlotFile, server: str) -> None:
        self.notes.mkdir(parents=True, exist_ok=True)
        staging = self.notes / f".{session_id}.json"
        note = {"tokens": saved.tokens, "bytes": saved.bytes, "server": server}
        staging.write_text(json.dumps(note))
        staging.replace(self.notes / f"{session_id}.json")

    def _failed(self, slot: Slot, action: str, error: InferError) -> None:
        server = slot.client.base_url
        if isinstance(error, HttpError) and error.status == NOT_SUPPORTED:
            self.unsupported.add(server)
            log.info(
                "llama-server at %s keeps no slot files (no --slot-save-path): %s", server, error
            )
        else:
            log.warning("could not %s slot %d of %s: %s", action, slot.number, server, error)

    def _evict(self, keep: str) -> None:
        """Oldest files first, until those left fit `keep_bytes` (the one just saved stays)."""
        if self.directory is None:
            return
        files = sorted(self.directory.glob("*.bin"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.keep_bytes:
                break
            if path.stem != keep:
                total -= path.stat().st_size
                path.unlink(missing_ok=True)
                (self.notes / f"{path.stem}.json").unlink(missing_ok=True)
                log.info("removed the slot file %s ([slots] keep_bytes)", path.name)
