"""The reference decode path: any Hugging Face causal LM with a right-aligned ``DynamicCache``.

The built-in engine decodes on slots (:mod:`asyncflow.engines.slot_batch`); this path is the
reference it is tested against (same tokens and log-probs under one seed), the path a model
the slots cannot drive takes (no Hugging Face config, sliding-window layers), and the
baseline of ``benchmarks/engine.py --path``.

Design
------
:class:`GenerationBatch` holds the sequences being decoded right now, one row each, with
one shared KV cache whose time axis is *right-aligned*: every row's tokens end at the last
column and shorter rows are left-padded (attention mask 0, positions counted per row).
That layout lets us

* **add** sequences at any decode step (continuous batching): the newcomers are
  prefilled together, then their cache is left-padded or the running cache is, and the two
  are concatenated along the batch axis;
* **remove** finished rows at any step: select the remaining rows, then drop the leading
  columns that are padding for every row, so the cache never grows past the longest live row;
* **swap weights** between two steps (the delayed parameter update):
  :meth:`InferenceEngine.load_weights` copies host buffers into the parameters; unfinished
  rows keep going (partial rollout), and :meth:`GenerationBatch.recompute_cache` rebuilds
  their KV cache under the new weights first; or the caller drops them
  (:meth:`GenerationBatch.drop_all`) and starts them again from the prompt;
* **continue across a restart**: :meth:`GenerationBatch.partials` copies the live rows
  (tokens, log-probs, per-token versions) for a checkpoint, and :meth:`GenerationBatch.resume`
  rebuilds their cache from ``prompt + tokens`` in a new process and decodes on.

Invariants
----------
* Row ``i``'s logical sequence is ``prompt + generated``; its cache and mask cover exactly
  those tokens, right-aligned; ``mask.sum(1) == len(prompt) + len(generated) - 1`` after a
  step (the last sampled token is not in the cache yet; it is the next step's input).
* The log-prob recorded for a sampled token is ``log_softmax(logits / temperature)`` at that
  token: the same quantity the training engine recomputes (tested to match a full forward).
* Every generated token records the policy version that sampled it
  (``Completion.token_versions``); ``Completion.version`` is the oldest of them (the row's
  start version), so a continued answer shows which tokens came from which weights.
* ``dtype="bfloat16"`` runs every forward under bf16 autocast (the KV cache is then bf16),
  as the training engine does; sampling and log-probs use float32 logits.
* Device: the batch's tensors and KV cache live on the model's device (CPU or a GPU,
  :mod:`asyncflow.engines.device`); prompts are padded on the host and copied once per
  prefill; tokens and log-probs come back as Python lists.
* ``min_new_tokens`` masks EOS (and the request's ``stop_ids``, which end an answer as EOS
  does) until reached (a benchmark device that forces answer lengths); the recorded log-prob
  stays the unmasked policy's, as training recomputes it. ``max_new_tokens`` stops the row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from asyncflow.engines.device import model_device
from asyncflow.engines.sampling import draw, nucleus
from asyncflow.engines.training import autocast
from asyncflow.engines.types import Completion, Partial, Request, SamplingParams

__all__ = ["GenerationBatch", "sample_tokens", "token_logprob"]


@dataclass
class _Row:
    req: Request
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = 0
    versions: list[int] = field(default_factory=list)  # per generated token


class GenerationBatch:
    """Rows being decoded together with a shared right-aligned KV cache (see module doc)."""

    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None, dtype: str = "float32"):
        self.model = model
        self.device = model_device(model)
        self.dtype = dtype
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.sampling = sampling
        self.generator = generator
        self.rows: list[_Row] = []
        self.cache: Any = None  # a transformers DynamicCache while rows are live
        self.mask: torch.Tensor | None = None  # [R, T] long
        self.next_pos: torch.Tensor | None = None  # [R] position of the next input token
        self.next_tok: torch.Tensor | None = None  # [R] last sampled token (not yet in cache)
        self.version = 0

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ add / remove
    @torch.no_grad()
    def add(self, requests: list[Request]) -> list[Completion]:
        """Prefill ``requests`` and join them to the running batch.

        Returns completions that finished already at their first token.
        """
        if not requests:
            return []
        logits = self._prefill([r.prompt_ids for r in requests], [_Row(req=r, version=self.version) for r in requests])
        for r in requests:
            r.version = self.version
        return self._sample_and_append(logits, first=len(self.rows) - len(requests))

    def partials(self) -> list[Partial]:
        """The live rows as they stand (copies; the rows stay live): a checkpoint's in-flight answers."""
        return [Partial(row.req, list(row.out), list(row.logprobs), list(row.versions), row.version)
                for row in self.rows]

    @torch.no_grad()
    def resume(self, parts: list[Partial]) -> list[Completion]:
        """Continue answers saved by :meth:`partials` (in another process, a resumed run): their
        KV cache is rebuilt under the current weights from prompt + tokens so far (as
        :meth:`recompute_cache` does), the last token is the next input, and they decode on with
        their tokens, log-probs, per-token versions and start version kept. Nothing finishes here."""
        parts = [p for p in parts if p.response_ids]  # (a live row has sampled at least one token)
        if parts:
            rows = [_Row(req=p.req, out=list(p.response_ids), logprobs=list(p.logprobs), version=p.version,
                         versions=list(p.token_versions)) for p in parts]
            self._prefill([p.req.prompt_ids + p.response_ids[:-1] for p in parts], rows)
            assert self.next_tok is not None  # set by _merge
            self.next_tok[len(self.rows) - len(rows):] = torch.tensor([p.response_ids[-1] for p in parts],
                                                                      dtype=torch.long, device=self.device)
        return []

    def _prefill(self, seqs: list[list[int]], rows: list[_Row]) -> torch.Tensor:
        """Put ``seqs`` (one per new row, left-padded) through the model into a new cache, join
        the rows to the batch; the last position's logits."""
        lens = [len(s) for s in seqs]
        L = max(lens)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, L - lens[i]:] = torch.tensor(seq, dtype=torch.long)
            mask[i, L - lens[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        self._merge(rows, cache, mask, torch.tensor(lens, dtype=torch.long, device=self.device))
        return out.logits[:, -1, :]

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos = rows, cache, mask, next_pos
            self.next_tok = torch.zeros(len(rows), dtype=torch.long, device=self.device)
            return
        assert self.mask is not None  # set while rows are live
        assert self.next_pos is not None and self.next_tok is not None
        T_old, T_new = self.mask.shape[1], mask.shape[1]
        T = max(T_old, T_new)
        for layer_old, layer_new in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(layer_old, name), getattr(layer_new, name)
                setattr(layer_old, name, torch.cat([_left_pad(a, T, dim=2), _left_pad(b, T, dim=2)], 0))
        self.mask = torch.cat([_left_pad(self.mask, T, dim=1), _left_pad(mask, T, dim=1)], 0)
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.next_tok = torch.cat([self.next_tok, torch.zeros(len(rows), dtype=torch.long, device=self.device)])
        self.rows = self.rows + rows

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask, self.next_pos, self.next_tok = [], None, None, None, None
            return
        assert self.mask is not None  # set while rows are live
        assert self.next_pos is not None and self.next_tok is not None
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask = self.mask[idx]
        self.next_pos, self.next_tok = self.next_pos[idx], self.next_tok[idx]
        # Drop leading columns that are padding in every remaining row.
        live = self.mask.any(0).nonzero()
        start = int(live[0]) if len(live) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def step(self) -> list[Completion]:
        """Decode one token for every row; return the rows that finished."""
        if not self.rows:
            return []
        assert self.mask is not None and self.next_pos is not None and self.next_tok is not None  # rows are live
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], 1)
        out = self._forward(input_ids=self.next_tok[:, None], attention_mask=self.mask,
                            position_ids=self.next_pos[:, None], past_key_values=self.cache)
        self.next_pos = self.next_pos + 1
        return self._sample_and_append(out.logits[:, -1, :], first=0)

    def _sample_and_append(self, logits: torch.Tensor, first: int) -> list[Completion]:
        rows = self.rows[first:]
        logits = logits.float()
        early = [i for i, row in enumerate(rows) if len(row.out) < row.req.min_new_tokens]
        if early:  # EOS (and stop ids) not allowed before min_new_tokens: sample from the masked logits...
            masked = logits.clone()
            for i in early:
                masked[i, [self.eos_id, *rows[i].req.stop_ids]] = float("-inf")
            tok, _ = sample_tokens(masked, self.sampling, self.generator)
            logp = token_logprob(logits, tok, self.sampling)  # ...but record the policy's own log-prob
        else:
            tok, logp = sample_tokens(logits, self.sampling, self.generator)
        assert self.next_tok is not None  # set by _merge
        self.next_tok[first:] = tok
        done: list[Completion] = []
        keep = list(range(first))
        tok_l, logp_l = tok.tolist(), logp.tolist()
        for i, row in enumerate(rows):
            row.out.append(tok_l[i])
            row.logprobs.append(logp_l[i])
            row.versions.append(self.version)
            limit = row.req.max_new_tokens or self.sampling.max_new_tokens
            eos = tok_l[i] == self.eos_id
            stop = eos or tok_l[i] in row.req.stop_ids
            if stop or len(row.out) >= limit:
                reason = "eos" if eos else "stop" if stop else "length"
                done.append(Completion(row.req.key, row.req.prompt_ids, row.out, row.logprobs,
                                       row.version, eos, row.versions, reason))
            else:
                keep.append(first + i)
        self._keep(keep)
        return done

    def drop_all(self) -> list[Request]:
        """Remove every live row (``rollout.on_swap=discard``); return their requests."""
        reqs = [row.req for row in self.rows]
        self._keep([])
        return reqs

    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        """Remove the live rows whose request ``which(req)`` is true; return their requests."""
        out = [row.req for row in self.rows if which(row.req)]
        if out:
            self._keep([i for i, row in enumerate(self.rows) if not which(row.req)])
        return out

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def recompute_cache(self) -> None:
        """Rebuild the KV cache of the live rows under the current weights (partial rollout)."""
        if not self.rows:
            return
        assert self.mask is not None  # rows are live
        R, T = self.mask.shape
        ids = torch.full((R, T), self.pad_id, dtype=torch.long)
        for i, row in enumerate(self.rows):
            seq = row.req.prompt_ids + row.out[:-1]  # the last sampled token is the next input
            ids[i, T - len(seq):] = torch.tensor(seq, dtype=torch.long)
        ids = ids.to(self.device)
        pos = (self.mask.cumsum(1) - 1).clamp(min=0)
        self.cache = DynamicCache()
        self._forward(input_ids=ids, attention_mask=self.mask, position_ids=pos, past_key_values=self.cache)

    def _forward(self, **kw: Any) -> Any:
        with autocast(self.dtype, self.device):
            return self.model(use_cache=True, **kw)


def _left_pad(x: torch.Tensor, T: int, dim: int) -> torch.Tensor:
    pad = T - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim)


def token_logprob(logits: torch.Tensor, tok: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Log-prob of ``tok`` under ``softmax(logits / T)`` (T = 1 when greedy): what training recomputes."""
    t = sp.temperature if sp.temperature > 0 else 1.0
    return F.log_softmax(logits / t, -1).gather(1, tok[:, None])[:, 0]


def sample_tokens(logits: torch.Tensor, sp: SamplingParams,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-prob under softmax(logits / T)).

    Greedy when ``temperature == 0`` (log-probs then use T = 1). Top-p truncates the
    sampling distribution only; the recorded log-prob is the untruncated one, which is
    what the trainer recomputes.
    """
    if sp.temperature <= 0:
        logp = F.log_softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(1, tok[:, None])[:, 0]
    logp = F.log_softmax(logits / sp.temperature, -1)
    probs = logp.exp()
    if sp.top_p < 1.0:
        probs = nucleus(probs, sp.top_p)
    tok = draw(probs, generator)
    return tok, logp.gather(1, tok[:, None])[:, 0]
