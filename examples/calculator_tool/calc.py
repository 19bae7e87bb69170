"""The calculator example's task, tool and SFT traces: 3-digit multiplication with a ``calc`` tool.

* ``build(cfg)``: the task (``task.name: calc.py:build``): ``"123*456="`` -> ``"56088"``, exact-match
  reward; 2,000 training and 200 held-out problems, fixed by ``cfg.seed``;
* ``calc(expr)``: the tool (``env.tools: [calc.py:calc]``), its JSON schema read from its type hints
  and docstring by ``transformers.utils.get_json_schema``;
* ``traces(prompt, answer)``: the conversation that solves a problem with the tool
  (``warmstart.traces: calc.py:traces``), for the SFT warm-start: a tool call, the tool's answer,
  the final answer.

The tiny model cannot multiply 3-digit numbers in one shot; with the tool it has to learn to copy
the operands into a call and the result into its answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def calc(expr: str) -> str:
    """Multiply or add two whole numbers.

    Args:
        expr: the expression, like 123*456 or 12+34
    """
    for op in ("*", "+"):
        a, sep, b = expr.partition(op)
        if sep and a.strip().isdecimal() and b.strip().isdecimal():
            try:  # (isdecimal admits other scripts' digits and str.strip control characters int() refuses)
                x, y = int(a.strip()), int(b.strip())
            except ValueError:
                return "error"
            return str(x * y if op == "*" else x + y)
    return "error"  # (a malformed expression is the model's mistake: it reads the error and goes on)


def traces(prompt: str, answer: str) -> list[dict]:
    """The conversation that solves ``prompt`` with the tool (OpenAI-style messages)."""
    expr = prompt.rstrip("=")
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}]},
            {"role": "tool", "name": "calc", "content": calc(expr)},
            {"role": "assistant", "content": answer}]


class CalcTask:
    """3-digit multiplication; reward 1.0 for the exact product."""

    greedy_eval_tokens = None

    def __init__(self, n_train: int = 2000, n_heldout: int = 200, seed: int = 0):
        rng = random.Random(seed)
        pairs = {(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(3 * (n_train + n_heldout))}
        problems = [Problem(f"{a}*{b}=", str(a * b)) for a, b in sorted(pairs)]
        rng.shuffle(problems)
        self.heldout, self.train = problems[:n_heldout], problems[n_heldout: n_heldout + n_train]
        self.seed = seed

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return float(response.strip() == answer)

    def cache_key(self) -> dict:
        return {"task": "calculator_tool", "seed": self.seed, "n": [len(self.train), len(self.heldout)]}


def build(cfg) -> CalcTask:
    return CalcTask(seed=cfg.seed)
