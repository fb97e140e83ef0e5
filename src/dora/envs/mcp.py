"""Tools served by an MCP server (``pip install dora-rl[mcp]``), as dora ``Tool``s.

``async with MCPTools(["python", "server.py"]) as tools`` starts the server as a subprocess and
talks over its stdin/stdout; a URL connects to a running server (Streamable HTTP). Each of the
server's tools becomes a ``Tool`` with the server's own input schema, so its arguments are
validated before the call, and a result the server marks as an error comes back to the model
as an ``error: ...`` message, like any failing tool.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

from dora.envs.tools import Tool, ToolSet


def _client(server: str | list[str]) -> Any:
    try:
        from mcp import Client, StdioServerParameters
    except ImportError as exc:  # the extra is optional
        raise ImportError("MCP tools need the mcp extra: pip install 'dora-rl[mcp]'") from exc
    if isinstance(server, str):
        return Client(server)
    command, *args = server
    return Client(StdioServerParameters(command=command, args=args))


def _text(result: Any) -> str:
    parts = [getattr(block, "text", None) or str(block) for block in result.content]
    return "\n".join(parts)


class MCPTools:
    """The tools of one MCP server for as long as the ``async with`` block lasts."""

    def __init__(self, server: str | list[str], timeout_s: float = 30.0) -> None:
        """``server``: a URL, or the command line that starts a stdio server."""
        self.server = server
        self.timeout_s = timeout_s
        self.tools: list[Tool] = []
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> MCPTools:
        client = await self._stack.enter_async_context(_client(self.server))
        listing = await client.list_tools()
        self.tools = [self._tool(client, t) for t in listing.tools]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def toolset(self) -> ToolSet:
        return ToolSet(self.tools)

    def _tool(self, client: Any, spec: Any) -> Tool:
        name = spec.name

        async def call(**arguments: Any) -> str:
            result = await client.call_tool(name, arguments)
            if result.is_error:
                raise RuntimeError(_text(result))
            return _text(result)

        return Tool(name, spec.description or "", dict(spec.input_schema), call, self.timeout_s)
