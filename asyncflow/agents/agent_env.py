"""Your own agent as an environment: it drives an episode through the endpoint, and returns its reward.

``env.agent`` names a function ``run(sample, base_url, api_key) -> float`` (the sample: ``prompt``,
``answer``, ...). Per episode it runs in a thread of its own, typically as a few lines around
``openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(...)``; whatever it
calls, tools included, is its business. To the episode runner it is an ordinary
:class:`~asyncflow.agents.env.Environment` (:class:`AgentEnv`), with the control inverted:

* ``reset(sample)`` opens a session on the :class:`~asyncflow.agents.server.Endpoint`, starts the
  agent, and returns the ids of its first call as :class:`~asyncflow.agents.env.Tokens` (the
  rendered prompt);
* ``step(turn)`` answers the waiting call with the model's turn, then waits for the agent's next
  call (its new ids are the observation, :class:`~asyncflow.agents.session.Session`'s rule) or its
  return (``done``, with the reward it returned).

So the trajectory is the agent's conversation token for token: its prompt, each completion the
model wrote (in the loss) and whatever the agent added between two calls (not in the loss). An
agent that raises, returns a non-number, calls with a history that does not extend the episode
(409), or neither calls nor returns within ``env.timeout_s`` ends the episode as an environment
error. Episodes driven by an agent are not continued across a restart (the agent's own state is
not ours to save): they start again from their prompts.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable
from typing import Any

from asyncflow.agents.env import EnvError, StepResult, Tokens, Turn
from asyncflow.agents.server import Endpoint
from asyncflow.agents.session import Finished, Session

AgentFn = Callable[[dict[str, Any], str, str], Any]


class AgentEnv:
    """An episode driven by an agent function through the endpoint (module doc)."""

    def __init__(self, endpoint: Endpoint, agent: AgentFn, timeout_s: float = 10.0):
        self.endpoint, self.agent, self.timeout_s = endpoint, agent, timeout_s
        self.session: Session | None = None

    def reset(self, sample: dict[str, Any]) -> Tokens:
        session = self.session = self.endpoint.open()
        url, key = self.endpoint.base_url(session), self.endpoint.token

        def run() -> None:
            try:
                session.inbox.put(Finished(reward=self.agent(dict(sample), url, key)))
            except BaseException as e:  # (the agent's error ends the episode, counted)
                session.inbox.put(Finished(error=e))

        threading.Thread(target=run, name=f"agent-{session.eid}", daemon=True).start()
        first = session.next(self.timeout_s)
        if isinstance(first, Finished):
            self._raise(first)
            raise EnvError("the agent returned before it called the endpoint: an episode needs at least one turn")
        return Tokens(first.ids)

    def step(self, turn: Turn) -> StepResult:
        assert self.session is not None  # (reset first)
        self.session.answer(turn)
        nxt = self.session.next(self.timeout_s)
        if isinstance(nxt, Finished):
            self._raise(nxt)
            if isinstance(nxt.reward, bool) or not isinstance(nxt.reward, numbers.Real):
                raise EnvError(f"the agent returned {nxt.reward!r:.80}: expected its reward, a number")
            return StepResult(None, float(nxt.reward), True)
        return StepResult(Tokens(nxt.ids), 0.0, False)

    @staticmethod
    def _raise(done: Finished) -> None:
        if done.error is not None:
            raise done.error

    def close(self) -> None:
        if self.session is not None:
            self.endpoint.forget(self.session)


def agent_factory(agent: AgentFn, tokenizer: Any, host: str = "127.0.0.1", port: int = 0,
                  timeout_s: float = 10.0) -> Callable[[], AgentEnv]:
    """``make_env()`` for ``env.agent``: one endpoint (started on the first episode) for all of them."""
    endpoint: list[Endpoint] = []
    lock = threading.Lock()

    def make() -> AgentEnv:
        with lock:
            if not endpoint:
                endpoint.append(Endpoint(tokenizer, host, port))
        return AgentEnv(endpoint[0], agent, timeout_s)

    make.endpoint = endpoint  # type: ignore[attr-defined]  # (tests reach the server through it)
    return make
