"""Multi-turn episodes token in / token out (asyncflow.agents.episode) on the deterministic fake engine.

What the trajectory of an episode must be, checked against what the engine generated and the
environment answered, token for token: its ids are exactly the concatenation of its turns and
observations (no re-tokenisation), an observation token is never in the loss, every generated token
keeps its log-prob and policy version; the limits end episodes where they say; an environment that
raises, hangs or breaks the contract ends its episode, counted, never the runner. One test runs the
built-in slot engine: its kept rows continued with ``extend`` give the whole-history path's samples.
"""

from __future__ import annotations

import pytest
from agents_helpers import AsyncEcho, Echo, calc, calc_engine, exact, tool_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.agents import EpisodeRunner, Limits, StepResult, ToolEnv
from asyncflow.agents.calls import EnvCalls
from asyncflow.agents.chat import tokens
from asyncflow.agents.drive import run_episodes
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.types import SamplingParams

TOK = tool_tokenizer()
EOS = TOK.eos_token_id
CALL_END = TOK.convert_tokens_to_ids("</tool_call>")


def _run(engine, make_env, limits, rows, timeout_s=5.0):
    calls = EnvCalls(8, timeout_s)
    runner = EpisodeRunner(TOK, make_env, limits, calls)
    try:
        return run_episodes(engine, SamplingParams(1.0, max_new_tokens=limits.turn_tokens), runner, rows), runner
    finally:
        calls.close()


def _rows(n, prompt="12*34="):
    return [((i, None), {"prompt": prompt, "answer": "408"}, [1, 9]) for i in range(n)]


class Scripted:
    """An environment that answers turn k with observation ``obs[k]`` (text), then ends."""

    tools = None

    def __init__(self, obs: list[str]):
        self.obs, self.k, self.turns = obs, 0, []

    def reset(self, sample):
        return sample["prompt"]

    def step(self, turn):
        self.turns.append(turn)
        k, self.k = self.k, self.k + 1
        return StepResult(self.obs[k] if k < len(self.obs) else None, 0.5, k >= len(self.obs))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obs=st.lists(st.text(alphabet="abc xyz0123<>/", min_size=1, max_size=6), max_size=3),
       lens=st.lists(st.integers(1, 6), min_size=4, max_size=4), keep=st.booleans())
def test_a_trajectory_is_its_turns_and_observations_exactly_and_only_turns_are_in_the_loss(obs, lens, keep):
    """Property: response = turn_0 + obs_0 + turn_1 + ..., each turn the engine's ids (their
    log-probs and versions), each observation tokenised alone (log-prob 0, mask 0): on both the
    extend path (kept rows) and the whole-history path."""
    turns_made: list[list[int]] = []

    def answer(req, sp):  # turn k: lens[k] digits then EOS
        ids = [4 + (len(turns_made) + j) % 10 for j in range(lens[len(turns_made) % 4] - 1)] + [EOS]
        turns_made.append(ids)
        return ids

    engine = FakeEngine(answer=answer, eos_id=EOS, keep=keep, logprob=lambda v, pos: -0.1 * (pos + 1))
    envs: list[Scripted] = []

    def make():
        envs.append(Scripted(obs))
        return envs[-1]

    (t,), runner = _run(engine, make, Limits(max_turns=10, max_tokens=500, turn_tokens=8), _rows(1))
    expect, mask, lps = [], [], []
    for k, turn in enumerate(turns_made):
        expect += turn
        mask += [1] * len(turn)
        lps += [-0.1 * (p + 1) for p in range(len(turn))]
        if k < len(obs):
            o = tokens(TOK, obs[k])
            expect, mask, lps = expect + o, mask + [0] * len(o), lps + [0.0] * len(o)
    assert t.response_ids == expect and t.loss_mask == mask and t.logprobs == pytest.approx(lps, rel=1e-6)
    assert t.prompt_ids == [TOK.bos_token_id, *tokens(TOK, "12*34=")]
    assert len(t.token_versions) == len(t.response_ids) and t.turns == len(obs) + 1 and t.end == "done"
    assert t.reward == pytest.approx(0.5 * (len(obs) + 1)) and runner.active == 0
    assert [list(x.ids) for x in envs[0].turns] == turns_made  # the environment saw exactly the ids generated


def test_the_extend_path_and_the_whole_history_path_give_the_same_trajectory():
    """A tool episode on an engine that keeps rows (extend) and on one that does not: identical
    samples, and the extend path really ran (the engine's extend was called)."""
    out = {}
    for keep in (False, True):
        engine = calc_engine(TOK, keep=keep)
        lim = Limits(max_turns=3, max_tokens=60, turn_tokens=30, stop_ids=(CALL_END,))
        trajs, _ = _run(engine, lambda: ToolEnv([calc], exact), lim, _rows(3))
        out[keep] = sorted((t.key, t.response_ids, t.loss_mask, t.reward) for t in trajs)
    assert out[False] == out[True] and all(r == 1.0 for *_, r in out[True])
    (_, ids, mask, _) = out[True][0]
    assert TOK.decode(ids) == "<tool_call>calc(12*34)</tool_call><tool_response>408</tool_response>408<eos>"
    assert mask == [1] * 13 + [0] * 5 + [1] * 4  # the tool's answer (5 tokens) is not the model's


def test_an_engine_that_ignores_stop_ids_is_cut_at_the_first_stop():
    """Tokens after the stop token were never seen by the environment nor kept in the sample."""
    script = calc_engine(TOK).answer
    tail_engine = FakeEngine(answer=lambda r, sp: script(r, sp) if "<tool_response>" in TOK.decode(r.prompt_ids)
                             else tokens(TOK, "<tool_call>calc(12*34)</tool_call>zz") + [EOS], eos_id=EOS)
    add = tail_engine.new_batch  # (an engine that drops the requests' stop ids, as one without the capability)

    def ignoring(sp):
        batch = add(sp)
        inner = batch.add

        def add_without_stops(reqs):
            for r in reqs:
                r.stop_ids = ()
            return inner(reqs)

        batch.add = add_without_stops
        return batch

    tail_engine.new_batch = ignoring
    (t,), runner = _run(tail_engine, lambda: ToolEnv([calc], exact),
                        Limits(max_turns=3, max_tokens=60, turn_tokens=30, stop_ids=(CALL_END,)), _rows(1))
    assert "zz" not in TOK.decode(t.response_ids) and t.reward == 1.0 and runner.cut_at_stop == 1


def test_limits_end_episodes_where_they_say():
    never = lambda: Echo(obs=" more ", turns=99)  # noqa: E731
    engine = FakeEngine(eos_id=EOS)  # each turn: turn_tokens - 1 digits + EOS
    (t,), _ = _run(engine, never, Limits(max_turns=3, max_tokens=500, turn_tokens=4), _rows(1))
    assert (t.end, t.turns) == ("max_turns", 3)
    (t,), _ = _run(FakeEngine(eos_id=EOS), never, Limits(max_turns=50, max_tokens=20, turn_tokens=4), _rows(1))
    assert t.end == "max_tokens" and len(t.response_ids) <= 20 and t.loss_mask[-1] == 1  # no cut observation
    assert all(len(x) <= 4 for x in _turns(t))


def _turns(t):
    out, cur = [], []
    for tok, m in zip(t.response_ids, t.loss_mask):
        if m:
            cur.append(tok)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("env, kind", [
    (lambda: Echo(fail=1), "exception"),
    (lambda: Echo(sleep_s=3.0), "timeout"),
    (lambda: AsyncEcho(sleep_s=3.0), "timeout"),
    (lambda: type("Bad", (Echo,), {"step": lambda self, turn: "not a result"})(), "bad_return"),
])
def test_an_environment_error_ends_its_episode_counted_and_scored_on_error(env, kind):
    (t,), runner = _run(FakeEngine(eos_id=EOS), env, Limits(max_turns=4, turn_tokens=3, on_error=-1.0), _rows(1),
                        timeout_s=0.5)
    assert (t.end, t.reward) == ("error", -1.0) and runner.errors[kind] == 1
    assert sum(runner.errors.values()) == 1 and len(runner.failures) == 1
    assert t.loss_mask[: len(t.response_ids)] and len(t.loss_mask) == len(t.response_ids)
    if kind == "exception":
        assert "ZeroDivisionError: boom in the environment" in runner.failures[0]


def test_a_failed_reset_keeps_the_group_whole_with_one_masked_token():
    class NoReset(Echo):
        def reset(self, sample):
            raise RuntimeError("no sandbox")

    (t,), runner = _run(FakeEngine(eos_id=EOS), NoReset, Limits(turn_tokens=3), _rows(1))
    assert t.prompt_ids == [1, 9] and t.response_ids == [EOS] and t.loss_mask == [0] and t.end == "error"
    assert runner.errors["exception"] == 1


class _Plain:
    """The built-in engine's batch seen without its multi-turn capability (no ``extend``/``release``):
    the runner then sends every turn as a new request with the whole history as its prompt."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return len(self.batch)

    def add(self, requests):
        return self.batch.add(requests)

    def step(self):
        return self.batch.step()


def test_the_built_in_engine_continues_a_kept_row_on_its_cache_to_the_whole_history_s_sample():
    """On the real slot engine (tiny model, greedy): episodes whose turns continue kept rows with
    ``extend`` (only the observation's ids prefilled onto the row's KV cache) give the samples of
    episodes that prefill the whole history every turn: the same ids, mask and log-probs."""
    from asyncflow.engines.inference import InferenceEngine
    from asyncflow.engines.tiny import build_tiny_model

    out, extends = {}, []
    for keep in (True, False):
        engine = InferenceEngine(build_tiny_model(TOK, seed=0), eos_id=EOS, pad_id=0, max_batch=4, seed=0)
        if keep:
            make = engine.new_batch

            def counting(sp, make=make):
                batch = make(sp)
                inner = batch.extend
                batch.extend = lambda *a, **k: extends.append(a[0]) or inner(*a, **k)
                return batch

            engine.new_batch = counting
        else:
            engine.new_batch = lambda sp, make=engine.new_batch: _Plain(make(sp))
        calls = EnvCalls(4, 5.0)
        runner = EpisodeRunner(TOK, lambda: Echo(obs=" ok, go on ", turns=3), Limits(3, 60, 8), calls)
        try:
            trajs = run_episodes(engine, SamplingParams(0.0, max_new_tokens=8), runner, _rows(3, "q7"))
        finally:
            calls.close()
        out[keep] = sorted(trajs, key=lambda t: t.key)
    assert len(extends) == 3 * 2  # two continued turns an episode
    for a, b in zip(out[True], out[False], strict=True):
        assert (a.prompt_ids, a.response_ids, a.loss_mask, a.turns) == (b.prompt_ids, b.response_ids, b.loss_mask, 3)
        # float32 log-probs (|x| <= ~5) summed in other orders: measured differences <= 1e-6
        assert a.logprobs == pytest.approx(b.logprobs, rel=1e-5, abs=2e-6)
