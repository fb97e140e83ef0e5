"""Tools: typed Python functions the model may call, and the calls found in its text.

A tool's OpenAI function-calling schema comes from its signature (types, via pydantic) and
its docstring (the description, and each argument's line under ``Args:``). The model calls a
tool in the Hermes / Qwen format every open chat template knows::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>

Arguments are validated against the schema with ``jsonschema`` before the function runs. What
the model gets wrong never raises: an unparseable call, an unknown tool, invalid arguments, a
tool that fails or times out each become an error message for the model; a call cut off by
the length limit is never executed. A synchronous tool runs in a worker thread; one that
times out keeps its thread until it returns (a thread cannot be killed), so long or untrusted
work belongs in an async tool or in the sandbox (``dora.envs.sandbox``), which is a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import jsonschema
from pydantic import create_model

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_ARG_LINE = re.compile(r"^\s*(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)$")
MAX_ERRORS_SHOWN = 3


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    head, _, args = doc.partition("Args:")
    described: dict[str, str] = {}
    for line in args.splitlines():
        if line and not line.startswith((" ", "\t")) and line.rstrip().endswith(":"):
            break  # the next section (Returns:, Raises:)
        match = _ARG_LINE.match(line)
        if match:
            described[match.group(1)] = match.group(2).strip()
    return " ".join(head.split()), described


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def parameters_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s keyword arguments (every one must be annotated)."""
    _, described = _doc_parts(fn)
    hints = get_type_hints(fn, include_extras=True)  # resolves string annotations
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.name not in hints:
            raise TypeError(f"tool {fn.__name__}: argument {param.name!r} has no type annotation")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints[param.name], default)
    schema = _strip_titles(create_model(f"{fn.__name__}_args", **fields).model_json_schema())
    for name, text in described.items():
        if name in schema.get("properties", {}):
            schema["properties"][name]["description"] = text
    schema["additionalProperties"] = False
    return schema


@dataclass(frozen=True)
class Tool:
    """A callable the model may use; build one with ``Tool.from_function`` or ``@tool``."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    timeout_s: float = 10.0

    @classmethod
    def from_function(
        cls, fn: Callable[..., Any], *, name: str | None = None, timeout_s: float = 10.0
    ) -> Tool:
        description, _ = _doc_parts(fn)
        return cls(name or fn.__name__, description, parameters_schema(fn), fn, timeout_s)

    def spec(self) -> dict[str, Any]:
        """The OpenAI function-calling entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, timeout_s: float = 10.0
) -> Any:
    """Decorator: ``@tool`` or ``@tool(timeout_s=2)`` turns a typed function into a ``Tool``."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name, timeout_s=timeout_s)
    return Tool.from_function(fn, name=name, timeout_s=timeout_s)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """The complete, well-formed calls of a turn, and what was wrong with the others."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str, truncated: bool = False, turn: int = 0) -> ParsedTurn:
    """The tool calls in an assistant turn. An opening tag with no closing one is never run:
    the turn was cut off by the length limit (``truncated``) or the model forgot to close it."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {i + 1} is not valid JSON ({exc.msg}); not executed")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            errors.append(f'tool call {i + 1} needs {{"name": ..., "arguments": {{...}}}}')
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            errors.append(f"tool call {i + 1}: arguments must be a JSON object; not executed")
            continue
        calls.append(ToolCall(f"call_{turn}_{i}", payload["name"], arguments))
    tail = _BLOCK.sub("", text)
    if CALL_OPEN in tail:
        why = "cut off by the length limit" if truncated else "never closed"
        errors.append(f"a tool call was {why}; it was not executed")
    return ParsedTurn(calls, errors)


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    content: str
    ok: bool
    seconds: float


class ToolSet:
    """The tools of one environment, by name; ``await run(call)`` never raises."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self.tools = {t.name: t for t in tools}
        self._validators = {
            name: jsonschema.Draft202012Validator(t.parameters) for name, t in self.tools.items()
        }

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    async def run(self, call: ToolCall) -> ToolResult:
        started = time.monotonic()
        content, ok = await self._run(call)
        return ToolResult(call, content, ok, time.monotonic() - started)

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        tool_ = self.tools.get(call.name)
        if tool_ is None:
            return f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", False
        problems = sorted(self._validators[call.name].iter_errors(call.arguments), key=str)
        if problems:
            shown = "; ".join(
                f"{'/'.join(map(str, p.absolute_path)) or 'arguments'}: {p.message}"
                for p in problems[:MAX_ERRORS_SHOWN]
            )
            return f"error: invalid arguments for {call.name}: {shown}", False
        try:
            if inspect.iscoroutinefunction(tool_.fn):
                work = tool_.fn(**call.arguments)
            else:
                work = asyncio.to_thread(tool_.fn, **call.arguments)
            result = await asyncio.wait_for(work, timeout=tool_.timeout_s)
        except TimeoutError:
            return f"error: {call.name} timed out after {tool_.timeout_s:g} s", False
        except Exception as exc:  # the tool's failure is an observation, not a crash
            return f"error: {call.name} failed: {type(exc).__name__}: {exc}", False
        if isinstance(result, str):
            return result, True
        return json.dumps(result, default=str), True
