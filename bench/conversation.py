"""The scripted conversation both loopd and the peer hold for the cache figure."""

TURNS = [
    "Name a colour.",
    "Name a fruit of that colour.",
    "Name an animal.",
    "Where does it live?",
    "Name a city.",
    "Name a river there.",
    "Name a book.",
    "Who wrote it?",
]
RESTART_AFTER = 4
"""The turn after which loopd is restarted and the peer's history saved and loaded."""
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
MAX_TOKENS = 32
