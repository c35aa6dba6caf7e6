"""An MCP server over stdio (the official SDK's low-level server) whose one tool, `t`, has the
input schema given as JSON in $TOOL_SCHEMA, whatever it is, and answers every call with
"ran t". The tests feed it generated schemas."""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

SCHEMA: dict[str, Any] = json.loads(os.environ.get("TOOL_SCHEMA", "{}"))


async def list_tools(_: Any, __: Any) -> types.ListToolsResult:
    tool = types.Tool.model_construct(name="t", description="A tool.", input_schema=SCHEMA)
    return types.ListToolsResult(tools=[tool])


async def call_tool(_: Any, __: Any) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text="ran t")])


async def main() -> None:
    server = Server("schemas", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
