"""Exception groups from nested nurseries, seen the way a user should see them."""

from __future__ import annotations

__all__ = ["innermost"]


def innermost(error: BaseException) -> BaseException:
    """The one error inside nested single-error exception groups; a real group as it is."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
