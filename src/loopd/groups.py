"""Exception groups from nested nurseries, seen the way a user should see them."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["innermost", "leaf", "only_cancelled"]

E = TypeVar("E", bound=BaseException)


def innermost(error: BaseException) -> BaseException:
    """The one error inside nested single-error exception groups; a real group as it is."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def leaf(error: BaseException, kind: type[E]) -> E | None:
    """The first error of `kind` in `error` or anywhere in its groups; None if there is none."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (found := leaf(inner, kind)) is not None:
                return found
    return None


def only_cancelled(error: BaseException) -> bool:
    """`error` is a cancellation, raw or in groups (a nursery's) that hold nothing else."""
    import trio  # noqa: PLC0415 - here: bxctl's quick commands import this module, not trio

    if isinstance(error, BaseExceptionGroup):
        return error.split(trio.Cancelled)[1] is None
    return isinstance(error, trio.Cancelled)
