"""What each role of a trainer's worker puts in a checkpoint, and takes back from one.

``stream``/``async``: the trainer's worker holds the actor alone (rollout restarts from the
prompts or continues its saved groups: :mod:`asyncflow.workflow.rollout.inflight`); a restore
republishes the weights (FSDP, TP: all-gathers every rank joins, so the job restores its ranks
at once; each restores its own shards: :mod:`asyncflow.workflow.shards`). PPO's critic is a
worker of its own there (:func:`critic_parts`): it snapshots itself on its own thread right
after its update of step ``done - 1`` (before it reports that step's metrics, so the driver,
which asks for a checkpoint only once it has them, always finds the snapshot taken), with its
own RNGs (``critic/rng/...``); it is restored before the actor (whose RNGs, in one process, are
the ones restored last). ``sync``: the colocated worker's actor engine, rollout's sampling
generator and version, PPO's critic (its own model, AdamW and version under ``critic/``, its
RNGs the actor's), rollout's state at the step boundary (``rollout/...``, JSON ``rollout``:
stalled and waiting groups, counters, prompt cursor; :mod:`asyncflow.workflow.rollout.inflight`),
and the roles' counters set to the steps done. The live tensors
(:func:`snapshot_parts`) are copied by :mod:`asyncflow.workflow.hostcopy`;
:mod:`asyncflow.workflow.checkpoint` has the format and the capture of one engine.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncflow.config import ConfigError
from asyncflow.workflow.checkpoint import Snapshot, capture_parts, host_all, restore
from asyncflow.workflow.roles.actor import publish_weights
from asyncflow.workflow.roles.critic import CriticRole
from asyncflow.workflow.rollout import inflight
from asyncflow.workflow.rollout.role import RolloutRole


def snapshot_roles(model: torch.nn.Module, roles: dict[str, Any], full: bool = True) -> Snapshot:
    """:func:`~asyncflow.workflow.checkpoint.capture` of a worker's roles: the actor's engine on
    ``model``; ``sync``: also rollout's sampling generator and version, and PPO's critic (its own
    model, under ``critic/``)."""
    live, (tensors, meta), _ = snapshot_parts(model, roles, full)
    tensors.update(host_all(live))
    return tensors, meta


def snapshot_parts(model: torch.nn.Module, roles: dict[str, Any],
                   full: bool = True) -> tuple[dict[str, torch.Tensor], Snapshot, list[Any]]:
    """:func:`snapshot_roles` in the two parts of :func:`~asyncflow.workflow.checkpoint.capture_parts`,
    and the engines whose next optimizer step must wait for the live part's copy."""
    actor = roles["actor"].engine
    if "rollout" not in roles:  # stream/async: the trainer's worker (rollout restarts from the prompts)
        return (*capture_parts(model, actor, None, full), [actor])
    rollout: RolloutRole = roles["rollout"]
    live, (tensors, meta) = capture_parts(model, actor, getattr(rollout.engine, "generator", None), full)
    meta["rollout_version"] = rollout.version
    rtensors, meta["rollout"] = inflight.capture(rollout, rollout.version, sync=True)  # (the step boundary)
    tensors.update(rtensors)
    engines = [actor]
    if full and "critic" in roles:
        engine = roles["critic"].engine
        clive, (_, meta["critic"]) = capture_parts(engine.model, engine, None)  # (its RNGs: the actor's)
        live.update({f"critic/{k}": v for k, v in clive.items()})
        engines.append(engine)
    return live, (tensors, meta), engines


def critic_parts(critic: CriticRole) -> tuple[dict[str, torch.Tensor], Snapshot, list[Any]]:
    """``stream``/``async``: :func:`snapshot_parts` of PPO's critic worker (a ``CriticRole`` alone):
    its value model and AdamW state (live), its version, LR schedule and its process's RNGs, all
    under ``critic/`` (JSON: ``critic``), and its engine (its next optimizer step waits for the copy)."""
    engine = critic.engine
    live, (tensors, meta) = capture_parts(engine.model, engine, None)
    return ({f"critic/{k}": v for k, v in live.items()}, ({f"critic/{k}": v for k, v in tensors.items()},
                                                          {"critic": meta}), [engine])


def split_critic(snap: Snapshot) -> tuple[Snapshot, Snapshot]:
    """A ``stream``/``async`` PPO checkpoint split into the critic worker's part and the rest."""
    tensors, meta = snap
    if "critic" not in meta:  # (a checkpoint of a PPO run whose critic was not saved)
        raise ConfigError("--resume: the checkpoint holds no critic (checkpoints/step-*/state.json has no "
                          "'critic'): it cannot resume algorithm.name=ppo")
    mine = {k: v for k, v in tensors.items() if k.startswith("critic/")}
    return (mine, {"critic": meta["critic"]}), ({k: v for k, v in tensors.items() if not k.startswith("critic/")}, meta)


def _restore_critic(critic: CriticRole, snap: Snapshot, step: int) -> None:
    """Put the critic of a snapshot back (its RNGs: its own if saved, else the actor's), ``step`` steps done."""
    tensors, meta = snap
    own = {k[7:]: v for k, v in tensors.items() if k.startswith("critic/")}
    if "rng/torch" not in own:  # (sync: the colocated worker's RNGs are the actor's)
        own.update({k: v for k, v in tensors.items() if k.startswith("rng/")})
    restore(critic.engine.model, critic.engine, None, (own, meta["critic"]))
    critic.step, critic.items = step, step * critic.batch_size


def restore_roles(model: torch.nn.Module, roles: dict[str, Any], snap: Snapshot, step: int) -> list[int]:
    """Put a :func:`snapshot_roles` (or :func:`critic_parts`) back; set the roles' counters to ``step`` steps
    done. ``sync``: the prompt ids of rollout's groups put back (stalled or waiting: they keep their prompt
    slots, :func:`_restore_rollout`); else none."""
    tensors, meta = snap
    if "actor" not in roles:  # stream/async: PPO's critic worker
        _restore_critic(roles["critic"], snap, step)
        return []
    if "rollout" not in roles:  # stream/async: the trainer; rollout takes the weights it republishes
        actor = roles["actor"]
        restore(model, actor.engine, None, snap)
        publish_weights(actor.engine, actor.publish)  # (sharded: all-gathers every rank joins)
        return []
    rollout: RolloutRole = roles["rollout"]
    if "critic" in roles:  # (before the actor's: its RNG states are the ones restored last)
        _restore_critic(roles["critic"], snap, step)
    restore(model, roles["actor"].engine, getattr(rollout.engine, "generator", None), snap)
    for name in ("reward", "reference"):  # their counters of rows done (see Worker._sync_step)
        if name in roles:
            roles[name].items = step * rollout.batch_rows
    return inflight.restore_sync(rollout, tensors, meta, step)
