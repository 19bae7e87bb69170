"""One episode's conversation on the endpoint: the token-history rule, and the hand-over of calls and turns.

A :class:`Session` sits between two threads: the endpoint's event loop, where each HTTP call
becomes a :class:`Call` (:meth:`Session.chat`, :meth:`Session.text`: the ids it adds to the
episode, by :func:`~asyncflow.agents.chat.continuation`'s rule, or :class:`HistoryError`), and the
episode's :class:`~asyncflow.agents.agent_env.AgentEnv`, which takes the calls in order
(:meth:`Session.next`) and answers each with the model's turn (:meth:`Session.answer`). One call is
answered at a time, in order; a call made while another waits is refused.

``text`` is the conversation's text so far, exactly as the model saw and wrote it: the first
call's rendered prompt, then each turn decoded with its special tokens and each later call's new
text. The chat path parses tool calls out of a turn (:func:`~asyncflow.agents.tools.parse_tool_calls`)
into OpenAI ``tool_calls`` (arguments as a JSON string), and reads them back from the agent's
messages (arguments parsed again), so the template renders the assistant message as it was written.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from asyncflow.agents.calls import CallTimeout
from asyncflow.agents.chat import TemplateMismatch, continuation, decode, prompt_ids, tokens
from asyncflow.agents.env import Turn
from asyncflow.agents.tools import CALL_CLOSE, CALL_OPEN, Tool, parse_tool_calls

_CALLS = re.compile(re.escape(CALL_OPEN) + r".*?" + re.escape(CALL_CLOSE), re.DOTALL)


class HistoryError(ValueError):
    """A call that does not extend the episode's conversation (the endpoint answers 409)."""


@dataclass
class Reply:
    """What an HTTP call gets back: the assistant message, why it ended, its index and token counts."""

    message: dict[str, Any]
    finish_reason: str
    index: int
    usage: dict[str, int]


@dataclass
class Call:
    """One HTTP call, handed to the episode: the ids it adds (the first call: the prompt)."""

    ids: tuple[int, ...]
    chat: bool
    tools: list[dict[str, Any]] | None
    reply: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Finished:
    """The agent function returned (``reward``) or raised (``error``)."""

    reward: float = 0.0
    error: BaseException | None = None


class Session:
    """An episode's side of the endpoint (module doc)."""

    def __init__(self, eid: str, tokenizer: Any):
        self.eid, self.tok = eid, tokenizer
        self.inbox: queue.Queue[Call | Finished] = queue.Queue()
        self.conversation = ""  # the text so far (module doc)
        self.seen = 0  # ids so far (prompt + turns + later calls' text)
        self.calls = 0
        self.pending: Call | None = None
        self.closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the endpoint's side
    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Call:
        msgs = [_normalised(m) for m in messages]
        with self._lock:
            if self.calls == 0:
                ids, self.conversation = prompt_ids(self.tok, msgs, tools)
            else:
                try:
                    new = continuation(self.tok, self.conversation, msgs, tools)
                except TemplateMismatch as e:
                    raise HistoryError(f"the messages do not extend this episode's conversation (send every "
                                       f"earlier message, the assistant's as they were returned): {e}") from None
                ids, self.conversation = tokens(self.tok, new), self.conversation + new
            return self._hand_over(ids, True, tools)

    def text(self, prompt: str) -> Call:
        with self._lock:
            if self.calls == 0:
                ids, self.conversation = prompt_ids(self.tok, prompt, None)
            elif not prompt.startswith(self.conversation):
                raise HistoryError("the prompt does not extend this episode's text (the previous prompt and the "
                                   "completion returned for it, then new text)")
            else:
                new = prompt[len(self.conversation):]
                ids, self.conversation = tokens(self.tok, new), prompt
            return self._hand_over(ids, False, None)

    def _hand_over(self, ids: list[int], chat: bool, tools: list[dict[str, Any]] | None) -> Call:
        if self.closed:
            raise HistoryError("the episode has ended")
        if self.pending is not None:
            raise HistoryError("another call of this episode is waiting for its turn: one call at a time")
        call = Call(tuple(ids), chat, tools)
        self.pending, self.calls, self.seen = call, self.calls + 1, self.seen + len(ids)
        self.inbox.put(call)
        return call

    # ------------------------------------------------------------------ the episode's side
    def next(self, timeout: float) -> Call | Finished:
        """The agent's next call, or how its function ended; :class:`CallTimeout` after ``timeout`` s."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise CallTimeout(f"the agent made no call and did not return within env.timeout_s = {timeout} s") from None

    def answer(self, turn: Turn) -> None:
        """Answer the waiting call with the model's ``turn``."""
        with self._lock:
            call, self.pending = self.pending, None
            self.conversation += decode(self.tok, turn.ids)
            prompt, self.seen = self.seen, self.seen + len(turn.ids)
        if call is None:
            return
        usage = {"prompt_tokens": prompt, "completion_tokens": len(turn.ids), "total_tokens": prompt + len(turn.ids)}
        call.reply.set_result(Reply(_message(turn, call), _finish_reason(turn, call), turn.index, usage))

    def close(self) -> None:
        """The episode ended: a call still waiting gets an error (the agent's client sees one line)."""
        with self._lock:
            self.closed = True
            call, self.pending = self.pending, None
        if call is not None and not call.reply.done():
            call.reply.set_exception(RuntimeError("the episode ended before this call's turn"))


def _normalised(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the template reads it: tool-call arguments as objects (OpenAI sends JSON text)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # (rendered as it is; the history check says whether it still matches)
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


def _message(turn: Turn, call: Call) -> dict[str, Any]:
    """The assistant message of a turn: its text, and (chat) its tool calls as OpenAI's ``tool_calls``."""
    if not call.chat:
        return {"role": "assistant", "content": turn.text}
    tools = {t.name: t for t in (Tool(lambda: None, s) for s in call.tools or [] if "function" in s)}
    calls = [c for c in parse_tool_calls(turn.text, tools) if c.error is None]
    if not calls:
        return {"role": "assistant", "content": turn.text}
    content = _CALLS.sub("", turn.text).strip() or None
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"call_{turn.index}_{i}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for i, c in enumerate(calls)]}


def _finish_reason(turn: Turn, call: Call) -> str:
    if call.chat and "tool_calls" in _message(turn, call):
        return "tool_calls"
    return "length" if turn.stop_reason == "length" else "stop"
