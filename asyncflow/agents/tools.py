"""Tools: plain Python functions with a JSON schema, called from the model's output by :class:`ToolEnv`.

A tool is a typed function with a Google-style docstring; its JSON schema is the one
``transformers.utils.get_json_schema`` derives (the format chat templates' ``tools=`` take),
so the model is offered the tools the way any Hugging Face chat model is. ``env.tools`` names
them by import path (``pkg.mod:fn`` or ``path/to/file.py:fn``).

Tool calls are parsed from a turn's text between ``<tool_call>`` and ``</tool_call>`` (the
Hermes/Qwen tags; :data:`CALL_OPEN`, :data:`CALL_CLOSE`), in either of two forms:

* JSON, as Hermes/Qwen chat models write them: ``{"name": "calc", "arguments": {"expr": "2*3"}}``;
* compact, for a tool of one parameter: ``calc(2*3)`` (the text between the first ``(`` and
  the last ``)`` is that parameter's value). A small model learns the short form much faster.

:class:`ToolEnv` (the built-in :class:`~asyncflow.agents.env.Environment`): ``reset`` gives the row's
prompt as one user message (the chat template renders the tools with it); ``step`` runs every
call of the turn in order and answers with one ``tool`` message per call; a turn that calls no
tool is the final answer: the episode ends, scored by ``reward(prompt, answer text, answer)``
(the task's reward or ``reward.fn``). A call the model got wrong (unknown tool, arguments that
do not parse or do not fit the schema) is answered with an error message the model can read,
so it may try again; a tool that *raises* ends the episode as an environment error (counted,
its traceback logged), as the issue of a broken tool is the tool's, not the model's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from asyncflow.agents.env import StepResult, Turn

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_TOKENS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (or why they did not parse)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


class Tool:
    """A Python function offered to the model, with its JSON schema (module doc)."""

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any] | None = None):
        self.fn = fn
        self.schema = schema or get_json_schema(fn)
        spec = self.schema["function"]
        self.name: str = spec["name"]
        params = spec.get("parameters", {})
        self.params: list[str] = list(params.get("properties", {}))
        self.required: set[str] = set(params.get("required", []))

    def check(self, args: dict[str, Any]) -> str | None:
        """Why ``args`` do not fit the schema (None: they fit)."""
        unknown = sorted(set(args) - set(self.params))
        missing = sorted(self.required - set(args))
        if unknown:
            return f"unknown argument {unknown[0]!r} of {self.name} (it takes {', '.join(self.params) or 'none'})"
        if missing:
            return f"missing argument {missing[0]!r} of {self.name}"
        return None


def parse_tool_calls(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of ``text``, in order (module doc for the two forms)."""
    return [_parse_one(body.strip(), tools) for body in _CALL.findall(text)]


def _parse_one(body: str, tools: dict[str, Tool]) -> ToolCall:
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", {}, 'a JSON tool call needs {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # (OpenAI's wire format: arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(obj["name"], {}, "the arguments are not valid JSON")
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, "the arguments must be a JSON object")
        return ToolCall(obj["name"], args)
    name, paren, rest = body.partition("(")
    name = name.strip()
    if not paren or not rest.endswith(")"):
        return ToolCall(name, {}, "a tool call is name(argument) or JSON")
    tool = tools.get(name)
    if tool is None or len(tool.params) != 1:
        return ToolCall(name, {}, f"the form name(argument) needs a tool of one argument; {name!r} is not one")
    return ToolCall(name, {tool.params[0]: rest[:-1]})


def render_compact(name: str, arguments: dict[str, Any]) -> str:
    """A call in the compact form when it has one argument, else in JSON (chat templates use this)."""
    if len(arguments) == 1:
        return f"{CALL_OPEN}{name}({next(iter(arguments.values()))}){CALL_CLOSE}"
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


Reward = Callable[[str, str, str], float]


class ToolEnv:
    """The built-in environment: tools called from the model's turns (module doc).

    ``max_calls``: tool calls an episode may make before a turn that calls one more ends it
    (unanswered, reward 0); the turn limit of ``env.max_turns`` applies as well.
    """

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool], reward: Reward | None = None, max_calls: int = 8):
        self.by_name = {t.name: t for t in (x if isinstance(x, Tool) else Tool(x) for x in tools)}
        self.tools = [t.schema for t in self.by_name.values()]  # what the chat template offers
        self.reward, self.max_calls = reward, max_calls
        self.sample: dict[str, Any] = {}
        self.calls = 0

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        self.sample, self.calls = dict(sample), 0
        return [{"role": "user", "content": str(sample.get("prompt", ""))}]

    def step(self, turn: Turn) -> StepResult:
        calls = parse_tool_calls(turn.text, self.by_name)
        if not calls:  # the final answer
            reward = 0.0
            if self.reward is not None:
                reward = float(self.reward(str(self.sample.get("prompt", "")), turn.content.strip(),
                                           str(self.sample.get("answer", ""))))
            return StepResult(None, reward, True)
        self.calls += len(calls)
        if self.calls > self.max_calls:
            return StepResult(None, 0.0, True, {"truncated": "max_calls"})
        return StepResult([self._answer(c) for c in calls], 0.0, False)

    def _answer(self, call: ToolCall) -> dict[str, Any]:
        """One tool message: the tool's result, or the model's mistake in words."""
        tool = self.by_name.get(call.name)
        problem = call.error or (f"unknown tool {call.name!r} (tools: {', '.join(self.by_name)})" if tool is None
                                 else tool.check(call.arguments))
        if problem is not None:
            return {"role": "tool", "name": call.name, "content": f"error: {problem}"}
        assert tool is not None  # (a None tool is a problem above)
        return {"role": "tool", "name": call.name, "content": str(tool.fn(**call.arguments))}

    def state_dict(self) -> dict[str, Any]:
        return {"sample": self.sample, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample, self.calls = dict(state["sample"]), int(state["calls"])
