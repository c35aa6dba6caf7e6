"""A small MCP server at a URL for the tests, written with the official SDK: one tool,
`shout`, served on 127.0.0.1 over streamable HTTP (at /mcp) or over SSE alone (at /sse), to
requests that carry `Authorization: Bearer $REMOTE_TOKEN`; any other is answered 401.

    python mcp_http_server.py http|sse PORT
"""

from __future__ import annotations

import os
import sys
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

server = MCPServer("remote")


@server.tool()
def shout(text: str) -> str:
    """Say the text louder."""
    return f"{text.upper()}!"


def guarded(app: Any, token: str) -> Any:
    """`app`, for requests with the token alone."""
    expected = f"Bearer {token}".encode()

    async def guard(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            start = {"type": "http.response.start", "status": 401, "headers": []}
            await send(start)
            await send({"type": "http.response.body", "body": b"a bearer token is wanted"})
            return
        await app(scope, receive, send)

    return guard


if __name__ == "__main__":
    transport, port = sys.argv[1], int(sys.argv[2])
    app = server.sse_app() if transport == "sse" else server.streamable_http_app()
    uvicorn.run(guarded(app, os.environ["REMOTE_TOKEN"]), host="127.0.0.1", port=port)
