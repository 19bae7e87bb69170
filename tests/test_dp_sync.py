"""Data-parallel ``sync`` (``mode=sync train.dp=N``): N colocated workers, one step together.

* The plan: N colocated workers (ranks), every role on each but PPO's critic (rank 0 only),
  ``cpus // N`` threads each; rank ``r``'s share of a step is prompts ``r, r + N, ...``.
* :class:`ShardSampler` splits rows by their ``shard`` tag and crosses the zmq protocol.
* With a deterministic rollout (the fake engine, answers a function of the prompt), a
  2-rank sync run ends with the weights of the 1-rank sync run on the same rows (to 1e-5),
  on both ranks, and each rank generated (and referenced) only its own prompts: GRPO, with
  the KL term, with token-mean (each rank trains its own rows: the token count must be the
  step's, summed over the ranks), PPO (its critic on rank 0) and a batch-level estimator with
  token-mean (token-balanced chunks of the whole step). Each group-level run's ranks trained
  exactly their own shard's rows, and the step's metrics count every rank's.
* The ranks' metrics summed by hand (``merge_shares``).
* A real 2-rank run (the built-in engine sampling with the rank's own model): both ranks end
  every step with identical weights, every sample trained once; and the same on Ray.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import asyncflow.workflow.builders as builders
from asyncflow.api import train
from asyncflow.config import load_config
from asyncflow.dataplane import ShardSampler
from asyncflow.dataplane.transport.protocol import sampler_from_msg, sampler_to_msg
from asyncflow.engines.fake import FakeEngine
from asyncflow.launch.local import LocalLauncher
from asyncflow.tasks.addition import AdditionTask
from asyncflow.workflow.job import merge_shares
from asyncflow.workflow.plan import plan_workers, sync_share
from asyncflow.workflow.worker import Worker

GROUP, PROMPTS, STEPS = 4, 4, 2
SYNC_STEP = Worker._sync_step
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


def config(tmp_path, dp: int, *extra: str):
    return load_config(None, [
        "launcher=local", "warmstart.enabled=false", "progress=false", "mode=sync", f"train.steps={STEPS}",
        f"train.prompts_per_step={PROMPTS}", f"train.micro_prompts={PROMPTS}", f"rollout.group_size={GROUP}",
        "rollout.max_new_tokens=6", f"train.dp={dp}", "resources.sync_threads=1", "train.lr=3e-3", *TINY,
        f"run_dir={tmp_path}", *extra])


class Spy(LocalLauncher):
    """The local launcher, keeping every worker it built."""

    def __init__(self) -> None:
        super().__init__()
        self.built: list[Worker] = []
        self.initial: list[dict] = []

    def spawn(self, spec, cls, *args):
        w = super().spawn(spec, cls, *args)
        self.built.append(w)
        self.initial.append(weights(w))
        return w


def weights(w: Worker) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in w.model.named_parameters()}


def test_plan_and_shares():
    cfg = load_config(None, ["mode=sync", "train.dp=2", "train.prompts_per_step=5", "algorithm.name=ppo"])
    specs = plan_workers(cfg, ncpu=4)
    assert [(s.name, s.rank, s.threads, s.cpus) for s in specs] == [("colocated", 0, 2, 2.0),
                                                                    ("colocated.1", 1, 2, 2.0)]
    assert "critic" in specs[0].roles and "critic" not in specs[1].roles
    assert all({"rollout", "actor"} <= set(s.roles) and "reward" not in s.roles for s in specs)  # scored in rollout
    assert [sync_share(cfg, r) for r in (0, 1)] == [3, 2]
    one = plan_workers(load_config(None, ["mode=sync"]), ncpu=4)
    assert [(s.name, s.threads, s.cpus) for s in one] == [("colocated", 4, 4.0)]  # unchanged


def test_shard_sampler_splits_rows_and_crosses_the_wire():
    tags = {"shard": {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}}
    assert ShardSampler(0).sample([0, 1, 2, 3, 4], 2, tags) == ([0, 2], [0, 2])
    assert ShardSampler(1).sample([0, 1, 2, 3, 4], 9, tags) == ([1, 3], [1, 3])
    assert ShardSampler(2).sample([0, 1], 2, tags) == ([], [])
    with pytest.raises(ValueError, match="shard"):
        ShardSampler(0).sample([7], 1, tags)
    s = ShardSampler(1)
    assert sampler_from_msg(sampler_to_msg(s)) == s


def scripted(monkeypatch) -> dict:
    """Rollout by the fake engine: the k-th answer to a prompt is its right answer for even
    k, a wrong one for odd k (so every group has a signal), whichever rank asks."""
    seen: dict = {}
    lock = threading.Lock()

    def engine(ctx):
        tok = ctx.tokenizer

        def answer(req, sp):
            with lock:
                k = seen[tuple(req.prompt_ids)] = seen.get(tuple(req.prompt_ids), -1) + 1
            text = bytes(bytearray(req.key[1])).decode() + ("" if k % 2 == 0 else str(k))
            return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

        return FakeEngine(answer=answer, logprob=lambda version, pos: -0.5 - 0.1 * pos,
                          eos_id=tok.eos_token_id, max_batch=ctx.cfg.rollout.max_batch)

    monkeypatch.setattr(builders, "_inference_engine", engine)
    return seen


def snapshots(monkeypatch) -> dict[tuple[int, int], dict]:
    """Every rank's weights at the end of every sync step: ``{(step, rank): weights}``."""
    out: dict[tuple[int, int], dict] = {}
    sync_step = SYNC_STEP  # (not an earlier spy)

    def spy(self, v):
        m = sync_step(self, v)
        out[v, self.rank] = weights(self)
        return m

    monkeypatch.setattr(Worker, "_sync_step", spy)
    return out


def run(tmp_path, monkeypatch, dp: int, *extra: str) -> tuple[dict, list[Worker], dict, dict]:
    torch.set_num_threads(1)
    scripted(monkeypatch)
    snaps = snapshots(monkeypatch)
    launcher = Spy()
    summary = train(config(tmp_path / f"dp{dp}", dp, *extra), launcher=launcher, evaluate=False)
    return summary, sorted(launcher.built, key=lambda w: w.rank), launcher.initial[0], snaps


@pytest.mark.parametrize("extra", [(), ("algorithm.kl_coef=0.1",), ("algorithm.name=ppo",),
                                   ("algorithm.loss_agg=token-mean",),
                                   ("algorithm.name=reinforce_pp", "algorithm.loss_agg=token-mean")],
                         ids=["grpo", "grpo+kl", "ppo (critic on rank 0)", "grpo token-mean (own rows)",
                              "reinforce_pp token-mean"])
def test_two_ranks_end_every_step_with_the_one_rank_weights(tmp_path, monkeypatch, extra):
    single, _, init, one = run(tmp_path, monkeypatch, 1, *extra)
    summary, ranks, _, two = run(tmp_path, monkeypatch, 2, *extra)
    assert summary["samples"] == single["samples"] == STEPS * PROMPTS * GROUP
    for r, w in enumerate(ranks):
        # each rank generated (and referenced) only its share: prompts r, r + 2 of each step
        assert w.roles["rollout"].items == STEPS * sync_share(w.cfg, r) * GROUP
        # rows handed to the rank's actor in memory where rollout writes all it reads (not with KL, PPO, batch-level)
        assert (w.roles["actor"].local is not None) == (extra in [(), ("algorithm.loss_agg=token-mean",)])
        # and a group-level estimator trains just those rows on that rank (batch-level: every row of the step)
        assert w.roles["actor"].items == STEPS * (sync_share(w.cfg, r) * GROUP if "reinforce_pp" not in
                                                  " ".join(extra) else PROMPTS * GROUP)
        if "reference" in w.roles:
            assert w.roles["reference"].items == STEPS * sync_share(w.cfg, r) * GROUP
    assert sorted(one) == [(v, 0) for v in range(STEPS)] and sorted(two) == [(v, r) for v in range(STEPS)
                                                                              for r in (0, 1)]
    for v in range(STEPS):
        want = one[v, 0]
        moved = max(np.abs(want[n] - (init if v == 0 else one[v - 1, 0])[n]).max() for n in init)
        assert moved > 1e-3  # not vacuous: each step moved the weights
        for r in (0, 1):
            for n in want:
                np.testing.assert_allclose(two[v, r][n], want[n], atol=1e-5, rtol=1e-5, err_msg=f"step {v} rank {r} {n}")
    assert all(np.array_equal(weights(w)[n], two[STEPS - 1, w.rank][n]) for w in ranks for n in init)


def test_real_two_rank_run_keeps_the_ranks_identical_every_step(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    launcher = Spy()
    cfg = config(tmp_path, 2)
    by = snapshots(monkeypatch)
    # the untrained tiny model is never right: reward answer lengths instead, so groups carry a signal
    monkeypatch.setattr(AdditionTask, "reward", lambda self, prompt, response, answer: float(len(response) % 2))
    summary = train(cfg, launcher=launcher, evaluate=False)
    assert summary["samples"] == STEPS * PROMPTS * GROUP
    w0, w1 = sorted(launcher.built, key=lambda w: w.rank)
    for w in (w0, w1):  # the rollout engine decodes with the rank's own (trained) model
        assert w.roles["rollout"].engine.model is w.model is w.roles["actor"].engine.model
        assert w.roles["rollout"].items == STEPS * PROMPTS * GROUP // 2
    assert sorted(by) == [(v, r) for v in range(STEPS) for r in (0, 1)]
    for v in range(STEPS):
        for n, p in by[v, 0].items():
            np.testing.assert_allclose(by[v, 1][n], p, atol=1e-6, rtol=1e-5, err_msg=f"step {v} {n}")
    assert any(np.abs(by[1, 0][n] - by[0, 0][n]).max() > 1e-4 for n in by[0, 0])  # not vacuous: it trained


@pytest.mark.ray
def test_ray_two_rank_sync_run(tmp_path):
    summary = train(config(tmp_path, 2, "launcher=ray"), evaluate=False)
    assert summary["samples"] == STEPS * PROMPTS * GROUP
    assert {"actor", "actor.1", "rollout", "rollout.1"} <= set(summary["busy"])


def test_merge_shares_hand_computed():
    r0 = {"samples": 2, "tokens": 5, "reward": 1.0, "response_len": 2.5, "max_staleness": 0, "groups": [4],
          "loss": 0.5, "version": 3}
    r1 = {"samples": 6, "tokens": 9, "reward": 0.5, "response_len": 1.5, "max_staleness": 1, "groups": [1, 7],
          "loss": 9.0, "version": 3, "dp_share": True}
    m = merge_shares([r0, r1])
    # rewards (2 x 1.0 + 6 x 0.5) / 8 = 0.625; lengths (2 x 2.5 + 6 x 1.5) / 8 = 1.75; loss: rank 0's
    assert m == {"samples": 8, "tokens": 14, "reward": 0.625, "response_len": 1.75, "max_staleness": 1,
                 "groups": [1, 4, 7], "loss": 0.5, "version": 3}
