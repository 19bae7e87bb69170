"""Rollout's answers in flight across a restart: saved with a checkpoint, continued on resume.

At a checkpoint of a ``stream``/``async`` run the driver asks the rollout role for a snapshot
at the step boundary (:class:`SnapshotRequest`: served by rollout's own loop between two
decode steps, so the batch is never read while it changes). It holds every *running* prompt
group whose answers are all accounted for: the finished ones (with or without their rewards)
and the live ones (:meth:`partials <asyncflow.engines.inference.GenerationBatch.partials>`:
tokens so far, their log-probs and per-token policy versions, the version that started the
answer). Groups already placed in a step (in the outbox or the data plane, not trained) and
groups waiting to restart are not saved: they restart from their prompts. Stored as
safetensors arrays ``rollout/<j>/{prompt,response,logprobs,versions,answer}`` and one JSON
record per answer (no pickle).

On resume (:func:`resume`, before rollout's loop starts) a saved group **continues** when

* the engine can continue answers (``batch.resume``: the built-in engine and the fake one;
  vLLM/SGLang cannot, so their answers restart),
* the staleness bound still allows it: the group started at ``w`` (its oldest token's
  version, the row's ``version`` the trainer checks, ``v - version <= k``) may be trained at
  the earliest at the resumed step ``s`` (steps ``< s`` are trained), so ``w + k >= s``,
* with ``rollout.on_swap=discard`` all its tokens are of the resumed version (one version a group),
* and the placer can still guarantee it a step by its deadline ``w + k``
  (:meth:`GroupPlacer.adopt <asyncflow.workflow.placement.GroupPlacer.adopt>`; it always can:
  the original run's placer guaranteed it with the steps ``>= s`` at most as free).

Else it restarts from its prompt (the feeder feeds it again). A continued group holds an
admission slot and a prompt slot: the feeder skips its prompt id and feeds that many fewer
prompts (:meth:`PromptFeeder.resume <asyncflow.workflow.feeder.PromptFeeder.resume>`), and
rollout takes them from the same place in the prompt partitions, so every prompt group of
the run is trained exactly once. Its finished answers are scored again (rewards in flight at
the checkpoint are re-issued), its live answers decode on from their saved tokens.
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

    def __init__(self) -> None:
        self._done = threading.Event()
        self._out: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None
        self._error: BaseException | None = None

    def serve(self, role: Any) -> None:
        try:
            self._out = capture(role)
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


def capture(role: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The running groups of a rollout role (module doc), as arrays and JSON records."""
    live: dict[int, list[Partial]] = defaultdict(list)
    partials = getattr(role.batch, "partials", None)
    if partials is not None:
        for p in partials():
            live[p.req.key[0]].append(p)
    pending = set(role.restarts) | set(role.stale)
    tensors: dict[str, np.ndarray] = {}
    records: list[dict[str, Any]] = []
    for gid in role.groups:
        done = role.scoring[gid][1] if gid in role.scoring else role.finished.get(gid, [])
        if partials is None or gid in pending or len(done) + len(live[gid]) != role.group_size:
            continue
        base = len(records)
        finished = [Partial(Request(c.key, list(c.prompt_ids)), c.response_ids, c.logprobs, c.token_versions,
                            c.version) for c in done]
        for i, p in enumerate(finished + live[gid]):
            fin = i < len(done)
            tensors.update(_arrays(base + i, p))
            records.append({"group": int(gid), "version": int(p.version), "finished": fin,
                            "eos": fin and bool(done[i].finished_on_eos),
                            "max_new": p.req.max_new_tokens, "min_new": p.req.min_new_tokens})
    return tensors, {"answers": records, "started": int(role.placer.started), "version": int(role.version)}


def _arrays(j: int, p: Partial) -> dict[str, np.ndarray]:
    return {f"{PREFIX}{j}/prompt": np.asarray(p.req.prompt_ids, dtype=np.int64),
            f"{PREFIX}{j}/response": np.asarray(p.response_ids, dtype=np.int64),
            f"{PREFIX}{j}/logprobs": np.asarray(p.logprobs, dtype=np.float64),
            f"{PREFIX}{j}/versions": np.asarray(p.token_versions, dtype=np.int64),
            f"{PREFIX}{j}/answer": np.asarray(p.req.key[1], dtype=np.uint8)}


def saved_groups(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[int, list[tuple[bool, Partial, bool]]]:
    """The saved answers by group: ``(finished, answer, finished_on_eos)`` each."""
    out: dict[int, list[tuple[bool, Partial, bool]]] = defaultdict(list)
    for j, r in enumerate(meta.get("answers", [])):
        t = {k: tensors[f"{PREFIX}{j}/{k}"] for k in ("prompt", "response", "logprobs", "versions", "answer")}
        req = Request((r["group"], t["answer"].copy()), t["prompt"].tolist(), r["max_new"], r["min_new"], r["version"])
        out[r["group"]].append((r["finished"], Partial(req, t["response"].tolist(), t["logprobs"].tolist(),
                                                         t["versions"].tolist(), r["version"]), r["eos"]))
    return out


def resume(role: Any, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> list[int]:
    """Continue the saved groups that may continue (module doc) in ``role`` (a rollout role
    resumed at ``step``, its loop not started); return their group ids (prompt ids)."""
    groups = saved_groups(tensors, meta)
    can = getattr(role.batch, "resume", None) is not None
    k, continued = role.placer.k, []
    for gid in sorted(groups, key=lambda g: (min(p.version for _, p, _ in groups[g]), g)):  # earliest deadline first
        answers = groups[gid]
        w = min(p.version for _, p, _ in answers)
        one_version = role.on_swap == "continue" or all(v == role.version for _, p, _ in answers
                                                         for v in p.token_versions)
        if not (can and len(answers) == role.group_size and w + k >= step and one_version
                and role.placer.adopt(gid, w)):
            continue
        continued.append(gid)
        role.groups[gid] = [Request(p.req.key, p.req.prompt_ids, p.req.max_new_tokens, p.req.min_new_tokens)
                            for _, p, _ in answers]
        role.batch.resume([p for fin, p, _ in answers if not fin])
        role._emit([Completion(p.req.key, p.req.prompt_ids, p.response_ids, p.logprobs, p.version, eos,
                               p.token_versions) for fin, p, eos in answers if fin])
    return continued

