"""An answer caught in a loop is told from text that only looks alike."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopd.infer._repeat import MAX_PERIOD, Repetition, period_of

CAP = 1000
piece = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=MAX_PERIOD)


def minimal_period(s: str) -> int:
    return next(p for p in range(1, len(s) + 1) if all(s[i] == s[i - p] for i in range(p, len(s))))


@given(intro=st.text(max_size=50), loop=piece)
def test_a_piece_said_over_and_over_is_caught_with_its_period(intro: str, loop: str) -> None:
    text = intro + loop * (2 * CAP // len(loop) + 2)
    period = period_of(text, CAP)
    assert period is not None
    assert period == minimal_period(text[-CAP:])
    assert len(loop) % period == 0 or period <= len(loop)


# Generating hundreds of unique characters is slow on a loaded machine; the test is of the
# detector, not of how fast its inputs come.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    intro=st.text(max_size=50),
    codes=st.lists(st.integers(0x4E00, 0x9FFF), min_size=CAP, max_size=CAP + 100, unique=True),
)
def test_text_without_a_loop_is_left_alone(intro: str, codes: list[int]) -> None:
    assert period_of(intro + "".join(map(chr, codes)), CAP) is None  # no character twice


def test_lists_and_tables_that_repeat_a_shape_are_not_loops() -> None:
    rows = "".join(f"| {n} | item {n} | {n * 7} |\n" for n in range(200))
    steps = "".join(f"{n}. Stir the soup again.\n" for n in range(1, 200))
    for text in (rows, steps):
        assert period_of(text, CAP) is None


def test_a_loop_shorter_than_the_cap_or_with_a_period_too_long_is_left_alone() -> None:
    assert period_of("hello, " * 100, CAP) is None  # 700 characters: what was asked, maybe
    paragraph = "".join(chr(0x4E00 + n) for n in range(MAX_PERIOD + 1))
    assert period_of(paragraph * 5, 2 * CAP + 200) is None


@given(loop=piece, sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20))
def test_a_stream_fed_in_pieces_is_caught_once_the_loop_fills_the_cap(
    loop: str, sizes: list[int]
) -> None:
    text = "Sure! " + loop * (3 * CAP // len(loop) + 2)
    watch, at, fed = Repetition(CAP), 0, 0
    while watch.period is None and at < len(text):
        size = sizes[fed % len(sizes)]
        watch.feed(text[at : at + size])
        at, fed = at + size, fed + 1
    assert watch.period is not None
    assert at - len("Sure! ") <= CAP + 32 + 50 + 2 * len(loop)  # within a check of the cap
