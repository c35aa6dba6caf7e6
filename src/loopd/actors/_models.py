"""The models loopd serves, where it serves several (`[models.NAME]`), each on servers of its
own: which model a session runs on, which servers are whose, and each model's token-exact
history (its own template: what one model learned of its template never serves another).

A session runs on the model its log names (its last `mode` record's `model`), else the
default. Nothing here awaits: it is read by the session actor and its turns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from loopd.session.store import Session
from loopd.turn.exact import ExactHistory

from ._errors import UnknownModel

__all__ = ["Models"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Models:
    names: tuple[str, ...] = ()
    """Every model by its `[models.NAME]`; none: loopd serves one unnamed model."""
    default: str | None = None
    """The model of a session whose log names none."""
    servers: Mapping[str, str] = field(default_factory=dict)
    """Each server's model, by its URL."""
    exact: Mapping[str, ExactHistory] = field(default_factory=dict)
    """Each model's token-exact history (`[session] history = "exact"`)."""

    def of(self, session: Session) -> str | None:
        """The model `session` runs on: its own, while loopd still serves it."""
        if session.model is not None and session.model not in self.names:
            log.warning(
                "session %s ran on model %s, which the config no longer names: it runs on %s",
                session.id,
                session.model,
                self.default,
            )
            return self.default
        return session.model or self.default

    def checked(self, name: str) -> str:
        """`name`, where it is a model loopd serves; else `UnknownModel`, naming them."""
        if name not in self.names:
            served = ", ".join(self.names)
            raise UnknownModel(
                f"no model {name!r}: loopd serves {served}"
                if served
                else f"no model {name!r}: loopd serves one model (configure [models.NAME] "
                "tables to choose between several)"
            )
        return name
