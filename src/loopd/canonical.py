"""The one JSON serialisation loopd uses for anything compared byte for byte."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["canonical"]


def canonical(value: Any) -> bytes:
    """Compact, key order kept, UTF-8 as is: the same value always gives the same bytes."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
