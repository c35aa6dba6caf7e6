"""The one JSON serialisation loopd uses for anything compared byte for byte, and the one hash
of a content kept in records."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["canonical", "digest"]


def canonical(value: Any) -> bytes:
    """Compact, key order kept, UTF-8 as is: the same value always gives the same bytes."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def digest(data: bytes) -> str:
    """A content's SHA-256 in hex, as records and approvals name it."""
    return hashlib.sha256(data).hexdigest()
