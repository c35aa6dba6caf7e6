"""A small MCP server over stdio for the tests, written with the official SDK.

It writes its pid to the file named by $NOTES_PID_FILE so a test can kill it.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("notes")
NOTES = {"groceries": "eggs, milk, bread", "todo": "write the tests"}


@app.tool()
def read_note(title: str) -> str:
    """Read one of the user's notes by its title."""
    if title not in NOTES:
        msg = f"no note called {title!r}"
        raise ToolError(msg)
    return NOTES[title]


@app.tool()
def list_notes() -> str:
    """List the titles of the user's notes."""
    return "\n".join(sorted(NOTES))


@app.tool()
async def wait(seconds: float) -> str:
    """Wait, then answer (for deadline tests)."""
    await anyio.sleep(seconds)
    return "done waiting"


if __name__ == "__main__":
    if pid_file := os.environ.get("NOTES_PID_FILE"):
        Path(pid_file).write_text(str(os.getpid()))
    app.run()
