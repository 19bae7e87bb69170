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
one JSON record per answer (no pickle); a multi-turn sample also ``rollout/<j>/mask`` (its loss
mask) and its episode's outcome. Multi-turn runs save their running groups' episodes instead of
live answers: :mod:`asyncflow.workflow.rollout.episodes`.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncflow.agents.episode import Trajectory
from asyncflow.engines.types import Completion, Partial, Request
from asyncflow.workflow.rollout import episodes
from asyncflow.workflow.rollout.state import RolloutState

if TYPE_CHECKING:  # (the role imports this module)
    from asyncflow.workflow.rollout.role import RolloutRole

PREFIX = "rollout/"


class SnapshotRequest:
    """The driver's request for rollout's in-flight snapshot, served on rollout's loop thread."""

    def __init__(self, done: int) -> None:
        self.done_steps = done  # steps trained at the checkpoint
        self._done = threading.Event()
        self._out: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None
        self._error: BaseException | None = None

    def serve(self, role: RolloutRole) -> None:
        try:
            self._out = capture(role, self.done_steps)
        except Exception as e:  # (raised to the caller of wait)
            self._error = e
        self._done.set()

    def wait(self, timeout: float, role: RolloutRole) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
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


def capture(role: RolloutRole, done: int, sync: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The groups of a rollout role not trained once ``done`` steps are (module doc), as arrays
    and JSON records: the placed ones (with their step and rewards), then the running ones;
    ``sync`` (at the step boundary, on the compute thread): also the fetched groups not started
    (``waiting``) and rollout's prompt cursor (``cursor``: partition, prompts taken from it)."""
    live: dict[int, list[Partial]] = defaultdict(list)
    partials = getattr(role.batch, "partials", None)
    if partials is not None:
        for p in partials():
            live[p.req.key[0]].append(p)
    s = role.state
    pending = set(s.restarts) | set(s.stale)
    tensors: dict[str, np.ndarray] = {}
    records: list[dict[str, Any]] = []

    def add(gid: int, done: list[Completion], live: list[Partial], **extra: Any) -> None:
        finished = [Partial(Request(c.key, list(c.prompt_ids)), c.response_ids, c.logprobs, c.token_versions,
                            c.version) for c in done]
        for i, p in enumerate(finished + live):
            fin = i < len(done)
            tensors.update(_arrays(len(records), p))
            record = {"group": int(gid), "version": int(p.version), "finished": fin,
                      "eos": fin and bool(done[i].finished_on_eos), "max_new": p.req.max_new_tokens,
                      "min_new": p.req.min_new_tokens, **{k: v[i] if k == "reward" else v
                                                          for k, v in extra.items() if v is not None}}
            c = done[i] if fin else None
            if isinstance(c, Trajectory):  # (multi-turn: the loss mask and the episode's outcome travel with it)
                tensors[f"{PREFIX}{len(records)}/mask"] = np.asarray(c.loss_mask, dtype=np.uint8)
                record["episode"] = {"reward": c.reward, "turns": c.turns, "end": c.end, "error": c.error}
            records.append(record)

    for gid, (part, group, raw) in s.placed.items():
        if part >= done:
            add(gid, group, [], placed=int(part), reward=None if raw is None else [float(x) for x in raw])
    placer = s.placer
    for gid in s.groups if role.episodes is None else ():  # (multi-turn: episodes.capture below)
        finished = s.scoring[gid][1] if gid in s.scoring else s.finished.get(gid, [])
        if partials is not None and gid not in pending and len(finished) + len(live[gid]) == role.group_size:
            add(gid, finished, live[gid], soft=gid in placer.soft or None, crossed=gid in placer.crossed or None)
    for gid in s.stale:  # (over-provisioning: stalled, to start again from the prompt as firm groups)
        add(gid, [], [Partial(r, [], [], [], role.version) for r in s.groups[gid]], stalled=True)
    for reqs in s.waiting if sync else ():  # (sync: fetched, not started; in order)
        add(reqs[0].key[0], [], [Partial(r, [], [], [], role.version) for r in reqs], waiting=True)
    meta = {"answers": records, "started": int(placer.started - placer.dropped), "version": int(role.version),
            "counters": s.counters()}
    if role.episodes is not None:  # (multi-turn: the running groups' episodes)
        etensors, meta["episodes"] = episodes.capture(role)
        tensors.update(etensors)
    if sync:  # (the prompts read so far are exactly the ids below the cursor: see the module doc)
        meta["cursor"] = [int(s.partition), int(s.taken)]
    elif role.feed is not None:  # (dynamic sampling: rollout feeds itself)
        meta["prompts"] = role.feed.position(done)
    return tensors, meta


def forget_trained(state: RolloutState, version: int) -> None:
    """Forget the placed groups of steps trained already (rollout has the weights of a
    ``version`` ``v``: steps ``< v`` are trained)."""
    for gid in [g for g, (part, _, _) in state.placed.items() if part < version]:
        del state.placed[gid]


def _arrays(j: int, p: Partial) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {
        f"{PREFIX}{j}/prompt": np.asarray(p.req.prompt_ids, dtype=np.int64),
        f"{PREFIX}{j}/response": np.asarray(p.response_ids, dtype=np.int64),
        f"{PREFIX}{j}/logprobs": np.asarray(p.logprobs, dtype=np.float64),
        f"{PREFIX}{j}/versions": np.asarray(p.token_versions, dtype=np.int64),
        f"{PREFIX}{j}/answer": np.asarray(p.req.key[1], dtype=np.uint8)}
    if len(p.req.key) > 2:  # (multi-turn: the prompt's text, an environment's reset reads it)
        out[f"{PREFIX}{j}/text"] = np.asarray(p.req.key[2], dtype=np.uint8)
    return out


# (finished, the answer, finished on EOS, its reward if placed, a multi-turn sample's episode: loss mask...)
Saved = tuple[bool, Partial, bool, "float | None", "dict[str, Any] | None"]


def saved_groups(tensors: dict[str, np.ndarray], meta: dict[str, Any]
                 ) -> dict[int, tuple[int | None, list[Saved], dict[str, Any]]]:
    """The saved answers by group: the step it was placed in (None: running or stalled), its
    answers, and its first record (the group's flags: ``soft``, ``crossed``, ``stalled``)."""
    out: dict[int, tuple[int | None, list[Saved], dict[str, Any]]] = {}
    for j, r in enumerate(meta.get("answers", [])):
        t = {k: tensors[f"{PREFIX}{j}/{k}"] for k in ("prompt", "response", "logprobs", "versions", "answer")}
        text = (tensors[f"{PREFIX}{j}/text"].copy(),) if f"{PREFIX}{j}/text" in tensors else ()
        req = Request((r["group"], t["answer"].copy(), *text), t["prompt"].tolist(), r["max_new"], r["min_new"],
                      r["version"])
        part = out.setdefault(r["group"], (r.get("placed"), [], r))
        extra = None
        if "episode" in r:  # (a multi-turn sample: its loss mask and how its episode went)
            extra = {**r["episode"], "mask": tensors[f"{PREFIX}{j}/mask"].tolist()}
        part[1].append((r["finished"], Partial(req, t["response"].tolist(), t["logprobs"].tolist(),
                                               t["versions"].tolist(), r["version"]), r["eos"], r.get("reward"), extra))
    return out


def resume(role: RolloutRole, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> list[int]:
    """Put back the saved groups that may be kept (module doc) in ``role`` (a rollout role
    resumed at ``step``, its loop not started): the placed ones in their steps first, then the
    running ones that may continue; return their group ids (prompt ids)."""
    groups, s = saved_groups(tensors, meta), role.state
    s.set_counters(meta.get("counters", {}))  # (the summary's counters continue)
    kept = _resume_placed(role, step, groups)
    if role.episodes is None:
        kept += _resume_running(role, step, groups)
    else:  # (multi-turn: asyncflow.workflow.rollout.episodes)
        kept += episodes.resume(role, step, tensors, meta.get("episodes", []))
    for gid in [g for g, v in groups.items() if v[2].get("stalled")]:  # (in their saved order: oldest first)
        kept.append(gid)
        s.placer.adopt_stalled(gid)
        s.groups[gid] = [p.req for _, p, *_ in groups[gid][1]]
        s.stale.append(gid)
    for gid in [g for g, v in groups.items() if v[2].get("waiting")]:  # (sync: in their saved order)
        kept.append(gid)
        s.waiting.append([p.req for _, p, *_ in groups[gid][1]])
    if role.feed is not None and "prompts" in meta:  # (the kept groups keep their prompt slots)
        role.feed.resume_position(step, meta["prompts"], kept)
    return kept


Groups = dict[int, tuple[int | None, list[Saved], dict[str, Any]]]


def _restored(answers: list[Saved], step: int) -> bool:
    """No token of weights newer than the restored version (``step``)?"""
    return all(v <= step for _, p, *_ in answers for v in p.token_versions)


def _resume_placed(role: RolloutRole, step: int, groups: Groups) -> list[int]:
    """The placed groups of steps not trained, back into their steps (with their rewards)."""
    kept = []
    for gid, (part, answers, _) in sorted((g, v) for g, v in groups.items()
                                          if v[0] is not None and v[0] >= step and _restored(v[1], step)):
        assert part is not None  # (filtered above)
        kept.append(gid)
        role.state.placer.refill(part)
        done = [_completion(p, eos, extra) for _, p, eos, _, extra in answers]
        raw = [float(a[3]) for a in answers if a[3] is not None] if role.scorer is not None else None
        if raw is not None and len(raw) != len(done):  # (rewards in rollout: every placed group has them)
            raise ValueError(f"checkpoint: placed group {gid} was saved without its rewards")
        role.collector.put_back(gid, part, done, raw)  # (kept: saved again at the next checkpoint until trained)
        if role.feed is not None:
            role.feed.settle(gid, part)
    return kept


def _resume_running(role: RolloutRole, step: int, groups: Groups) -> list[int]:
    """The running groups that may continue (module doc), earliest deadline first."""
    s, kept = role.state, []
    continue_rows = getattr(role.batch, "resume", None)  # (an engine that can continue answers)
    running = {g: v for g, v in groups.items() if v[0] is None and not (v[2].get("stalled") or v[2].get("waiting"))}
    for gid in sorted(running, key=lambda g: (min(a[1].version for a in running[g][1]), g)):
        answers, flags = running[gid][1], running[gid][2]
        w = min(p.version for _, p, *_ in answers)
        one_version = role.on_swap == "continue" or all(v == role.version for _, p, *_ in answers
                                                         for v in p.token_versions)
        if not (continue_rows is not None and len(answers) == role.group_size and w + s.placer.k >= step and one_version
                and _restored(answers, step)
                and s.placer.adopt(gid, w, bool(flags.get("soft")), bool(flags.get("crossed")))):
            continue
        kept.append(gid)
        s.groups[gid] = [Request(p.req.key, p.req.prompt_ids, p.req.max_new_tokens, p.req.min_new_tokens)
                         for _, p, *_ in answers]
        continue_rows([p for fin, p, *_ in answers if not fin])
        role.collector.collect([_completion(p, eos, extra) for fin, p, eos, _, extra in answers if fin])
    return kept


def _completion(p: Partial, eos: bool, extra: dict[str, Any] | None = None) -> Completion:
    """A saved finished answer; a multi-turn one (``extra``: its loss mask and episode) as a Trajectory."""
    if extra is None:
        return Completion(p.req.key, p.req.prompt_ids, p.response_ids, p.logprobs, p.version, eos, p.token_versions)
    return Trajectory(p.req.key, p.req.prompt_ids, p.response_ids, p.logprobs, p.version, eos, p.token_versions, "",
                      extra["mask"], extra["reward"], extra["turns"], extra["end"], extra.get("error"))


def restore_sync(role: RolloutRole, tensors: dict[str, np.ndarray], meta: dict[str, Any], step: int) -> list[int]:
    """``sync``: put rollout back as it was at the step boundary of ``step`` steps done (module doc):
    its version (``meta["rollout_version"]``), its counters and, when the checkpoint has them
    (JSON ``rollout``), the stalled and waiting groups (their ids returned) and its prompt cursor;
    a self-feeding feeder (dynamic sampling) feeds from the cursor on, its partition short by
    the prompts taken."""
    s = role.state
    role.set_version(meta["rollout_version"])
    s.partition, s.taken, role.items = step, 0, step * role.batch_rows
    s.placer.started, s.placer.lowest = step * role.prompts_per_step, step
    if "rollout" not in meta:  # (a checkpoint from before rollout's state was saved)
        return []
    saved = meta["rollout"]
    kept = resume(role, step, {k: v for k, v in tensors.items() if k.startswith(PREFIX)}, saved)
    s.partition, s.taken = (int(x) for x in saved["cursor"])
    if role.feed is not None:  # (ids below the cursor were read: never fed again)
        read = s.partition * role.prompts_per_step + s.taken
        role.feed.resume(s.partition, range(read), s.taken)
    return kept
