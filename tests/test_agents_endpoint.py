"""Rollout's OpenAI-compatible endpoint, driven by the real ``openai`` client.

An agent written against the client drives episodes through ``/v1/chat/completions`` and
``/v1/completions``; the episode's sample is exactly the ids the model saw and wrote (the history
rule of asyncflow.agents.chat: earlier ids reused, only new text tokenised). The server is bound to
loopback, refuses a request without the job's bearer token, and answers every bad request with
one line (OpenAI's error shape).
"""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest
from agents_helpers import calc, calc_engine, tool_tokenizer

from asyncflow.agents import EpisodeRunner, Limits
from asyncflow.agents.agent_env import agent_factory
from asyncflow.agents.calls import EnvCalls
from asyncflow.agents.chat import tokens
from asyncflow.agents.drive import run_episodes
from asyncflow.agents.server import Endpoint
from asyncflow.agents.tools import Tool
from asyncflow.engines.types import SamplingParams

TOK = tool_tokenizer()
CALL_END = TOK.convert_tokens_to_ids("</tool_call>")
TOOLS = [Tool(calc).schema]


@functools.cache
def _openai():  # one client for all episodes (making one costs ~0.1 s); each episode its own base_url
    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="per-episode", max_retries=0)


def chat_agent(sample, base_url, api_key):
    """A typical tool-using agent loop on the openai client (what examples/openai_agent does)."""
    client = _openai().with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return float((msg.content or "").strip() == sample["answer"])
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calc(**json.loads(call.function.arguments))})
    return 0.0


def text_agent(sample, base_url, api_key):
    """The same episode through /v1/completions: the agent extends the text itself."""
    client = _openai().with_options(base_url=base_url, api_key=api_key)
    prompt = "calc:" + sample["prompt"]
    first = client.completions.create(model="policy", prompt=prompt).choices[0].text
    expr = first.split("calc(")[1].split(")")[0]
    prompt += first + f"<tool_response>{calc(expr)}</tool_response>"
    final = client.completions.create(model="policy", prompt=prompt).choices[0].text
    return float(final.replace("<eos>", "").strip() == sample["answer"])


def _episodes(agent, n=2):
    make = agent_factory(agent, TOK, timeout_s=20.0)
    calls = EnvCalls(8, 20.0)
    runner = EpisodeRunner(TOK, make, Limits(max_turns=3, max_tokens=60, turn_tokens=30, stop_ids=(CALL_END,)),
                           calls)
    rows = [((i, None), {"prompt": f"{12 + i}*34=", "answer": str((12 + i) * 34)}, [1]) for i in range(n)]
    try:
        out = run_episodes(calc_engine(TOK, keep=True), SamplingParams(1.0, max_new_tokens=30), runner, rows)
    finally:
        calls.close()
        make.endpoint[0].close()
    return sorted(out, key=lambda t: t.key), runner


@pytest.mark.parametrize("agent", [chat_agent, text_agent])
def test_an_openai_client_agent_drives_episodes_and_the_sample_is_what_the_model_saw(agent):
    out, runner = _episodes(agent)
    assert runner.errors == {"exception": 0, "timeout": 0, "bad_return": 0, "template": 0}, runner.failures
    for i, t in enumerate(out):
        q = f"{12 + i}*34"
        assert t.reward == 1.0 and t.end == "done" and t.turns == 2
        assert t.prompt_ids == [TOK.bos_token_id, *tokens(TOK, f"calc:{q}=")]
        call, obs, final = (f"<tool_call>calc({q})</tool_call>", f"<tool_response>{12 * 34 + 34 * i}</tool_response>",
                            f"{(12 + i) * 34}<eos>")
        assert TOK.decode(t.response_ids) == call + obs + final
        n = [len(tokens(TOK, x)) for x in (call, obs, final)]
        assert t.loss_mask == [1] * n[0] + [0] * n[1] + [1] * n[2]


@pytest.fixture
def endpoint():
    ep = Endpoint(TOK)
    yield ep
    ep.close()


def test_the_endpoint_is_on_loopback_and_refuses_a_request_without_its_token(endpoint):
    assert endpoint.host == "127.0.0.1"
    session = endpoint.open()
    url = endpoint.base_url(session)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        _openai().with_options(base_url=url, api_key="wrong-token").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "1*2="}])
    r = httpx.post(f"{url}/chat/completions", json={"messages": []})  # no Authorization header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert session.calls == 0  # nothing reached the episode


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not JSON"),
    (json.dumps({"messages": "hi"}).encode(), 400, "'messages' must be"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True}).encode(), 400, "stream"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), 400, "one completion"),
])
def test_a_bad_request_is_one_line(endpoint, body, status, words):
    session = endpoint.open()
    r = httpx.post(f"{endpoint.base_url(session)}/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {endpoint.token}"})
    err = r.json()["error"]
    assert r.status_code == status and words in err["message"] and "\n" not in err["message"]


def test_an_unknown_episode_and_a_history_that_does_not_extend_are_refused(endpoint):
    auth = {"Authorization": f"Bearer {endpoint.token}"}
    r = httpx.post(f"http://127.0.0.1:{endpoint.port}/episodes/nope/v1/chat/completions", headers=auth,
                   json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    session = endpoint.open()
    session.chat([{"role": "user", "content": "12*34="}], None)  # the first call (its turn pending)
    session.answer(type("T", (), {"ids": tuple(tokens(TOK, "<tool_call>calc(12*34)</tool_call>")), "index": 0,
                                  "text": "<tool_call>calc(12*34)</tool_call>", "stop_reason": "stop"})())
    edited = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "something else"},
              {"role": "tool", "content": "408"}]
    r = httpx.post(f"{endpoint.base_url(session)}/chat/completions", headers=auth, json={"messages": edited})
    assert r.status_code == 409 and "do not extend" in r.json()["error"]["message"]
