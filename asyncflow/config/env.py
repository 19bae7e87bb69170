"""The ``env`` section: multi-turn episodes with tools, an environment or your own agent (light: no torch).

Exactly one of ``tools``, ``fn`` and ``agent`` turns a run multi-turn (:mod:`asyncflow.agents`);
with none of them every answer is one turn, as before.
"""

from __future__ import annotations

import importlib.util

from pydantic import Field, field_validator, model_validator

from asyncflow.config.base import Section


def _spec(v: str) -> str:
    if v.count(":") != 1 or not all(v.split(":")):
        raise ValueError(f"'{v}' is not an import path: write 'package.module:name' or 'path/to/file.py:name'")
    return v


class EnvConfig(Section):
    tools: list[str] = Field([], description="Tool functions 'package.module:fn' or 'path/to/file.py:fn' (typed, "
                                             "with a docstring: their JSON schema is derived from it), offered through "
                                             "the chat template's tools= and run by the built-in ToolEnv; a turn that "
                                             "calls none is the final answer, scored by the task's reward or "
                                             "reward.fn.")
    fn: str | None = Field(None, description="Your environment: 'package.module:make' or 'path/to/file.py:make', "
                                             "make() -> an object with reset(sample) and step(turn) "
                                             "(docs/agents.md).")
    agent: str | None = Field(None, description="Your agent, driving episodes through rollout's OpenAI-compatible "
                                                "endpoint: 'package.module:run' or 'path/to/file.py:run', called "
                                                "run(sample, base_url, api_key) -> reward in a thread per episode.")
    max_turns: int = Field(4, ge=1, description="Model turns an episode may take.")
    max_tokens: int = Field(96, ge=1, description="Tokens after the prompt an episode may hold in all (its turns and "
                                                  "the observations between them).")
    turn_tokens: int | None = Field(None, ge=1, description="Longest turn, in tokens (None = rollout.max_new_tokens).")
    stop: list[str] = Field(["</tool_call>"], description="Texts, each one token of the tokenizer, that end a turn "
                                                          "besides EOS (the end of a tool call); one the tokenizer "
                                                          "does not have as a token is left out.")
    timeout_s: float = Field(10.0, gt=0, description="Seconds an environment call (reset, step, a tool; an agent's "
                                                     "next request) may take before its episode ends as an error.")
    concurrency: int = Field(64, ge=1, description="Environment calls running at once (threads; async ones share "
                                                   "one event loop).")
    on_error: float = Field(0.0, description="Reward of an episode that ended by an environment error (counted; "
                                             "first tracebacks in RUN_DIR/env_errors.log).")
    latency_ms: tuple[float, float] | None = Field(
        None, description="Emulated remote environment: each step first waits uniform(lo, hi) ms (benchmarks).")
    max_calls: int = Field(8, ge=1, description="tools: tool calls an episode may make.")
    host: str = Field("127.0.0.1", description="agent: the endpoint's address (loopback by default; it needs the "
                                               "job's bearer token either way).")
    port: int = Field(0, ge=0, le=65535, description="agent: the endpoint's port (0 = any free one).")

    @field_validator("fn", "agent")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _spec(v)

    @field_validator("tools")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_spec(x) for x in v]

    @model_validator(mode="after")
    def _one(self) -> EnvConfig:
        given = [k for k in ("tools", "fn", "agent") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are both set: give one of tools, fn, agent")
        if self.agent and not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn")):
            raise ValueError("agent needs the endpoint's server (starlette, uvicorn), which is not installed: "
                             "pip install 'asyncflow[agents]'")
        if self.latency_ms is not None and not 0 <= self.latency_ms[0] <= self.latency_ms[1]:
            raise ValueError(f"latency_ms = {list(self.latency_ms)}: expected [lo, hi] with 0 <= lo <= hi")
        return self

    @property
    def enabled(self) -> bool:
        """Is the run multi-turn?"""
        return bool(self.tools or self.fn or self.agent)
