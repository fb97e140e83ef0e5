"""Agentic environments: multi-turn episodes with tools, one environment per episode.

Stable API::

    @tool                                   # schema from the signature and docstring
    def lookup(order_id: str) -> dict: ...
    env = ToolEnvironment(ToolSet([lookup, CALCULATOR]), score=my_score, max_turns=6)
    messages = await env.reset(prompt, seed)        # OpenAI-format ChatMessages
    result = await env.step(AssistantTurn(text))    # StepResult(messages, done, reward, ...)
    await env.close()

    GymTextEnvironment(make)                # a SkyRL-gym / rLLM style sync environment
    Guarded(env, step_timeout_s=60, episode_timeout_s=600)  # deadlines; errors end episodes
    make_environment("calculator", max_turns=4)
    await Sandbox().run_python(code)        # model-written code under bubblewrap
"""

from dora.envs.base import AssistantTurn, ChatMessage, Environment, StepResult
from dora.envs.calculator import CALCULATOR, calculator
from dora.envs.guard import EnvironmentFailed, Guarded
from dora.envs.gym import GymTextEnvironment
from dora.envs.registry import (
    EnvironmentConfig,
    environment_names,
    make_environment,
    register_environment,
)
from dora.envs.retail import RetailEnvConfig, RetailEnvironment, make_retail_environment
from dora.envs.tool_env import ToolEnvironment
from dora.envs.tools import (
    ParsedTurn,
    Tool,
    ToolCall,
    ToolResult,
    ToolSet,
    parameters_schema,
    parse_tool_calls,
    tool,
)


class CalculatorEnvConfig(EnvironmentConfig):
    """The calculator tool; the final answer is scored by ``exact_match``."""

    list_tools: bool = True
    """Put the tool's schema in a system message (a model warm-started on the calculator's
    calls does not need it: False keeps prompts short)."""


def _calculator_env(config: CalculatorEnvConfig) -> Environment:
    from dora.rewards import make_verifier

    verifier = make_verifier("exact_match")
    return ToolEnvironment(
        ToolSet([CALCULATOR]),
        score=lambda prompt, answer: verifier.verify(answer, prompt).reward,
        max_turns=config.max_turns,
        list_tools=config.list_tools,
    )


register_environment("calculator", CalculatorEnvConfig, _calculator_env)
register_environment("retail", RetailEnvConfig, make_retail_environment)

__all__ = [
    "CALCULATOR",
    "AssistantTurn",
    "ChatMessage",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentFailed",
    "Guarded",
    "GymTextEnvironment",
    "ParsedTurn",
    "RetailEnvironment",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "ToolSet",
    "calculator",
    "environment_names",
    "make_environment",
    "parameters_schema",
    "parse_tool_calls",
    "register_environment",
    "tool",
]
