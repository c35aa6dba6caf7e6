"""Forks and rewinds keep the property loopd exists for: every request a session makes extends
its previous one, and a fork's first request extends its parent's request at the turn it was
made at.

hypothesis writes sequences of steps: a turn of any session (its answer may write a file first),
a fork of any session at any of its turns, a rewind of any session to any of its turns (a fork
of the session itself; with its files, the later turns' writes are put back first), and
restarts of the whole core (every session reopened from its log). They are played through the
actors (registry, session actors, slot pool of two slots) against the scripted llama-server
over real HTTP, with real files in a folder under `[tools] roots`, with history token-exact
(the default; `support.fake_exact`) and as messages (`support.fake_llama`). Real: the actors,
the store's logs, the files, HTTP; scripted: the model's answers.

Afterwards, every session's requests, its ancestors' up to where it was forked included, each
extend the one before: token for token, the prompt and the answer before it and the template's
text for what came since (`support.fake_exact.check`), or message for message; every log
replays (`loopd replay`) and holds the messages sent in it (as messages); a rewind with files
put back exactly what a model of the changes says, or was refused, changing nothing, where a
file changed since (by another session's turn).
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from loopd.actors import CannotFork, CannotUndo, SessionHandle, open_core
from loopd.canonical import canonical
from loopd.cli import main
from loopd.config import Config
from loopd.infer import Client
from loopd.session.baseline import messages
from loopd.session.records import UserRecord, conversation_problems
from loopd.session.store import Store
from support import fake_exact
from support.fake_exact import ExactLlama, Sent
from support.fake_llama import FakeLlama, Reply
from support.replay import Exchange, ReplayServer
from test_hands import write
from test_property_sessions import turn

FILES = ("a.md", "b.md")


@dataclass(frozen=True)
class Turn:
    who: int
    """The session (modulo how many there are)."""
    write: str | None
    """The file its answer writes first, if any."""


@dataclass(frozen=True)
class Fork:
    who: int
    at: int
    """The turn (modulo the session's turns, from 1)."""
    rewind: bool
    """The session rewinds to there (goes on in a fork of itself), else another forks it."""
    files: bool
    """A rewind's files too: what the later turns wrote is put back first."""


@dataclass(frozen=True)
class Restart:
    pass


Step = Turn | Fork | Restart
turns = st.builds(Turn, st.integers(0, 5), st.sampled_from([None, *FILES]))
steps = st.one_of(
    turns,
    turns,  # as many turns as the rest: forks and rewinds want turns to go back over
    st.builds(Fork, st.integers(0, 5), st.integers(0, 9), st.booleans(), st.booleans()),
    st.just(Restart()),
)


@dataclass(frozen=True)
class Change:
    turn: int
    """The session's turn that wrote it."""
    name: str
    before: bytes | None
    after: bytes
    undone_at: int | None = None
    """The session's turns when a rewind put it back: its record follows that turn's end."""


@dataclass
class Model:
    """What a session is: its messages (its ancestors' up to the fork included) and the file
    changes its log holds."""

    id: str
    said: list[str]
    changes: list[Change] = field(default_factory=list)
    parent: tuple[str, int] | None = None

    def forked(self, id_: str, at: int) -> Model:
        # A fork's log holds its parent's records up to that turn's end: a rewind's record
        # written after a later turn's end is not among them.
        kept = [
            c if c.undone_at is not None and c.undone_at < at else replace(c, undone_at=None)
            for c in self.changes
            if c.turn <= at
        ]
        return Model(id_, self.said[:at], kept, (self.id, at))


MARK = " (write "
History = Literal["exact", "template"]


def reply(role: str, content: str, call_id: str) -> Reply:
    """A write of the file a user message names, else (after its result) a plain answer."""
    if role == "user" and MARK in content:
        name = content.split(MARK)[1].rstrip(")")
        return write(name, content + "\n", call_id)
    return Reply(content="ok")


def answer(request: dict[str, Any]) -> Exchange:
    last = request["messages"][-1]
    return FakeLlama([reply(last["role"], last["content"], f"c{len(request['messages'])}")])(
        request
    )


def last_message(prompt: str) -> tuple[str, str]:
    """The role and content of a token-exact prompt's last message, before the generation
    prompt."""
    role, _, content = prompt.split("<|im_start|>")[-2].partition("\n")
    return role, content.removesuffix("<|im_end|>\n")


def answers(fake: ExactLlama) -> Any:
    def respond(request: dict[str, Any]) -> Exchange:
        role, content = last_message(
            fake_exact.detokenize(fake_exact.prompt_ids(request["prompt"]))
        )
        fake.replies = [reply(role, content, "c1")]
        return fake(request)

    return respond


def last_user(prompt: str) -> str:
    """The content of a token-exact prompt's last user message."""
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def config(directory: Path, history: History) -> Config:
    return Config.model_validate(
        {
            "session": {"history": history},
            "slots": {"save": "never"},  # the scripted server keeps no slot files
            "store": {"directory": str(directory / "sessions")},
            "tools": {
                "roots": [str(directory / "notes")],
                "policies": {"write_file": {"action": "allow"}},
            },
        }
    )


def content(notes: Path, name: str) -> bytes | None:
    path = notes / name
    return path.read_bytes() if path.exists() else None


def folder(notes: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(notes.iterdir())}


@dataclass
class Play:
    directory: Path
    sessions: list[Model] = field(default_factory=list)
    n: int = 0

    @property
    def notes(self) -> Path:
        return self.directory / "notes"

    async def step(self, core: Any, step: Turn | Fork) -> None:
        self.n += 1
        s = self.sessions[step.who % len(self.sessions)]
        handle, _ = await core.sessions.attach(s.id)
        if isinstance(step, Turn):
            await self.turn(handle, s, step.write)
            return
        if not s.said:
            try:
                await core.sessions.fork(s.id, 1)
            except CannotFork:
                event("a fork refused: no turn yet")
                return
            raise AssertionError("a session without a turn was forked")
        at = step.at % len(s.said) + 1
        if step.rewind and step.files and not await self.put_back(handle, s, at):
            return
        _, forked = await core.sessions.fork(s.id, at)
        self.sessions.append(s.forked(forked, at))
        event("a rewind" if step.rewind else "a fork")

    async def turn(self, handle: SessionHandle, s: Model, name: str | None) -> None:
        text = f"turn {self.n} of {s.id}" + (f"{MARK}{name})" if name else "")
        before = content(self.notes, name) if name else None
        events = await handle.subscribe(100)
        await turn(handle, events, f"t{self.n}", text)
        s.said.append(text)
        if name:
            after = (text + "\n").encode()
            assert content(self.notes, name) == after
            s.changes.append(Change(len(s.said), name, before, after))

    async def put_back(self, handle: SessionHandle, s: Model, at: int) -> bool:
        """Rewind `s`'s files to turn `at`'s end, as the model says it must go: whether the
        rewind goes on."""
        later = [c for c in s.changes if c.turn > at and c.undone_at is None]
        plan: dict[str, tuple[bytes | None, bytes]] = {}
        for c in later:  # the first change's `before`, the last one's `after`
            plan[c.name] = (plan[c.name][0] if c.name in plan else c.before, c.after)
        now = folder(self.notes)
        if any(now.get(name) != after for name, (_, after) in plan.items()):
            try:
                await handle.rewind_files(at)
            except CannotUndo:
                assert folder(self.notes) == now  # nothing was put back
                event("a rewind with files refused: a file changed since")
                return False
            raise AssertionError("a rewind put back a file that changed since")
        record = await handle.rewind_files(at)
        if not plan:
            assert record is None
            event("a rewind with files: none to put back")
            return True
        assert record is not None
        assert list(record.paths) == sorted(str(self.notes / name) for name in plan)
        for name, (before, _) in plan.items():
            assert content(self.notes, name) == before
        s.changes = [replace(c, undone_at=len(s.said)) if c in later else c for c in s.changes]
        event("a rewind with files put back")
        return True


async def play(plan: list[Step], directory: Path, history: History) -> Play:
    fake = ExactLlama([], slots=2)
    respond = answers(fake) if history == "exact" else answer
    server = ReplayServer([respond] * 100, slots=2, side=fake.side() if history == "exact" else {})
    store = Store(directory / "sessions")
    game = Play(directory)
    game.notes.mkdir()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with Client(server.url) as client:
            rest = list(plan)
            while True:
                async with open_core(config(directory, history), store, [client]) as core:
                    if not game.sessions:
                        _, first = await core.sessions.attach("new", str(game.notes))
                        game.sessions.append(Model(first, []))
                    while rest and not isinstance(step := rest.pop(0), Restart):
                        await game.step(core, step)
                if not rest:
                    break
        nursery.cancel_scope.cancel()
    if history == "exact":
        assert fake.chat == 0  # not one request went as messages
        _check_exact(fake.sent, store, game)
    _check(server.requests if history == "template" else [], store, game, directory)
    return game


def _check_exact(sent: list[Sent], store: Store, game: Play) -> None:
    by_message: dict[str, list[Sent]] = {}  # a turn's requests, by the message it answers
    for request in sent:
        by_message.setdefault(last_user(request.text), []).append(request)
    for s in game.sessions:
        # Its own requests after its ancestors' up to the fork, against its log.
        chain = [request for text in s.said for request in by_message[text]]
        header, records, _ = store.read(s.id)
        fake_exact.check(chain, header.baseline, records)


def _check(requests: list[dict[str, Any]], store: Store, game: Play, directory: Path) -> None:
    """The logs; and where history went as messages (`requests`), each of a session's extends
    the one before."""
    by_message: dict[str, list[list[Any]]] = {}  # a turn's requests, by the message it answers
    for request in requests:
        sent = request["body"]["messages"]
        last = next(m["content"] for m in reversed(sent) if m["role"] == "user")
        by_message.setdefault(last, []).append(sent)
    toml = directory / "loopd.toml"
    toml.write_text(f'[store]\ndirectory = "{directory / "sessions"}"\n')
    for s in game.sessions:
        # Its own requests after its ancestors' up to the fork: each extends the one before.
        chain = [sent for text in s.said for sent in by_message[text]] if requests else []
        for earlier, later in itertools.pairwise(chain):
            assert canonical(later[: len(earlier)]) == canonical(earlier)
        header, records, torn = store.read(s.id)
        assert (header.forked_from, header.at) == (s.parent or (None, None))
        assert [r.content for r in records if isinstance(r, UserRecord)] == s.said
        assert conversation_problems(list(records)) == []
        assert torn == 0
        if chain:  # the log replays to what was sent as messages, and the answer after it
            replayed = messages(header.baseline, records)
            assert canonical(replayed[: len(chain[-1])]) == canonical(chain[-1])
        assert main(["replay", s.id, "--config", str(toml)]) == 0


@settings(
    max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
@example(  # a rewind with files refused: its fork wrote the file since
    plan=[
        Turn(0, None),
        Turn(0, "a.md"),
        Fork(0, 0, False, False),
        Turn(1, "a.md"),
        Fork(0, 0, True, True),
    ]
)
@example(  # written, restarted, rewound with files, written again in the rewind, forked there
    plan=[
        Turn(0, "a.md"),
        Turn(0, "b.md"),
        Restart(),
        Fork(0, 0, True, True),
        Turn(1, "b.md"),
        Fork(1, 1, False, True),
        Turn(2, None),
    ]
)
@given(
    plan=st.builds(
        list.__add__, st.lists(turns, max_size=3), st.lists(steps, min_size=1, max_size=10)
    )
)
@pytest.mark.parametrize("history", ["exact", "template"])
def test_forks_and_rewinds_keep_every_sessions_requests_extending_its_own(
    plan: list[Step], history: History
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        game = trio.run(play, plan, Path(tmp), history)
    event(f"sessions: {min(len(game.sessions), 4)}{'+' * (len(game.sessions) > 4)}")
