"""Environments of multi-turn / tool-using episodes (issue 16): the :class:`Environment` interface (``reset`` /
``step`` -> :class:`EnvStep`), tools (:class:`Tool`, :func:`tool_schemas`, :func:`parse_tool_calls`,
:func:`tools_system_prompt`, :class:`ToolEnv`), the built-in :class:`CalculatorEnv` and :class:`GuessNumberEnv`, and
:func:`resolve_environment` (class / import path / LightningCLI dict / built-in name -> a factory of fresh
environments). Rollouts layer: imports data and rewards; never Lightning."""

from lit_llm.rollouts.envs.base import Environment, EnvStep, prompt_messages, unimplemented_method
from lit_llm.rollouts.envs.calculator import CalculatorEnv, calculator, evaluate_expression
from lit_llm.rollouts.envs.guess_number import GuessNumberEnv
from lit_llm.rollouts.envs.registry import (
    EnvironmentSpecError,
    builtin_environment_name,
    builtin_environments,
    resolve_environment,
)
from lit_llm.rollouts.envs.tool_env import ToolEnv
from lit_llm.rollouts.envs.tools import (
    Tool,
    ToolCall,
    ToolCallParseError,
    ToolResult,
    parse_tool_calls,
    prompt_with_tools,
    template_supports_tools,
    tool_schemas,
    tools_system_prompt,
    validate_arguments,
)

__all__ = ["CalculatorEnv", "EnvStep", "Environment", "EnvironmentSpecError", "GuessNumberEnv", "Tool", "ToolCall",
           "ToolCallParseError", "ToolEnv", "ToolResult", "builtin_environment_name",
           "builtin_environments", "calculator", "evaluate_expression",
           "parse_tool_calls", "prompt_messages", "prompt_with_tools", "resolve_environment", "template_supports_tools",
           "tool_schemas", "tools_system_prompt", "unimplemented_method", "validate_arguments"]
