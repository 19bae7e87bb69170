"""FSDP checkpoints: each rank saves its own shards and restores them in place.

With ``train.strategy=fsdp`` every weight and AdamW tensor of a trainer rank is a DTensor
holding 1/N of the whole. A checkpoint keeps each rank's local parts as they are
(:func:`~asyncflow.workflow.checkpoint.capture_parts` reads them through :func:`local`, by
reference; :func:`~asyncflow.workflow.checkpoint.merge_ranks` files rank ``r``'s under
``rank<r>/``), and a resume copies them back into the same ranks (:func:`load_shards`).

Why shards, not a full state dict gathered to rank 0 (torch's full state-dict APIs): the
snapshot needs no collective, so it splits as the ``ddp`` one does (the small part at the
boundary, the host copy of the live shards beside the next step:
:mod:`asyncflow.workflow.hostcopy`), and each rank copies 1/N of the state instead of rank
0 all of it after an all-gather of the weights and of AdamW's moments on every rank's
compute thread; a restore re-shards nothing. What gathering would buy, resuming with another
``train.dp``, is refused anyway (:func:`~asyncflow.workflow.checkpoint.check_resume`: only
``train.steps`` may change), and a shard of another shape is refused in one line naming it.
The run's ``checkpoint/`` folder holds the whole weights (gathered) at its end.

Invariant: a shard is restored where it was taken: the same rank, the same parameter order
(the optimizer's state index) and the same placements (the model built from the same config).
"""

from __future__ import annotations

from typing import Any

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP's) local shard, by reference (it shares the storage); any other tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _check(name: str, got: torch.Tensor, want: torch.Size) -> None:
    if got.shape != want:
        raise ValueError(f"checkpoint: {name} is a shard of shape {tuple(got.shape)} but this rank holds "
                         f"{tuple(want)}; resume with the train.dp, train.tp and train.strategy it was saved with")


def load_shards(model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                state: dict[int, dict[str, Any]]) -> None:
    """Copy this rank's saved ``weights`` (by state-dict name) into its weights' local parts, and
    make AdamW's saved ``state`` (by parameter index, changed in place) DTensors placed as their
    parameters, ready for ``opt.load_state_dict`` (``step`` stays a plain tensor, as AdamW keeps
    it); a ``ValueError`` naming the tensor if a shard's shape differs (another ``train.dp``)."""
    from torch.distributed.tensor import DTensor  # lazy: only with train.strategy=fsdp

    own = model.state_dict()
    if set(own) != set(weights):
        raise ValueError(f"checkpoint: its weights differ from the model's ({sorted(set(weights) ^ set(own))[:3]})")
    with torch.no_grad():
        for k, t in own.items():
            _check(f"model/{k}", weights[k], local(t).shape)
            local(t).copy_(weights[k])
    params = [p for g in opt.param_groups for p in g["params"]]
    for idx, st in state.items():
        p = params[idx]
        for key, v in st.items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and key != "step":
                _check(f"optim/{idx}/{key}", v, p.to_local().shape)
                st[key] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                             stride=p.stride())
