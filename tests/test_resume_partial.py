"""Partial rollout across a restart: answers in flight at a checkpoint continue from their
saved tokens (:mod:`asyncflow.workflow.rollout.inflight`).

* the built-in engine: ``partials()`` then ``resume()`` in a fresh engine (another process's
  model, same weights) gives exactly the uninterrupted answers (greedy), with the log-probs a
  full recompute gives and every token's version kept;
* the rollout role on the fake engine with the real feeder and data plane: a run "killed" at
  random step boundaries (rollout going on for a random while after the step's trainer
  finished), its in-flight snapshot round-tripped through safetensors/JSON, resumed in a fresh
  role: every prompt group of steps ``0..N-1`` is trained exactly once, the bound holds for
  every row (continued ones too), continued answers keep their saved tokens and are the
  uninterrupted answers, and groups too old for the bound restart from their prompts.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load, save
from test_fake_engine import StagedWeights

from asyncflow.config import load_config
from asyncflow.dataplane import DataPlane
from asyncflow.engines.fake import FakeEngine
from asyncflow.engines.inference import InferenceEngine, Request, SamplingParams
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model
from asyncflow.engines.training import TrainEngine
from asyncflow.tasks.registry import build_task
from asyncflow.workflow.rollout import inflight
from asyncflow.workflow.feeder import PromptFeeder
from asyncflow.workflow.fields import SCHEMA
from asyncflow.workflow.rollout import RolloutRole

torch.set_num_threads(1)
PAD, BOS, EOS = 0, 1, 2


def test_the_builtin_engine_continues_saved_answers_in_a_fresh_engine_exactly():
    tok = build_char_tokenizer()
    sp = SamplingParams(temperature=0.0, max_new_tokens=14)
    prompts = [[BOS, *tok(t).input_ids] for t in ["1+2=", "12+34=", "=", "123+45="]]

    def reqs():
        return [Request(i, p, min_new_tokens=14) for i, p in enumerate(prompts)]

    whole = {c.key: c for c in InferenceEngine(build_tiny_model(tok, seed=0), EOS, PAD).generate(reqs(), sp)}
    first = InferenceEngine(build_tiny_model(tok, seed=0), EOS, PAD)
    first.version = 3
    batch = first.new_batch(sp)
    batch.add(reqs())
    for _ in range(5):
        batch.step()
    saved = batch.partials()
    assert [len(p.response_ids) for p in saved] == [6] * 4 and len(batch) == 4  # (copies; the rows stay live)
    model = build_tiny_model(tok, seed=0)  # the restarted process: same weights, a new version tag
    second = InferenceEngine(model, EOS, PAD)
    second.version = 5
    again = second.new_batch(sp)
    assert again.resume(saved) == [] and len(again) == 4
    done = []
    while len(again):
        done += again.step()
    for c in done:
        assert c.response_ids == whole[c.key].response_ids  # greedy: the uninterrupted answer
        assert c.token_versions == [3] * 6 + [5] * 8 and c.version == 3
        np.testing.assert_allclose(c.logprobs, whole[c.key].logprobs, atol=1e-5, rtol=1e-5)
    recomputed = TrainEngine(model, pad_id=PAD).logprobs([c.prompt_ids for c in done], [c.response_ids for c in done])
    for c, lp in zip(done, recomputed):
        np.testing.assert_allclose(c.logprobs, lp, atol=1e-4, rtol=1e-5)


N, P, G, K = 12, 4, 2, 2


def lengths(req, sp):
    """Answer lengths by prompt id: one group in 3 is long (a straggler), the others short."""
    gid = req.key[0]
    n = 20 if random.Random(gid).random() < 1 / 3 else 2 + gid % 3
    return [4 + j % 10 for j in range(n)]


def new_role(plane, k, on_swap="continue"):
    eng = FakeEngine(answer=lengths, max_batch=64)
    role = RolloutRole(eng, plane, SamplingParams(max_new_tokens=32), group_size=G, prompts_per_step=P, staleness=k,
                       weights=StagedWeights(eng), on_swap=on_swap, by_prompt_id=True)
    role.collector.flush_s = 0.0
    return role


def train_steps(role, plane, feeder, steps, rows, polls_after=0):
    """Train ``steps`` (each as soon as its rows are in), staging the next version; then let
    rollout go on for ``polls_after`` polls (the run continues until the kill)."""
    for v in steps:
        feeder.fill(v + K + 3)
        for _ in range(2000):
            if role.state.produced[v] >= P * G:
                break
            role.poll(0.001)
        _, data = plane.get_batch("actor", ["group", "version", "token_versions", "response_ids"], n=P * G,
                                  partition=v)
        rows[v] = [(int(g), int(w), t.tolist(), r.tolist()) for g, w, t, r in
                   zip(data["group"], data["version"], data["token_versions"], data["response_ids"])]
        role.weights.stage(v + 1)
    for _ in range(polls_after):
        role.poll(0.001)


@pytest.mark.parametrize("seed", range(6))
def test_a_rollout_resumed_at_random_boundaries_trains_every_group_once_within_the_bound(seed):
    rng = random.Random(seed)
    k, on_swap = [(K, "continue"), (1, "continue"), (K, "discard")][seed % 3]
    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    tok, task = build_char_tokenizer(), build_task(cfg)
    plane = DataPlane(SCHEMA)
    feeder = PromptFeeder(cfg, tok, task, plane)
    role, rows, done, totals = new_role(plane, k, on_swap), {}, 0, {"continued": 0, "restarted": 0}
    for kill in sorted(rng.sample(range(2, N - 1), 2)):
        train_steps(role, plane, feeder, range(done, kill), rows, polls_after=rng.randrange(0, 12))
        tensors, meta = inflight.capture(role, kill)
        trained = {g for v in range(kill) for g, *_ in rows[v]}
        before = {(r["group"], j): (tensors[f"rollout/{j}/response"].tolist(),
                                    tensors[f"rollout/{j}/versions"].tolist()) for j, r in enumerate(meta["answers"])}
        tensors = load(save(tensors))  # what the checkpoint file holds
        plane = DataPlane(SCHEMA)  # the restarted run: a fresh data plane, engine and role
        role = new_role(plane, k, on_swap)
        role.weights.stage(kill)
        continued = role.resume(kill, kill, 1.0, (tensors, meta))
        assert not set(continued) & trained
        assert set(continued) <= {g for g, _ in before} and meta["started"] >= kill * P
        feeder = PromptFeeder(cfg, tok, task, plane)
        feeder.resume(kill, trained | set(continued), len(continued))
        in_flight = (meta["started"] - kill * P) * G
        totals["continued"] += len(continued) * G
        totals["restarted"] += in_flight - len(continued) * G
        done = kill
        saved = {(g, j): r for (g, j), r in before.items() if g in continued}
        train_steps(role, plane, feeder, range(done, done + 1), rows)
        done += 1
        for v in range(kill, done):
            for g, _, tv, resp in rows[v]:
                if g in continued:  # a continued answer starts with the tokens (and their versions) it had
                    assert any(resp[:len(r)] == r and tv[:len(r)] == t for (gg, _), (r, t) in saved.items() if gg == g)
    train_steps(role, plane, feeder, range(done, N), rows)
    trained = [g for v in range(N) for g, *_ in rows[v]]
    assert sorted(set(trained)) == list(range(N * P)) and len(trained) == N * P * G  # every group once, whole
    for v in range(N):
        for g, w, tv, resp in rows[v]:
            assert 0 <= v - w <= k and min(tv) >= w and max(tv) <= v, (v, g, w, tv)
            assert resp == lengths(Request((g, None), []), None)  # the answer an uninterrupted run gives
            if on_swap == "discard":
                assert len(set(tv)) == 1
    if on_swap == "continue":
        assert totals["continued"] > 0, totals


def test_a_group_too_old_for_the_bound_restarts_from_its_prompt():
    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    plane = DataPlane(SCHEMA)
    feeder = PromptFeeder(cfg, build_char_tokenizer(), build_task(cfg), plane)
    role, rows = new_role(plane, K), {}
    train_steps(role, plane, feeder, range(3), rows, polls_after=3)
    tensors, meta = inflight.capture(role, 3)
    assert any("placed" in r for r in meta["answers"])  # (finished groups of steps >= 3, not trained)
    running = {r["group"]: r["version"] for r in meta["answers"] if "placed" not in r}
    placed = {r["group"] for r in meta["answers"] if "placed" in r}
    assert running, "nothing running"
    fresh = new_role(DataPlane(SCHEMA), K)
    late = max(r["version"] for r in meta["answers"]) + K + 1  # past every saved group's deadline (and step)
    fresh.weights.stage(late)
    assert fresh.resume(late, late, 1.0, (tensors, meta)) == [] and len(fresh.batch) == 0
    ok = new_role(DataPlane(SCHEMA), K)
    ok.weights.stage(3)
    kept = ok.resume(3, 3, 1.0, (tensors, meta))
    assert sorted(kept) == sorted(placed | {g for g, w in running.items() if w + K >= 3})
    assert len(ok.batch) == sum(1 for r in meta["answers"] if "placed" not in r and not r["finished"])

def _two_steps_in():
    """A rollout role two trained steps into a run, with answers in flight."""
    cfg = load_config(None, [f"train.steps={N}", f"train.prompts_per_step={P}", "train.micro_prompts=1", "seed=3"])
    plane = DataPlane(SCHEMA)
    feeder = PromptFeeder(cfg, build_char_tokenizer(), build_task(cfg), plane)
    role = new_role(plane, K)
    train_steps(role, plane, feeder, range(2), {}, polls_after=2)
    return role


def test_the_snapshot_is_taken_by_rollouts_own_loop_and_a_stopped_loop_is_an_error():
    role = _two_steps_in()
    got: dict = {}
    asker = threading.Thread(target=lambda: got.update(snap=role.snapshot_in_flight(5.0, 2)))
    asker.start()
    t = time.monotonic()
    while not role.asked:
        assert time.monotonic() - t < 5
        time.sleep(0.001)
    expected = inflight.capture(role, 2)  # the groups in flight now, before the loop's next poll serves it
    role.poll(0.001)
    asker.join(5.0)
    tensors, meta = got["snap"]
    assert meta == expected[1] and meta["answers"] and meta["started"] >= 2 * P
    assert all(np.array_equal(tensors[k], v) for k, v in expected[0].items()) and tensors.keys() == expected[0].keys()
    role.error = RuntimeError("rollout died")  # (its loop is gone: the request is never served)
    with pytest.raises(RuntimeError, match="rollout died"):  # (the loop's own error, as its health check raises)
        role.snapshot_in_flight(5.0, 2)


def test_two_snapshot_requests_before_one_poll_are_both_served():
    """Two checkpoints ask before rollout's loop polls once (a loop held up under load, two
    checkpoints a step apart): the first request must not be replaced by the second (it waited
    out its deadline, and its checkpoint was lost without a word; CI's Ray kill test took 100 s)."""
    role = _two_steps_in()
    got: dict = {}
    askers = [threading.Thread(target=lambda d=d: got.update({d: role.snapshot_in_flight(3.0, d)})) for d in (1, 2)]
    for a in askers:
        a.start()
    t = time.monotonic()
    while len(role.asked) < 2:
        assert time.monotonic() - t < 5
        time.sleep(0.001)
    role.poll(0.001)
    for a in askers:
        a.join(5.0)
    assert sorted(got) == [1, 2] and not role.asked
    assert got[1][1]["answers"] and got[2][1]["answers"]
