"""Pipeline calibration: what the cost curves miss, measured step by step in real runs.

``asyncflow profile`` ends with short real runs of the job on its own launcher (one torch
thread per role) and decomposes their timeline traces (every ``Role.work`` span, wall
clock; ``trace.json``). Every quantity is taken **per step** and summarised over the steady
steps (1 .. N-1) with a median, never as a whole-run mean, so a step slowed by another
job on a shared machine cannot move it:

* :func:`sync_steps`: the steps of a colocated ``sync`` run (a step ends with the actor's
  last span before the next rollout span; the roles take turns, so this is exact);
* :func:`fit_pipeline` (the one-thread sync run):

  - each role's **pipeline factor**: its busy seconds per step over the calibrated curves'
    prediction, the **median** over the steps (a whole-run mean let a few slow steps move
    it; the lower quartile, tried first, predicted the actor of the stream run a minute
    later 5-26% too fast in three of four profiles on this shared machine, the median
    -16% to +10%: what is predicted is a run's typical step, under the load of the time);
  - ``step_overhead_s`` (paid whole by sync): the **median** step time outside every role
    (driver round trip, data-plane hops, prompt fetch);
  - ``data_latency_s``: the **median** time from rollout's last span to the actor's first
    span, less the reward work between them: the data-plane hops (rollout -> reward ->
    trainer) a finished group takes; stream pays it on its critical path every step;

* :func:`actor_steps` (a short ``async`` run, one thread per role):

  - ``actor_overhead_s``: the **median** idle time between one step's last actor span
    (optimizer step + publish) and the next step's first micro-batch, whose rows were
    prefetched: the driver's round trip as it is with the other roles busy beside it
    (20-23 ms in a run where the sync run's whole step boundary was ~14 ms: the driver and
    the data plane compete with a busy rollout);
  - ``interference`` (:func:`overlap_interference`): how much slower the actor's
    micro-batches ran while rollout computed beside them than those that ran alone, in
    the same run (so other jobs' load cancels); it replaces a synthetic measurement
    (training beside a decoding process, measured separately).

Invariant: the quantities are disjoint pieces of measured time (role busy seconds, gaps
between spans), so none absorbs another's error. Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asyncflow.planner.costs import ProfiledCost
from asyncflow.planner.search import predict

if TYPE_CHECKING:
    from asyncflow.config import RunConfig

Tracks = dict[str, list[tuple]]  # role -> [(start s, seconds[, name])], sorted by start (observe.trace.named_tracks)


def sync_steps(tracks: Tracks) -> list[dict]:
    """Per step of a sync run after step 0: ``seconds`` (end to end), ``busy`` per role and
    ``data_gap`` (rollout's last span end -> the actor's first span start, less the reward
    busy in between)."""
    spans = sorted(((s, d, r) for r, v in tracks.items() for s, d, *_ in v), key=lambda x: x[0])
    ends = [s + d for i, (s, d, r) in enumerate(spans)
            if r == "actor" and (i + 1 == len(spans) or spans[i + 1][2] == "rollout")]
    out = []
    for t0, t1 in zip(ends, ends[1:]):
        inside = [(s, d, r) for s, d, r in spans if t0 < s < t1]
        busy = {r: sum(d for s, d, q in inside if q == r) for r in tracks}
        roll = [s + d for s, d, r in inside if r == "rollout"]
        act = [s for s, d, r in inside if r == "actor"]
        gap = None
        if roll and act:
            last, first = max(roll), min(act)
            gap = first - last - sum(d for s, d, r in inside if r not in ("rollout", "actor") and last <= s < first)
        out.append({"seconds": t1 - t0, "busy": busy, "data_gap": gap})
    return out


def fit_pipeline(run: RunConfig, prof: dict, tracks: Tracks, ncpu: int) -> dict:
    """Role factors, sync step overhead and data latency of the one-thread sync run ``run``
    (its trace ``tracks``), against the simulator's prediction on the profile ``prof``."""
    steps = sync_steps(tracks)
    if not steps:
        raise ValueError("the calibration run's trace has fewer than two steps")
    pred = predict(run, ProfiledCost.from_dict(prof), prof, ncpu, steps=run.train.steps, evaluate=False)
    per_step = pred.steady_s / (run.train.steps - 1)
    factors = {}
    for r in ("rollout", "actor"):
        busy = [s["busy"].get(r, 0.0) for s in steps]
        if pred.busy[r] > 0 and min(busy) > 0:
            factors[r] = float(np.median(busy)) / (pred.busy[r] * per_step)
    outside = [s["seconds"] - sum(s["busy"].values()) for s in steps]
    gaps = [s["data_gap"] for s in steps if s["data_gap"] is not None]
    return {"step_overhead_s": max(0.0, float(np.median(outside))), "role_factor": factors,
            "data_latency_s": max(0.0, float(np.median(gaps))) if gaps else 0.0,
            "sync_step_s_measured": float(np.median([s["seconds"] for s in steps])),
            "sync_step_s_curves": per_step}


def _actor_chunks(tracks: Tracks, steps: int) -> list[list[tuple]]:
    """The actor's spans per step: cut after each ``step`` span (a real run names them); an older
    trace without names, in equal chunks (the actor made the same number of spans every step
    before its fetches became greedy); empty when neither works."""
    spans = tracks.get("actor", [])
    if any(len(x) > 2 and x[2] == "step" for x in spans):
        out, cur = [], []
        for x in spans:
            cur.append(x)
            if len(x) > 2 and x[2] == "step":
                out.append(cur)
                cur = []
        return out if len(out) == steps else []
    if not spans or len(spans) % steps:
        return []
    k = len(spans) // steps
    return [spans[v * k:(v + 1) * k] for v in range(steps)]


def actor_steps(tracks: Tracks, steps: int) -> list[dict]:
    """Per step 1 .. N-2 of a stream/async run of ``steps`` steps: the actor's ``busy``
    seconds and its idle ``gap`` before the next step's first span."""
    chunks = _actor_chunks(tracks, steps) if steps >= 3 else []
    out = []
    for v in range(1, len(chunks) - 1):
        end = chunks[v][-1][0] + chunks[v][-1][1]
        out.append({"busy": sum(x[1] for x in chunks[v]), "gap": chunks[v + 1][0][0] - end})
    return out


def overlap_interference(tracks: Tracks, steps: int, alone: float = 0.2, beside: float = 0.5) -> float:
    """The simulator's ``interference`` (``>= 1``) measured inside one stream/async run of
    ``steps`` steps: the actor's training spans (every span of a step but its last, the
    optimizer step and publish; steps 1 ..) are split by the fraction ``f`` of their time that
    rollout was busy beside them; with ``base`` the median duration of those that ran (almost)
    alone (``f < alone``), every one mostly beside rollout (``f >= beside``) implies
    ``1 + (d / base - 1) / f`` (the simulator stretches the overlapped part of a span by the
    interference); the median. Both groups come from the same seconds of the same run, so
    other jobs' load, which moves a whole run by up to 2x on a shared machine, cancels (fitting
    the simulator to the async run's actor against the sync run's gave 1.4 and 4.0 where this
    gives 1.2 and 1.0-1.4 on the same runs). 1 when either group has fewer than 3 spans. (With
    greedy fetches a span's rows vary, so durations vary with them: the median of many keeps
    the estimate, and a trace without enough spans gives 1.)"""
    chunks, roll = _actor_chunks(tracks, steps) if steps >= 2 else [], tracks.get("rollout", [])
    d, f = [], []
    for chunk in chunks[1:]:
        for s, dur, *_ in chunk[:-1] if len(chunk) > 1 else chunk:
            if dur <= 0:
                continue
            d.append(dur)
            f.append(sum(max(0.0, min(s + dur, rs + rd) - max(s, rs)) for rs, rd, *_ in roll) / dur)
    d_, f_ = np.asarray(d), np.asarray(f)
    if not len(d_):
        return 1.0
    iso, near = d_[f_ < alone], f_ >= beside
    if len(iso) < 3 or near.sum() < 3:
        return 1.0
    base = float(np.median(iso))
    return max(1.0, float(np.median(1 + (d_[near] / base - 1) / f_[near])))


def stream_pieces(tracks: Tracks) -> dict[str, float]:
    """A short one-thread-per-role ``stream`` run's chain, per step (:func:`asyncflow.planner.terms.step_terms`):
    ``transfer_s`` (publish -> rollout's swap), ``fetch_s`` (rollout's prompt fetch: one data-plane
    round trip) and ``data_latency_s`` (rollout's last span -> the actor's first ``train``: the rows'
    put -> get hop). The sync run cannot give the last two any more: its rollout hands the rows
    to its actor in memory (rewards in rollout), and fetches prompts inside its step overhead."""
    from asyncflow.planner.terms import step_terms  # (terms imports the simulator's result type)

    t = step_terms({"traceEvents": []} if not tracks else _as_trace(tracks), "stream")
    out = {}
    for src, dst in (("transfer_s", "transfer_s"), ("fetch_s", "fetch_s"), ("data_s", "data_latency_s")):
        if src in t:
            out[dst] = max(0.0, t[src])
    return out


def _as_trace(tracks: Tracks) -> list[tuple[str, str, float, float]]:
    """Named tracks back as spans (role, name, start, seconds): what :func:`step_terms` also reads."""
    return [(role, x[2] if len(x) > 2 else role, x[0], x[1]) for role, v in tracks.items() for x in v]
