"""The simulator's newer terms on hand-computed cases (hand-set costs, seconds exact): greedy
fetches and length-sorted passes, the evaluator beside training or pausing it, checkpoint
copies beside the next step, data-parallel sync ranks, and the hooks of multi-turn episodes,
tensor parallelism and adapter-only weight syncs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asyncflow.planner.costs import ConstantCost
from asyncflow.planner.sim import Allocation, Workload, simulate, sorted_passes


@dataclass
class PaddedCost(ConstantCost):
    """Training costs 0.1 s per padded token: rows x (prompt + longest answer)."""

    def train_s(self, rows: int, padded_len: int, res: int) -> float:
        return 0.1 * rows * padded_len


def test_sorted_passes_cut_longest_first():
    assert sorted_passes([1, 4, 2, 4, 3], 2) == [[1, 3], [4, 2], [0]]


def test_a_greedy_trainer_takes_every_ready_group_and_the_next_fetch_travels_meanwhile():
    # stream, 4 groups of one answer, lengths 1..4 (one decode round of 1 s per token); rollout
    # sends its outbox when a round ends >= 20 ms after its oldest group: g0 (t=1) and g1 go at
    # t=2, g2 and g3 at t=4 (the step complete). Greedy: the first fetch takes g0, g1 at t=2 and
    # trains them (2 passes of one row, 0.5 s each) until t=3; the second, in flight meanwhile,
    # returns g2, g3 at t=4: trained until t=5, the step span until t=6.
    wl = Workload(prompts_per_step=4, group_size=1, prompt_len=0, steps=2, length_seq=[1, 2, 3, 4],
                  reward_in_rollout=True, greedy=True, sorted_passes=True)
    cost = ConstantCost(decode=1.0, train_per_row=0.5, step=1.0, pieces=(0.0, 0.0, 0.0))
    r = simulate(wl, Allocation("stream", micro_prompts=1, slots=8), cost)
    actor = [(w, s, d) for role, w, s, d in r.spans if role == "actor" and s < 6]
    assert actor == [("train", 2.0, 1.0), ("train", 4.0, 1.0), ("step", 5.0, 1.0)]
    assert r.step_end[0] == pytest.approx(6.0)
    # one micro-batch at a time instead: 4 fetches (the end is the same: rollout is the limit)
    one = simulate(Workload(**{**wl.__dict__, "greedy": False}), Allocation("stream", micro_prompts=1, slots=8), cost)
    assert [w for role, w, s, _ in one.spans if role == "actor" and s < 6] == ["train"] * 4 + ["step"]


def test_sync_trains_the_step_in_length_sorted_passes():
    # 4 answers of 1, 4, 1, 4 tokens (4 decode rounds of 1 s), passes of 2 rows at 0.1 s per padded
    # token: sorted [4, 4] + [1, 1] = 0.8 + 0.2 s; in arrival order [1, 4] + [1, 4] = 0.8 + 0.8 s
    wl = dict(prompts_per_step=4, group_size=1, prompt_len=0, steps=2, length_seq=[1, 4, 1, 4], reward_in_rollout=True)
    cost = PaddedCost(decode=1.0, step=1.0)
    sync = Allocation("sync", micro_prompts=2, slots=8)
    assert simulate(Workload(**wl, sorted_passes=True), sync, cost).step_end[0] == pytest.approx(4 + 1.0 + 1)
    assert simulate(Workload(**wl), sync, cost).step_end[0] == pytest.approx(4 + 1.6 + 1)


EVAL = dict(prompts_per_step=1, group_size=1, prompt_len=0, lengths={1: 1.0}, steps=6, eval_every=2,
            reward_in_rollout=True)
ONE = ConstantCost(decode=1.0, train_per_row=0.5, step=0.5, evaluation=5.0, pieces=(0.0, 0.0, 0.0))


def test_an_evaluation_beside_training_holds_no_step_back_and_a_due_one_is_skipped_while_one_runs():
    # async, 1 s a step; evaluations due after steps 2 and 4 (not after the last): the first runs
    # 5 s beside the steps, so the second is skipped; samples/s as without evaluations
    alloc = Allocation("async", micro_prompts=1, staleness=50, slots=4)
    none = simulate(Workload(**{**EVAL, "eval_every": 0}), alloc, ONE)
    beside = simulate(Workload(**EVAL, eval_beside=True), alloc, ONE)
    assert beside.samples_per_s == pytest.approx(none.samples_per_s)
    assert beside.counts["eval_beside"] == 1 and beside.counts["eval_skipped"] == 1
    assert [d for role, _, _, d in beside.spans if role == "evaluator"] == [pytest.approx(5.0, rel=1e-9)]
    # pausing the trainer instead: each due evaluation adds its 5 s to the window (steps 1..5)
    pause = simulate(Workload(**EVAL), alloc, ONE)
    assert pause.steady_s == pytest.approx(none.steady_s + 10.0) and pause.counts["eval_pause"] == 2


def test_the_evaluator_at_nice_19_gets_no_core_while_the_roles_take_them_all():
    # stream on one core: rollout and the trainer take turns and leave no idle core, so the
    # evaluation due after step 2 computes only once the last step is done (up to one quantum of
    # the simulator's time sharing, taken at an instant where one role handed over to the other)
    from asyncflow.planner.sim import QUANTUM_S

    wl = Workload(**EVAL, eval_beside=True)
    r = simulate(wl, Allocation("stream", micro_prompts=1, slots=4), ONE, cores=1)
    (start, dur), = [(s, d) for role, _, s, d in r.spans if role == "evaluator"]
    assert start == pytest.approx(r.step_end[1])
    assert start + dur == pytest.approx(r.step_end[-1] + 5.0, abs=QUANTUM_S + 1e-9)


def test_a_checkpoint_pauses_the_trainer_and_its_copy_holds_the_next_optimizer_step():
    # sync, 2 s a step (1 decode round, 0.5 s training, 0.5 s step); checkpoints after steps 2 and 4
    # (the last): pause 0.5 s each; the copy (3 s) beside step 3 delays its optimizer step to 7.5
    wl = Workload(prompts_per_step=1, group_size=1, prompt_len=0, lengths={1: 1.0}, steps=4, save_every=2,
                  checkpoint_last=True, reward_in_rollout=True)
    cost = ConstantCost(decode=1.0, train_per_row=0.5, step=0.5, checkpoint=(0.5, 3.0, 1.0))
    r = simulate(wl, Allocation("sync", micro_prompts=1, slots=4), cost)
    assert r.step_end == pytest.approx([2.0, 4.5, 8.0, 10.5])
    assert r.counts["checkpoint"] == 2
    assert [(w, s, d) for role, w, s, d in r.spans if role == "checkpoint"][:2] == [
        ("copy", pytest.approx(4.5), pytest.approx(3.0)), ("write", pytest.approx(7.5), pytest.approx(1.0))]


def test_data_parallel_sync_ranks_generate_their_share_and_step_together():
    # 4 prompts of one answer, 2 ranks: rank 0 generates prompts 0, 2 (1 token: 1 s), rank 1
    # prompts 1, 3 (3 tokens: 3 s); each trains its 2 rows (1 s); the step waits for rank 1
    # (t=4), then 0.5 s + the all-reduce 0.25 s on every rank
    wl = Workload(prompts_per_step=4, group_size=1, prompt_len=0, steps=2, length_seq=[1, 1, 3, 3],
                  reward_in_rollout=True, sorted_passes=True)
    cost = ConstantCost(decode=1.0, train_per_row=0.5, step=0.5, grad_allreduce=0.25)
    r = simulate(wl, Allocation("sync", micro_prompts=2, slots=8, ranks=2), cost, cores=2)
    assert r.step_end[0] == pytest.approx(4.75)
    assert {"rollout", "actor", "rollout.1", "actor.1"} <= {role for role, *_ in r.spans}
    with pytest.raises(ValueError, match="sync ranks"):
        simulate(wl, Allocation("sync", micro_prompts=2, slots=8, ranks=5), cost)


def test_hooks_change_nothing_by_default_and_land_as_parameters():
    base = dict(prompts_per_step=1, group_size=1, prompt_len=0, lengths={4: 1.0}, steps=3, reward_in_rollout=True)
    cost = ConstantCost(decode=1.0, prefill=0.25, train_per_row=1.0, step=0.5, export=1.0, transfer=2.0,
                        pieces=(0.0, 0.0, 0.0))
    sync = Allocation("sync", micro_prompts=1, slots=4)
    # a step: prefill 0.25 + 4 decode rounds + train 1 + step 0.5
    assert simulate(Workload(**base), sync, cost).step_end[0] == pytest.approx(5.75)
    # two turns, the environment answering in 5 s: 2 rounds, 5 s away, the context extended (a prefill), 2 rounds
    turns = simulate(Workload(**base, turns=2, env_latency_s=5.0), sync, cost)
    assert turns.step_end[0] == pytest.approx(5.75 + 5 + 0.25)
    assert turns.counts["extend"] == 3
    # adapter-only syncs: export (in the step span) and the transfer scale with the bytes moved;
    # stream pays both per step: (0.25 + 3 + 1 + 0.5 + export + transfer)
    stream = Allocation("stream", micro_prompts=1, slots=4)
    full = simulate(Workload(**base), stream, cost)
    lora = simulate(Workload(**base, sync_fraction=0.1), stream, cost)
    assert full.steady_s / 2 == pytest.approx(0.25 + 4 + 1 + 0.5 + 1.0 + 2.0)
    assert lora.steady_s / 2 == pytest.approx(0.25 + 4 + 1 + 0.5 + 0.1 + 0.2)
