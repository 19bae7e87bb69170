"""Shared pieces of the multi-turn tests (not a test module): the tool tokenizer, a calculator tool,
a scripted fake engine that uses the tool the way a trained model would, and scripted environments."""

from __future__ import annotations

import asyncio
import time

from asyncflow.agents.chat import TOOL_TEMPLATE, add_tool_tokens, tokens
from asyncflow.agents.env import StepResult, Turn
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.tiny import build_char_tokenizer
from asyncflow.engines.types import Request, SamplingParams


def tool_tokenizer():
    """The built-in char tokenizer with the tool tags as tokens and the tool chat template."""
    tok = build_char_tokenizer()
    add_tool_tokens(tok)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def calc(expr: str) -> str:
    """Multiply two whole numbers.

    Args:
        expr: the product, like 12*34
    """
    a, b = expr.split("*")
    return str(int(a) * int(b))


def exact(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer)


def calc_script(tok, tail: str = ""):
    """A fake engine's answer script: call calc on the prompt's product (then ``tail``, which a
    stop token cuts off), and answer with the tool's result once it is in the history."""

    def script(req: Request, sp: SamplingParams) -> list[int]:
        text = tok.decode(req.prompt_ids, skip_special_tokens=False)
        if "<tool_response>" in text:
            return tokens(tok, text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]) + [tok.eos_token_id]
        q = text.split(":")[-1].rstrip("=")
        return tokens(tok, f"<tool_call>calc({q})</tool_call>{tail}") + [tok.eos_token_id]

    return script


def calc_engine(tok, keep: bool = False, **kw) -> FakeEngine:
    return FakeEngine(answer=calc_script(tok), eos_id=tok.eos_token_id, keep=keep, **kw)


class Echo:
    """A user environment (plain text in and out): it answers each turn with ``obs`` text, and
    ends the episode after ``turns`` turns with reward 1 per turn. ``fail``: raise in step k."""

    tools = None

    def __init__(self, obs: str = " ok ", turns: int = 2, fail: int | None = None, sleep_s: float = 0.0):
        self.obs, self.turns, self.fail, self.sleep_s = obs, turns, fail, sleep_s
        self.seen = 0

    def reset(self, sample: dict) -> str:
        return str(sample["prompt"])

    def step(self, turn: Turn) -> StepResult:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self._answer()

    def _answer(self) -> StepResult:
        self.seen += 1
        if self.fail is not None and self.seen == self.fail:
            raise ZeroDivisionError("boom in the environment")
        return StepResult(None if self.seen >= self.turns else self.obs, 1.0, self.seen >= self.turns)

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


class AsyncEcho(Echo):
    """:class:`Echo` with ``async def step``."""

    async def step(self, turn: Turn) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(self.sleep_s)  # (cancelled at the call's deadline)
        return self._answer()
