"""An MCP stdio server's tools used through dora's tool set (the optional ``mcp`` extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dora.envs.tools import ToolCall

pytest.importorskip("mcp", reason="the optional mcp extra is not installed")

from dora.envs.mcp import MCPTools

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]


async def test_an_mcp_servers_tools_are_called_and_checked_like_any_tool() -> None:
    async with MCPTools(SERVER) as mcp:
        tools = mcp.toolset()
        assert set(tools.tools) == {"add", "fail"}
        assert tools.tools["add"].parameters["required"] == ["a", "b"]
        ok = await tools.run(ToolCall("c1", "add", {"a": 2, "b": 40}))
        assert ok.ok and ok.content == "42"
        bad = await tools.run(ToolCall("c2", "add", {"a": "two", "b": 40}))
        assert not bad.ok and "is not of type 'integer'" in bad.content  # never reached the server
        failed = await tools.run(ToolCall("c3", "fail", {"reason": "no stock"}))
        assert not failed.ok and "no stock" in failed.content
