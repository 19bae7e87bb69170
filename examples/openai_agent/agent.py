"""A tool-using agent written against the ``openai`` client, trained by asyncflow through rollout's
OpenAI-compatible endpoint (``env.agent: agent.py:run``). Nothing in ``run`` knows about RL: it
gets a base URL and a key, talks to "the model" as to any OpenAI-compatible server, and returns how
well it did. ``traces`` gives the warm-start the conversation a good agent has (same tools).
"""

import functools
import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Multiply or add two whole numbers.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "like 123*456"}},
                   "required": ["expr"]}}}]


def calc(expr: str) -> str:
    a, op, b = expr.partition("*") if "*" in expr else expr.partition("+")
    return str(int(a) * int(b) if op == "*" else int(a) + int(b)) if a.isdigit() and b.isdigit() else "error"


@functools.cache
def _openai() -> openai.OpenAI:  # one client (its connection pool) for every episode: making one costs ~0.1 s
    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="set-per-episode", max_retries=0)


def run(sample: dict, base_url: str, api_key: str) -> float:
    client = _openai().with_options(base_url=base_url, api_key=api_key)  # this episode's endpoint
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))  # sent back as it came: the history extends
        if not msg.tool_calls:
            return float((msg.content or "").strip() == sample["answer"])
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(**args)})
    return 0.0


def traces(prompt: str, answer: str) -> dict:
    """The warm-start's conversation for a training problem, with the tools the agent offers."""
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": prompt.rstrip("=")}}}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calc(prompt.rstrip("="))}, {"role": "assistant", "content": answer}]}
