"""Agents: multi-turn episodes with tools and environments, and an OpenAI-compatible endpoint.

* :mod:`~asyncflow.agents.env`: the :class:`Environment` protocol (``reset``, ``step``), a model's
  :class:`Turn`, a :class:`StepResult`;
* :mod:`~asyncflow.agents.tools`: tools as typed Python functions, their calls parsed from the
  model's output, the built-in :class:`ToolEnv`;
* :mod:`~asyncflow.agents.chat`: chat templates as token streams (the no-re-tokenisation rule);
* :mod:`~asyncflow.agents.calls`: environment calls off the decode loop, with deadlines;
* :mod:`~asyncflow.agents.episode`: :class:`EpisodeRunner`, episodes token in / token out, and
  the :class:`Trajectory` (one sample, with its loss mask) each one makes;
* :mod:`~asyncflow.agents.drive`: putting turns into an engine batch; whole evaluation runs;
* :mod:`~asyncflow.agents.server`, :mod:`~asyncflow.agents.agent_env`: the OpenAI-compatible endpoint
  and the environment an outside agent drives through it.

Layer 3 (beside ``tasks``, which may use it; it uses neither ``tasks`` nor anything above):
rollout (:mod:`asyncflow.workflow.rollout`) drives an :class:`EpisodeRunner` in its decode loop.
docs/agents.md is the user's guide.
"""

from asyncflow.agents.env import Environment, StepResult, Tokens, Turn
from asyncflow.agents.episode import EpisodeRunner, Limits, Trajectory
from asyncflow.agents.tools import Tool, ToolEnv

__all__ = ["Environment", "EpisodeRunner", "Limits", "StepResult", "Tokens", "Tool", "ToolEnv", "Trajectory", "Turn"]
