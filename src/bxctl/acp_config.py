"""A session's config options as ACP offers them (`configOptions`, `session/set_config_option`):
loopd's mode (category `mode`), whether its turns think (category `thought_level`), and, where
loopd serves several models (`[models.NAME]`), the one the session runs on (category `model`).

Both are select options, which every client shows; a boolean one would need the client to say
it can. loopd keeps and enforces them (a `mode` record in the session's log, decided by its tool
port): these are pure functions from its `mode` answer to ACP's options, and from an option the
editor sets to loopd's `set_mode`.
"""

from __future__ import annotations

from typing import get_args

from acp import schema

from loopd.session.records import Mode
from loopd.wire.proto import ModeChanged, ModeSet, SetMode

__all__ = [
    "MODE",
    "MODEL",
    "THOUGHT_LEVEL",
    "BadOption",
    "ConfigOption",
    "config_options",
    "set_mode_of",
]

MODE = "mode"
THOUGHT_LEVEL = "thought_level"
MODEL = "model"

_MODES = [
    schema.SessionConfigSelectOption(
        value="ask",
        name="Ask",
        description="Ask before every change: file writes, edits and commands wait for your "
        "approval (as loopd's tool policies say)",
    ),
    schema.SessionConfigSelectOption(
        value="accept_edits",
        name="Accept edits",
        description="Write and edit files without asking; commands still ask",
    ),
    schema.SessionConfigSelectOption(
        value="read_only",
        name="Read only",
        description="Read and search only: writes, edits and commands are refused",
    ),
]
_THINKING = [
    schema.SessionConfigSelectOption(
        value="on", name="On", description="The model reasons before it answers"
    ),
    schema.SessionConfigSelectOption(
        value="off", name="Off", description="The model answers without reasoning first"
    ),
]
_SWITCH = {"on": True, "off": False}

ConfigOption = schema.SessionConfigOptionSelect | schema.SessionConfigOptionBoolean
"""An option as ACP's answers list them (loopd's are all selects)."""


class BadOption(ValueError):
    """An option or a value loopd does not offer; the message says which it does."""


def config_options(state: ModeSet | ModeChanged) -> list[ConfigOption]:
    """The session's options, each with its current value (the model's where loopd serves
    several: with one, there is nothing to choose)."""
    options: list[ConfigOption] = [
        schema.SessionConfigOptionSelect(
            type="select",
            id=MODE,
            name="Mode",
            category="mode",
            description="What the agent may do without asking",
            current_value=state.mode,
            options=_MODES,
        ),
        schema.SessionConfigOptionSelect(
            type="select",
            id=THOUGHT_LEVEL,
            name="Thinking",
            category="thought_level",
            description="Whether the model reasons before it answers",
            current_value="on" if state.thinking else "off",
            options=_THINKING,
        ),
    ]
    if state.model is not None and state.models:
        choices = [schema.SessionConfigSelectOption(value=name, name=name) for name in state.models]
        model = schema.SessionConfigOptionSelect(
            type="select",
            id=MODEL,
            name="Model",
            category="model",
            description="The model the session's turns run on (loopd's [models.NAME])",
            current_value=state.model,
            options=choices,
        )
        options.append(model)
    return options


def set_mode_of(config_id: str, value: str) -> SetMode:
    """loopd's `set_mode` that sets option `config_id` to `value`; raises `BadOption`."""
    if config_id == MODE:
        modes = get_args(Mode)
        if value not in modes:
            raise BadOption(f"mode has no value {value!r}: it is one of {', '.join(modes)}")
        return SetMode.model_validate({"mode": value})
    if config_id == THOUGHT_LEVEL:
        if value not in _SWITCH:
            raise BadOption(f"thought_level has no value {value!r}: it is on or off")
        return SetMode(thinking=_SWITCH[value])
    if config_id == MODEL:  # loopd knows which it serves, and refuses another (unknown_model)
        return SetMode(model=value)
    raise BadOption(
        f"no config option {config_id!r}: loopd offers {MODE}, {THOUGHT_LEVEL} and, where it "
        f"serves several models, {MODEL}"
    )
