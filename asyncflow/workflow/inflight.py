"""Rollout's groups not trained at a checkpoint: saved with it, kept on resume where they may be.

At a checkpoint of a ``stream``/``async`` run (``done`` steps trained) the driver asks the
rollout role for a snapshot at the step boundary (:class:`SnapshotRequest`: served by
rollout's own loop between two decode steps, so the batch is never read while it changes).
It holds

* the groups rollout **placed** in a step ``>= done`` (finished and scored, in its outbox or
  the data plane, not trained: rollout keeps each placed group until its weights reach a
  newer version than its step, :func:`forget_trained`), with their step and rewards;
* every **running** group whose answers are all accounted for: the finished ones (with or
  without their rewards) and the live ones (:meth:`partials
  <asyncflow.engines.inference.GenerationBatch.partials>`: tokens so far, their log-probs and
  per-token policy versions, the version that started the answer), with over-provisioning's
  flags (``soft``: no guaranteed slot; ``crossed``: running when a step filled, so carried
  over once placed). Groups waiting to restart after a swap (``on_swap=discard``) are not
  saved: they restart from their prompts;
* over-provisioning's **stalled** stragglers (answers thrown away, waiting to restart from
  the prompt as firm groups): their requests only, flagged ``stalled``;
* the **counters** the summary reports (``discarded``, ``carried``, ``stalls``, ``scored``,
  ``dropped``, ``decode_steps``: JSON ``counters``), and, with dynamic sampling, the self-feeding feeder's
  **position** (JSON ``prompts``: :meth:`PromptFeeder.position
  <asyncflow.workflow.feeder.PromptFeeder.position>`), so a dropped prompt is never fed again.

Stored as safetensors arrays ``rollout/<j>/{prompt,response,logprobs,versions,answer}`` and
one JSON record per answer (no pickle).

The request is made at the step boundary and served at rollout's next poll, while the
trainer may already train the next step: any moment before rollout forgets that step's
groups is consistent with the checkpoint (a group trained meanwhile is still saved as placed;
the checkpoint has not trained it). A group with a token of weights newer than the restored
version (the snapshot came late) is not kept.

On resume (:func:`resume`, before rollout's loop starts) a placed group goes back into its
step (the placement the original run made: ``step <= start version + k``, so the bound holds
as before; whatever the engine). A running group **continues** when

* the engine can continue answers (``batch.resume``: the built-in engine and the fake one;
  vLLM/SGLang cannot, so their answers restart),
* the staleness bound still allows it: the group started at ``w`` (its oldest token's
  version, the row's ``version`` the trainer checks, ``v - version <= k``) may be trained at
  the earliest at the resumed step ``s`` (steps ``< s`` are trained), so ``w + k >= s``,
* with ``rollout.on_swap=discard`` all its tokens are of the resumed version (one version a group),
* and the placer can still guarantee it a step by its deadline ``w + k``
  (:meth:`GroupPlacer.adopt <asyncflow.workflow.placement.GroupPlacer.adopt>`; it always can:
  the original run's placer guaranteed it, with the placed groups put back first).

Else it restarts from its prompt (the feeder feeds it again). A soft group rejoins soft
(no check: it had no guaranteed slot before either), a stalled one stalled (it restarts
once, as it would have: a prompt is thrown away at most once), and admission continues from
``started - dropped`` (a dropped group gave its admission back before the checkpoint). A
kept group holds an admission slot and a prompt slot: the feeder skips its prompt id and
feeds that many fewer prompts (:meth:`PromptFeeder.resume
<asyncflow.workflow.feeder.PromptFeeder.resume>`), and rollout takes them from the same
place in the prompt partitions, so every prompt group of the run is trained exactly once
(with dynamic sampling the self-feeding feeder feeds the ``pending`` prompts that did not
continue, then new ones; never a dropped one). A continued group's finished answers are
scored again (rewards in flight at the checkpoint are re-issued), its live answers decode on
from their saved tokens.

``sync`` (the colocated worker's checkpoint, :mod:`asyncflow.workflow.role_state`) uses the
same records, taken on the compute thread at the step boundary (``capture(..., sync=True)``).
Staleness is 0 there, so once a step fills no group is running or placed beyond it: every
over-provisioned straggler was stalled as the step filled (its live rows left the batch) and
with dynamic sampling alone the live groups are exactly the placed ones. What crosses the
boundary is the stalled groups (in order), the groups fetched but not started (``waiting``,
in order; they hold prompt slots, not admission), the counters and rollout's prompt
**cursor** (partition, prompts taken from it): every prompt id below ``partition * P + taken``
was read, none above (a ``sync`` partition ``p`` holds ids ``p * P ..``, in order). On resume
the stalled and waiting groups are put back as they were, and the feeder (the driver's, or
the self-feeding one) feeds from the cursor on, the cursor's partition short by ``taken``
(:meth:`PromptFeeder.resume <asyncflow.workflow.feeder.PromptFeeder.resume>`): rollout reads
the same prompts in the same fetches as a run never stopped, so the run is exact.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

from asyncflow.engines.types import Completion, Partial, Request

PREFIX = "rollout/"


class SnapshotRequest:
    """The driver's request for rollout's in-flight snapshot, served on rollout's loop thread."""

    def __init__(self, done: int) -> None:
        self.done_steps = done  # steps trained at the checkpoint
        self._done = threading.Event()
        self._out: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None
        self._error: BaseException | None = None

    def serve(self, role: Any) -> None:
        try:
            self._out = capture(role, self.done_steps)
        except Exception as e:  # (raised to the caller of wait)
            self._error = e
        self._done.set()

    def wait(self, timeout: float, role: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The snapshot, once ``role``'s loop has served it; the loop's error if it stopped, a
        ``TimeoutError`` if it did not serve it within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._done.wait(0.2):
            if role.error is not None:  # (its loop stopped: its own error, as the health check raises it)
                raise role.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout did not take its checkpoint snapshot within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        assert self._out is not None  # set with done
        return self._out


def capture(role: Any, done: int, sync: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The groups of a rollout role not trained once ``done`` steps are (module doc), as arrays
    and JSON records: the placed ones (with their step and rewards), then the running ones;
    ``sync`` (at the step boundary, on the compute thread): also the fetched groups not started
    (``waiting``) and rollout's prompt cursor (``cursor``: partition, prompts taken from it)."""
    live: dict[int, list[Partial]] = defaultdict(list)
    partials = getattr(role.batch, "partials", None)
    if partials is not None:
        for p in partials():
            live[p.req.key[0]].append(p)
    pending = set(role.restarts) | set(role.stale)
    tensors: dict[str, np.ndarray] = {}
    records: list[dict[str, Any]] = []

    def add(gid: int, done: list[Completion], live: list[Partial], **extra: Any) -> None:
        finished = [Partial(Request(c.key, list(c.prompt_ids)), c.response_ids, c.logprobs, c.token_versions,
                            c.version) for c in done]
        for i, p in enumerate(finished + live):
            fin = i < len(done)
            tensors.update(_arrays(len(records), p))
            records.append({"group": int(gid), "version": int(p.version), "finished": fin,
                            "eos": fin and bool(done[i].finished_on_eos), "max_new": p.req.max_new_tokens,
                            "min_new": p.req.min_new_tokens, **{k: v[i] if k == "reward" else v
                                                                for k, v in extra.items() if v is not None}})

    for gid, (part, group, raw) in role.placed.items():
        if part >= done:
            add(gid, group, [], placed=int(part), reward=None if raw is None else [float(x) for x in raw])
    placer = role.placer
    for gid in role.groups:
        finished = role.scoring[gid][1] if gid in role.scoring else role.finished.get(gid, [])
        if partials is not None and gid not in pending and len(finished) + len(live[gid]) == role.group_size:
            add(gid, finished, live[gid], soft=gid in placer.soft or None, crossed=gid in placer.crossed or None)
    for gid in role.stale:  # (over-provisioning: stalled, to start again from the prompt as firm groups)
        add(gid, [], [Partial(r, [], [], [], role.version) for r in role.groups[gid]], stalled=True)
    for group in role.waiting if sync else ():  # (sync: fetched, not started; in order)
        add(group[0].key[0], [], [Partial(r, [], [], [], role.version) for r in group], waiting=True)
    meta = {"answers": records, "started": int(placer.started - placer.dropped), "version": int(role.version),
            "counters": {"discarded": role.discarded, "carried": placer.carried, "stalls": placer.stalls,
                         "scored": role.groups_scored, "dropped": role.groups_dropped, "decode_steps": role.steps}}
    if sync:  # (the prompts read so far are exactly the ids below the cursor: see the module doc)
        meta["cursor"] = [int(role.partition), int(role.taken)]
    elif role.feed is not None:  # (dynamic sampling: rollout feeds itself)
        meta["prompts"] = role.feed.position(done)
    return tensors, meta


def forget_trained(role: Any) -> None:
    """Forget the placed groups of steps trained already (rollout has the weights of a version
    ``v``: steps ``< v`` are trained)."""
    for gid in [g for g, (part, _, _) in role.placed.items() if part < role.version]:
        del role.placed[gid]


def _arrays(j: int, p: Partial) -> dict[str, np.ndarray]:
    return {f"{PREFIX}{j}/prompt": np.asarray(p.req.prompt_ids, dtype=np.int64),
            f"{PREFIX}{j}/response": np.asarray(p.response_ids, dtype=np.int64),
            f"{PREFIX}{j}/logprobs": np.asarray(p.logprobs, dtype=np.float64),
            f"{PREFIX}{j}/versions": np.asarray(p.token_versions, dtype=np.int64),
            f"{PREFIX}{j}/answer": np.asarray(p.req.key[1], dtype=np.uint8)}


Saved = tuple[bool, Partial, bool, float | None]  # (finished, the answer, finished on EOS, its reward if placed)


def saved_groups(tensors: dict[str, np.ndarray], meta: dict[str, Any]
                 ) -> dict[int, tuple[int | None, list[Saved], dict[str, Any]]]:
    """The saved answers by group: the step it was placed in (None: running or stalled), its
    answers, and its first record (the group's flags: ``soft``, ``crossed``, ``stalled``)."""
    out: dict[int, tuple[int | None, list[Saved], dict[str, Any]]] = {}
    for j, r in enumerate(meta.get("answers", [])):
        t = {k: tensors[f"{PREFIX}{j}/{k}"] for k in ("prompt", "response", "logprobs", "versions", "answer")}
        req = Request((r["group"], t["answer"].copy()), t["prompt"].tolist(), r["max_new"], r["min_new"], r["version"])
        part = out.setdefault(r["group"], (r.get("placed"), [], r))
        part[1].append((r["finished"], Partial(req, t["response"].tolist(), t["logprobs"].tolist(),
                                               t["versions"].tolist(), r["version"]), r["eos"], r.get("reward")))
    return out


def resume(role: Any, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> list[int]:
    """Put back the saved groups that may be kept (module doc) in ``role`` (a rollout role
    resumed at ``step``, its loop not started): the placed ones in their steps first, then the
    running ones that may continue; return their group ids (prompt ids)."""
    groups = saved_groups(tensors, meta)
    can = getattr(role.batch, "resume", None) is not None
    k, kept, placer = role.placer.k, [], role.placer
    c = meta.get("counters", {})  # (the summary's counters continue)
    role.discarded, role.groups_scored, role.groups_dropped = c.get("discarded", 0), c.get("scored", 0), \
        c.get("dropped", 0)
    placer.carried, placer.stalls, role.steps = c.get("carried", 0), c.get("stalls", 0), c.get("decode_steps", 0)

    def restored(answers: list[Saved]) -> bool:  # (no token of weights newer than the restored version)
        return all(v <= step for _, p, _, _ in answers for v in p.token_versions)

    for gid, (part, answers, _) in sorted((g, v) for g, v in groups.items()
                                          if v[0] is not None and v[0] >= step and restored(v[1])):
        assert part is not None  # (filtered above)
        kept.append(gid)
        placer.refill(part)
        done = [_completion(p, eos) for _, p, eos, _ in answers]
        role.outbox[part].extend(done)
        raw = [float(r) for *_, r in answers if r is not None] if role.scorer is not None else None
        if raw is not None:  # (rewards in rollout: every placed group was saved with its rewards)
            if len(raw) != len(done):
                raise ValueError(f"checkpoint: placed group {gid} was saved without its rewards")
            role.rewards[part].extend(raw)
        role.placed[gid] = (part, done, raw)  # (saved again at the next checkpoint until trained)
        if role.feed is not None:
            role.feed.settle(gid, part)
        role._outbox_since = role._outbox_since or time.perf_counter()
    running = {g: v for g, v in groups.items() if v[0] is None and not (v[2].get("stalled") or v[2].get("waiting"))}
    for gid in sorted(running, key=lambda g: (min(a[1].version for a in running[g][1]), g)):  # earliest deadline 1st
        answers, flags = running[gid][1], running[gid][2]
        w = min(p.version for _, p, _, _ in answers)
        one_version = role.on_swap == "continue" or all(v == role.version for _, p, _, _ in answers
                                                         for v in p.token_versions)
        if not (can and len(answers) == role.group_size and w + k >= step and one_version and restored(answers)
                and placer.adopt(gid, w, bool(flags.get("soft")), bool(flags.get("crossed")))):
            continue
        kept.append(gid)
        role.groups[gid] = [Request(p.req.key, p.req.prompt_ids, p.req.max_new_tokens, p.req.min_new_tokens)
                            for _, p, _, _ in answers]
        role.batch.resume([p for fin, p, _, _ in answers if not fin])
        role._emit([_completion(p, eos) for fin, p, eos, _ in answers if fin])
    for gid in [g for g, v in groups.items() if v[2].get("stalled")]:  # (in their saved order: oldest first)
        kept.append(gid)
        placer.adopt_stalled(gid)
        role.groups[gid] = [p.req for _, p, _, _ in groups[gid][1]]
        role.stale.append(gid)
    for gid in [g for g, v in groups.items() if v[2].get("waiting")]:  # (sync: in their saved order)
        kept.append(gid)
        role.waiting.append([p.req for _, p, _, _ in groups[gid][1]])
    if role.feed is not None and "prompts" in meta:  # (the kept groups keep their prompt slots)
        role.feed.resume_position(step, meta["prompts"], kept)
    return kept


def _completion(p: Partial, eos: bool) -> Completion:
    return Completion(p.req.key, p.req.prompt_ids, p.response_ids, p.logprobs, p.version, eos, p.token_versions)
