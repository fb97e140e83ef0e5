"""A small MCP stdio server for the adapter's test (run as a subprocess)."""

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("dora-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with a reason the model may read."""
    raise ToolError(reason)


if __name__ == "__main__":
    server.run("stdio")
