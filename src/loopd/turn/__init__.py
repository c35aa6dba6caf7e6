"""A turn and its parts: the loop (`loop`: a message in, an answer out, a limit on every
runaway), the tool calls of one answer (`calls`), the files it changes (`changes`), the
token-exact prompt (`exact`), and the wait for a server that cannot take a request yet
(`waiting`)."""

from loopd.turn.loop import (
    Inference,
    InferFailed,
    Runtime,
    SessionFull,
    TurnError,
    TurnLimit,
    TurnOutcome,
    run_turn,
)

__all__ = [
    "InferFailed",
    "Inference",
    "Runtime",
    "SessionFull",
    "TurnError",
    "TurnLimit",
    "TurnOutcome",
    "run_turn",
]
