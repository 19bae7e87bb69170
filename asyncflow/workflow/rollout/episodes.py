"""Multi-turn episodes in flight at a checkpoint: saved with it, continued on resume where they may be.

The multi-turn counterpart of the running groups of :mod:`asyncflow.workflow.rollout.inflight` (placed
groups are saved there, their loss masks with them). At a checkpoint every running group of
episodes is saved whole: its finished episodes (trajectories: ids, log-probs, versions, loss mask,
reward) and its episodes in flight, each with what it holds so far (prompt, response ids, log-probs,
per-token versions, loss mask, the conversation's text and messages, turns, reward) and where it
stood: ``reset`` (its environment's reset in flight), ``turn`` (a turn being generated: its partial
tokens are not kept, the turn is generated again from the same history), or ``env`` (a step in
flight: the turn it was stepping is kept and stepped again), with its environment's
``state_dict()`` after its last finished call. Stored as safetensors arrays ``rollout/episode/<j>/...``
and JSON ``episodes`` (no pickle).

On resume a group **continues** when every episode of it can (finished, or resetting, or its
environment has ``load_state_dict``: a fresh environment is given the saved state, then the reset,
step or turn in flight is issued again), no token is of weights newer than the restored version,
and the staleness bound still allows it (``start + k >= step``, the placer adopting it: as
:func:`~asyncflow.workflow.rollout.inflight.resume` does for single-turn groups). Else it restarts
from its prompt (the feeder feeds it again). A step in flight is thus issued twice (once before the
restart, once after): an environment whose steps have effects outside it should make them
idempotent. Agent-driven episodes (``env.agent``) have no state to save: their groups restart.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncflow.agents.env import Turn
from asyncflow.agents.episode import Episode, Trajectory
from asyncflow.engines.types import Request

if TYPE_CHECKING:  # (the role imports inflight, which imports this module)
    from asyncflow.workflow.rollout.role import RolloutRole

PREFIX = "rollout/episode/"  # (under rollout/: the job hands rollout what starts so)
_ARRAYS = ("prompt", "ids", "logprobs", "versions", "mask")


def capture(role: RolloutRole) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """The running groups of episodes (module doc), as arrays and one JSON record per group."""
    runner, s = role.episodes, role.state
    assert runner is not None  # (multi-turn only)
    by_group: dict[int, list[Episode]] = defaultdict(list)
    for ep in runner.episodes.values():
        by_group[ep.turn_key[0]].append(ep)  # type: ignore[index]  # (turn keys are (group, index))
    tensors: dict[str, np.ndarray] = {}
    groups: list[dict[str, Any]] = []
    for gid, reqs in s.groups.items():
        done = [c for c in s.finished.get(gid, []) if isinstance(c, Trajectory)]
        live = by_group.get(gid, [])
        if len(done) + len(live) != role.group_size:
            continue  # (not all started: it restarts from its prompt)
        _, answer, prompt = reqs[0].key
        j0 = len(tensors) // len(_ARRAYS)
        record: dict[str, Any] = {"group": int(gid), "start": int(s.placer.running.get(gid, role.version)
                                                                   - s.placer.k),
                                  "crossed": gid in s.placer.crossed, "query": [int(x) for x in reqs[0].prompt_ids],
                                  "answer": bytes(answer).decode("utf-8"), "prompt": bytes(prompt).decode("utf-8"),
                                  "max_new": reqs[0].max_new_tokens, "min_new": reqs[0].min_new_tokens,
                                  "episodes": []}
        parts = [_finished(t) for t in done] + [_live(ep) for ep in live]
        for i, (arrays, info) in enumerate(parts):
            tensors.update({f"{PREFIX}{j0 + i}/{k}": v for k, v in arrays.items()})
            record["episodes"].append(info)
        groups.append(record)
    return tensors, groups


def _finished(t: Trajectory) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays = _arrays(t.prompt_ids, t.response_ids, t.logprobs, t.token_versions, t.loss_mask)
    return arrays, {"phase": "done", "eos": t.finished_on_eos, "reward": t.reward, "turns": t.turns, "end": t.end,
                    "error": t.error, "version": t.version}


def _live(ep: Episode) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays = _arrays(ep.prompt, ep.ids, ep.logprobs, ep.versions, ep.mask)
    turn = ep.stepping
    return arrays, {"phase": ep.phase, "slot": int(ep.turn_key[1]),  # type: ignore[index]  # (group, index)
                    "turns": ep.turns, "reward": ep.reward, "text": ep.text, "messages": ep.messages,
                    "tools": ep.tools, "state": ep.state, "sample": ep.sample, "fallback": ep.fallback,
                    "turn": None if turn is None else {"text": turn.text, "content": turn.content,
                                                       "ids": list(turn.ids), "stop_reason": turn.stop_reason,
                                                       "index": turn.index}}


def _arrays(prompt: list[int], ids: list[int], logprobs: list[float], versions: list[int],
            mask: list[int]) -> dict[str, np.ndarray]:
    return {"prompt": np.asarray(prompt, dtype=np.int64), "ids": np.asarray(ids, dtype=np.int64),
            "logprobs": np.asarray(logprobs, dtype=np.float64), "versions": np.asarray(versions, dtype=np.int64),
            "mask": np.asarray(mask, dtype=np.uint8)}


def resume(role: RolloutRole, step: int, tensors: dict[str, np.ndarray], groups: list[dict[str, Any]]) -> list[int]:
    """Continue the saved groups that may (module doc), earliest start first; their group ids."""
    runner, s, kept, j0 = role.episodes, role.state, [], 0
    assert runner is not None  # (multi-turn only)
    firsts = []
    for g in groups:
        firsts.append(j0)
        j0 += len(g["episodes"])
    for j, g in sorted(zip(firsts, groups), key=lambda x: (x[1]["start"], x[1]["group"])):
        arrays = [{k: tensors[f"{PREFIX}{j + i}/{k}"] for k in _ARRAYS} for i in range(len(g["episodes"]))]
        versions = [int(v) for a in arrays for v, m in zip(a["versions"], a["mask"]) if m]
        w = min([g["start"], *versions])
        continues = all(e["phase"] in ("done", "reset") or e.get("state") is not None for e in g["episodes"])
        if not (continues and all(v <= step for v in versions) and w + s.placer.k >= step
                and s.placer.adopt(g["group"], w, False, bool(g["crossed"]))):
            continue
        kept.append(g["group"])
        _put_back(role, g, arrays)
    return kept


def _put_back(role: RolloutRole, g: dict[str, Any], arrays: list[dict[str, np.ndarray]]) -> None:
    """A continued group: its requests (for the record), its finished episodes, its live ones resumed."""
    runner, s, gid = role.episodes, role.state, g["group"]
    assert runner is not None
    answer, prompt = (np.frombuffer(g[k].encode("utf-8"), dtype=np.uint8).copy() for k in ("answer", "prompt"))
    s.groups[gid] = [Request((gid, answer, prompt), list(g["query"]), g["max_new"], g["min_new"])
                     for _ in range(role.group_size)]
    done = []
    for e, a in zip(g["episodes"], arrays):
        key = (gid, answer)
        if e["phase"] == "done":
            done.append(Trajectory(key, a["prompt"].tolist(), a["ids"].tolist(), a["logprobs"].tolist(), e["version"],
                                   e["eos"], a["versions"].tolist(), "", a["mask"].tolist(), e["reward"], e["turns"],
                                   e["end"], e["error"]))
            continue
        ep = Episode(key, (gid, e["slot"]), None, e["sample"], list(e["fallback"]), a["prompt"].tolist(),
                     a["ids"].tolist(), a["logprobs"].tolist(), a["versions"].tolist(), a["mask"].tolist(),
                     e["text"], e["messages"], e["tools"], e["turns"], e["reward"], e["phase"], None, e["state"])
        t = e["turn"]
        runner.resume(ep, None if t is None else Turn(t["text"], t["content"], tuple(t["ids"]), t["stop_reason"],
                                                      t["index"]))
    role.collector.collect(done)
