"""`find_tool`: BM25 over the words of each tool's name and descriptions.

Names weigh double, since a query naming the action ("read", "search") usually names the tool.
Words are lowercased, split at non-letters and camelCase, and lightly stemmed so that "reading
files" meets `read_file`. Ties are broken by name, so the same query over the same registry
always gives the same text.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from ._types import ToolEntry

__all__ = ["SearchIndex", "tokens"]

# BM25's usual constants: term-frequency saturation and length normalisation.
K1 = 1.2
B = 0.75
NAME_WEIGHT = 2

# Words that say nothing about which tool is meant.
_STOP_WORDS = (
    "a an and are as at be by can do for from i in is it its me my of on or please that the "
    "this to use want what which with you your"
)
_STOP = frozenset(_STOP_WORDS.split())
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def _stem(word: str) -> str:
    for suffix in ("ing", "ies", "es", "ed", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def tokens(text: str) -> list[str]:
    words = (w.lower() for w in _WORD.findall(text))
    return [_stem(w) for w in words if w not in _STOP]


class SearchIndex:
    def __init__(self, entries: list[ToolEntry]) -> None:
        self.entries = entries
        self._docs = [
            Counter(tokens(e.name) * NAME_WEIGHT + tokens(e.summary) + tokens(e.description))
            for e in entries
        ]
        self._lengths = [sum(d.values()) for d in self._docs]
        self._average = (sum(self._lengths) / len(self._lengths)) if self._lengths else 0.0
        frequency: Counter[str] = Counter()
        for doc in self._docs:
            frequency.update(doc.keys())
        n = len(entries)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}

    def search(self, query: str, limit: int) -> list[ToolEntry]:
        terms = tokens(query)
        scored = []
        for entry, doc, length in zip(self.entries, self._docs, self._lengths, strict=True):
            score = 0.0
            for term in terms:
                tf = doc.get(term, 0)
                if tf:
                    norm = K1 * (1 - B + B * length / self._average)
                    score += self._idf[term] * tf * (K1 + 1) / (tf + norm)
            if score > 0:
                scored.append((score, entry))
        # Rounded, so that float noise never reorders equal scores: ties go by name.
        scored.sort(key=lambda pair: (-round(pair[0], 9), pair[1].name))
        return [entry for _, entry in scored[:limit]]
