"""Tools: the registry behind `find_tool` and `call_tool`, the port that runs calls under
their policy and deadline, the built-in tools, and MCP servers as tool sources.

This face only names what the modules hold: the shared types in `_types`, the port's actor
in `_port`, the port as loopd runs it (`open_tool_port`) in `_open`."""

from ._builtin import (
    DELEGATE,
    PLAN,
    WRITE_TOOLS,
    Builtins,
    builtin_entries,
    checked_plan,
    delegate_entry,
)
from ._call import CallOrigin, ModelAnswer, answer_call
from ._dispatch import (
    MAX_ARGUMENT_BYTES,
    Local,
    Port,
    call_key,
    dispatch,
    find_tool_text,
    requested_tool,
)
from ._given import given_tools
from ._mcp_connect import missing_tokens, reached_at, token_missing
from ._open import open_tool_port
from ._port import PortHandle, read_only_refusal, run_tool_port
from ._registry import BUILTIN, Registry, policy_for
from ._roots import FolderRefused, Roots
from ._run import Sandbox, process_bound, sandbox_missing
from ._sandbox import secrets
from ._skills import SkillReader
from ._types import (
    Answered,
    Approval,
    Asking,
    Denied,
    Executor,
    Failed,
    OnAsking,
    OnDecided,
    PortStopped,
    Result,
    Runner,
    ToolEntry,
    ToolFailure,
    ToolOutput,
    ToolPort,
    ToolRequest,
)
from ._write import (
    NEW_FILE,
    commit,
    digest,
    folder_of,
    plan,
    replace_in,
    write_atomically,
)

__all__ = [
    "BUILTIN",
    "DELEGATE",
    "MAX_ARGUMENT_BYTES",
    "NEW_FILE",
    "PLAN",
    "WRITE_TOOLS",
    "Answered",
    "Approval",
    "Asking",
    "Builtins",
    "CallOrigin",
    "Denied",
    "Executor",
    "Failed",
    "FolderRefused",
    "Local",
    "ModelAnswer",
    "OnAsking",
    "OnDecided",
    "Port",
    "PortHandle",
    "PortStopped",
    "Registry",
    "Result",
    "Roots",
    "Runner",
    "Sandbox",
    "SkillReader",
    "ToolEntry",
    "ToolFailure",
    "ToolOutput",
    "ToolPort",
    "ToolRequest",
    "answer_call",
    "builtin_entries",
    "call_key",
    "checked_plan",
    "commit",
    "delegate_entry",
    "digest",
    "dispatch",
    "find_tool_text",
    "folder_of",
    "given_tools",
    "missing_tokens",
    "open_tool_port",
    "plan",
    "policy_for",
    "process_bound",
    "reached_at",
    "read_only_refusal",
    "replace_in",
    "requested_tool",
    "run_tool_port",
    "sandbox_missing",
    "secrets",
    "token_missing",
    "write_atomically",
]
