"""A session's records and what is made of them: the records (`records`), the append-only
store of their logs (`store`), the baseline a session starts from (`baseline`), the readable
transcript (`transcript`), the summary a compacted session continues from (`compact`), and a
turn's log closed, also after a crash (`closing`).

Nothing here runs a turn or an actor: `bxctl` reads logs through it as loopd writes them."""
