"""Critic engine: a value model (causal-LM backbone + scalar head) and its optimizer.

:class:`ValueModel` takes the transformer backbone of a Hugging Face causal LM (its
``base_model``: the LM without ``lm_head``) and adds a linear head ``hidden -> 1``,
**zero-initialised**, so a fresh critic predicts 0 everywhere and the first updates move
only the head (the backbone starts as the policy's, i.e. warm-start, features).

Token alignment is the policy's: the value of response token ``t`` is read at the
position whose logits predict token ``t`` (``TokenBatch.gather_index``), i.e. ``V_t`` is
the value of the prefix *before* token ``t`` is emitted, as GAE expects
(``delta_t = r_t + gamma V_{t+1} - V_t``).

:class:`CriticEngine` is a :class:`~asyncflow.engines.training.TrainEngine` (same AdamW,
gradient clipping, LR schedule, data-parallel gradient sum, micro-batch accumulation)
whose per-token forward is the value instead of the log-prob: ``values(prompts,
responses)`` for inference, ``forward_backward(..., loss_fn)`` hands the loss ``[B, R]``
predictions. ``version`` counts critic updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncflow.engines.device import model_device
from asyncflow.engines.training import TokenBatch, TrainEngine


class ValueModel(torch.nn.Module):
    """``base_model`` of a causal LM + a zero-initialised scalar head: ``[B, L]`` values."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.backbone = lm.base_model
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(model_device(lm))  # beside the backbone (resources.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.float())[..., 0]


def token_values(model: ValueModel, batch: TokenBatch) -> torch.Tensor:
    """Per response token values ``[B, R]`` (0 where masked)."""
    v = model(batch.input_ids, batch.attention_mask)
    return v.gather(1, batch.gather_index()) * batch.mask


class CriticEngine(TrainEngine):
    """Training engine of a :class:`ValueModel` (built from a causal LM the caller owns)."""

    def __init__(self, lm: torch.nn.Module, pad_id: int, **kwargs):
        super().__init__(ValueModel(lm), pad_id, **kwargs)

    def _forward(self, batch: TokenBatch, entropy: bool = False) -> torch.Tensor:
        return token_values(self.model, batch)

    @torch.no_grad()
    def values(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per response token values, one float32 row per response."""
        was_training = self.model.training
        self.model.eval()
        batch = TokenBatch.build(prompts, responses, self.pad_id, self.device)
        v = token_values(self.model, batch).cpu()
        self.model.train(was_training)
        return [v[i, : n].numpy().astype(np.float32) for i, n in enumerate(batch.response_lens)]

    def logprobs(self, prompts, responses):  # pragma: no cover - a critic has no policy
        raise TypeError("CriticEngine has no log-probs: call values()")
