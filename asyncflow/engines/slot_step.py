"""The device side of the built-in engine's decode: per-slot state, the decode step, the prefill.

Design
------
:class:`SlotState` holds every number a decode step needs, one entry per slot, as device
tensors allocated once: the next input token and its position (= the slot's cached tokens),
whether the slot is live, tokens generated this turn, the turn's min/max lengths, the stop
table (column 0 = EOS, then the request's ``stop_ids``, padded with EOS), the step's uniform
numbers and its packed output ``out`` (token, log-prob, stop code per slot: one small copy to
the host per step).

:meth:`SlotStep.decode` is one step for slots ``0 .. B-1`` (or, eagerly, a tensor of slots:
the live ones, when finished rows left holes) attending to ``T`` cache columns: embed, every
layer (through the model's own forward, with a :class:`SlotCache`, a 4-D per-slot boolean mask
and our attention function :func:`slot_attention`, registered with transformers'
``AttentionInterface`` and selected only for the duration of our forwards), logits, sampling,
log-prob and the stop check, for all rows at once; then the state advances in place. It reads
and writes only preallocated tensors and never waits for the host, so it is **the function a
CUDA graph captures** (:mod:`asyncflow.engines.slot_graphs`) and the function a CPU runs as
is: the CPU tests cover the graphs' logic. Rows in the range that are not live (finished,
kept, never used) compute garbage that nobody reads: they write to the cache's scratch
column, attend to column 0 only (never a fully masked row: SDPA would give NaN), and keep
their state.

How a step draws (:func:`choose`): the log-prob recorded is ``log_softmax(logits / T)`` at the
token, the unmasked policy's (what training recomputes); the token is drawn from the same
distribution with the stop tokens barred while ``n_gen < min_new`` (EOS and ``stop_ids`` alike),
top-p applied. Two draw rules: ``uniform`` (a GPU's: :func:`~asyncflow.engines.sampling.inverse_cdf`
from uniform numbers the host draws ahead, one per live row in admission order, into
``state.u``: no generator inside the graph) and the CPU's, :func:`~asyncflow.engines.sampling.draw`
over the live rows in admission order. For a vocabulary from 4,096 entries on they are the same
rule on the same stream; below it the CPU keeps ``torch.multinomial``'s stream, so the reference
engine (:class:`~asyncflow.engines.inference.GenerationBatch`) and this one draw the same tokens
under one seed.

:meth:`SlotStep.prefill` feeds token runs into slots (a prompt from column 0, an observation
after a kept row's history), left-padded into one batch (so the last column is every row's last
token and the model computes logits for it alone: ``logits_to_keep=1``), in row chunks that
bound the 4-D mask; padding queries write to the scratch column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from asyncflow.engines.sampling import draw, inverse_cdf, nucleus
from asyncflow.engines.slot_cache import SlotCache
from asyncflow.engines.types import SamplingParams

REASONS = {1: "eos", 2: "stop", 3: "length"}  # codes in out[2]; 0: running; -1: a broken row
BROKEN = -1
MASK_BUDGET = 1 << 24  # prefill: rows x queries x keys of one chunk's 4-D mask
TOKEN_BUDGET = 1 << 14  # prefill: tokens of one chunk

Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]  # probs -> (tokens, ok rows)


@dataclass
class SlotState:
    """Per-slot decode state on the device (see module doc); every tensor's first axis is the slot."""

    tok: torch.Tensor  # long: next input token (sampled, not yet in the cache)
    pos: torch.Tensor  # long: its position = tokens in the slot's cache
    live: torch.Tensor  # bool
    n_gen: torch.Tensor  # long: tokens generated this turn (tok included)
    min_new: torch.Tensor  # long
    max_new: torch.Tensor  # long
    stops: torch.Tensor  # long [slots, width]: EOS, the request's stop ids, EOS padding
    u: torch.Tensor  # float64: this step's uniform number (uniform draws)
    out: torch.Tensor  # float64 [3, slots]: token, log-prob, stop code of the last step

    @classmethod
    def allocate(cls, slots: int, width: int, eos_id: int, device: torch.device) -> SlotState:
        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(slots, dtype=dtype, device=device)

        return cls(tok=z(torch.long), pos=z(torch.long), live=z(torch.bool), n_gen=z(torch.long),
                   min_new=z(torch.long), max_new=z(torch.long),
                   stops=torch.full((slots, width), eos_id, dtype=torch.long, device=device),
                   u=z(torch.float64), out=torch.zeros((3, slots), dtype=torch.float64, device=device))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name).clone() for f in fields(self)}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        for name, t in snap.items():
            getattr(self, name).copy_(t)

    def put(self, idx: torch.Tensor, **values: torch.Tensor) -> None:
        """Write ``values`` (name -> per-row tensor) at slots ``idx``."""
        for name, v in values.items():
            getattr(self, name)[idx] = v

    def widen(self, width: int, eos_id: int) -> None:
        """Room for ``width - 1`` stop ids per slot (a new tensor: captured graphs go stale)."""
        wider = torch.full((self.stops.shape[0], width), eos_id, dtype=torch.long, device=self.stops.device)
        wider[:, :self.stops.shape[1]] = self.stops
        self.stops = wider


def choose(logits: torch.Tensor, n_gen: torch.Tensor, min_new: torch.Tensor, max_new: torch.Tensor,
           stops: torch.Tensor, sp: SamplingParams, pick: Pick) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, their log-probs and stop codes for one row each of ``logits`` (may be overwritten).

    ``n_gen`` is the tokens each row generated before this one; the code is 1 (EOS), 2 (a stop
    id), 3 (``max_new`` reached), 0 (running) or -1 (probabilities not finite: a broken row).
    Greedy when ``sp.temperature <= 0`` (log-probs then at T = 1). Passes over ``[rows, vocab]``
    are what a large vocabulary costs, so the barred stop tokens are written in place and the
    recorded log-prob is ``z[tok] - logsumexp(z)``: a barred token is never drawn, so its
    unbarred logit is not needed."""
    t = sp.temperature if sp.temperature > 0 else 1.0
    z = logits.float() if t == 1.0 else logits.float() / t
    lse = torch.logsumexp(z, -1)
    early = (n_gen < min_new)[:, None]
    z.scatter_(1, stops, torch.where(early, float("-inf"), z.gather(1, stops)))
    ok = None
    if sp.temperature <= 0:
        tok = z.argmax(-1)
    else:
        probs = torch.softmax(z, -1)
        if sp.top_p < 1.0:
            probs = nucleus(probs, sp.top_p)
        tok, ok = pick(probs)
    logp = z.gather(1, tok[:, None])[:, 0] - lse
    hit = tok[:, None] == stops
    code = torch.where(hit[:, 0], 1, torch.where(hit.any(-1), 2, torch.where(n_gen + 1 >= max_new, 3, 0)))
    if ok is not None:
        code = torch.where(ok, code, BROKEN)
    return tok, logp, code


ATTENTION = "asyncflow_slots"  # the attention function our forwards select (registered below)


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The slot path's attention (a transformers ``AttentionInterface`` function): SDPA under the
    per-slot boolean mask. A decode step's single query packs the query heads of each key/value
    head as that head's queries, so every cached key is read once (no ``repeat_kv``: at 14/2 heads
    that copy would move 7x the cache's bytes a step); a prefill repeats the key/value heads."""
    B, H, q, d = query.shape
    kv = key.shape[1]
    if q == 1 and H != kv:
        out = F.scaled_dot_product_attention(query.reshape(B, kv, H // kv, d), key, value,
                                             attn_mask=attention_mask, scale=scaling).reshape(B, H, 1, d)
    else:
        if H != kv:
            key, value = key.repeat_interleave(H // kv, 1), value.repeat_interleave(H // kv, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, slot_attention)


def attention_configs(model: torch.nn.Module) -> list[Any] | None:
    """The configs whose ``_attn_implementation`` the model's attention layers read, or None when
    the slot path cannot drive the model (no Hugging Face config, sliding-window layers)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                           "_attn_implementation")}
    if not configs or any("sliding_attention" in (getattr(c, "layer_types", None) or ()) for c in configs.values()):
        return None
    return list(configs.values())


@contextlib.contextmanager
def selected(configs: list[Any]) -> Iterator[None]:
    """Our attention function for the forwards inside (the previous one restored after: a
    colocated trainer's forwards keep theirs, and a saved config never names ours)."""
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for c, impl in zip(configs, saved):
            c._attn_implementation = impl


class SlotStep:
    """The decode step and the prefill of one batch's slots (see module doc)."""

    def __init__(self, model: torch.nn.Module, cache: SlotCache, state: SlotState, dtype: str,
                 uniform: bool, generator: torch.Generator | None, pad_id: int = 0):
        self.model, self.cache, self.state = model, cache, state
        self.device = state.tok.device
        self.uniform, self.generator, self.pad_id = uniform, generator, pad_id
        self.sampling = SamplingParams()
        self.order: torch.Tensor | None = None  # CPU draws: the live rows among a step's rows, in admission order
        configs = attention_configs(model)
        if configs is None:
            raise ValueError("the slot path drives Hugging Face causal LMs with full attention (no sliding window)")
        self.configs = configs
        self.bf16 = dtype == "bfloat16"

    # ------------------------------------------------------------------ decode (graph-capturable)
    def decode(self, rows: slice | torch.Tensor, T: int) -> None:
        """One token for every live slot among ``rows`` (``slice(0, B)``: the graphs' fixed range;
        or a tensor of slot ids: an eager step over the live slots only), attending to ``T``
        columns (``T`` > every live slot's position); the state advances in place and
        ``out[:, rows]`` holds the result."""
        st = self.state
        tok, pos, live, n_gen = st.tok[rows], st.pos[rows], st.live[rows], st.n_gen[rows]
        index = torch.arange(rows.start, rows.stop, device=self.device) if isinstance(rows, slice) else rows
        self.cache.bind(rows, index, torch.where(live, pos, self.cache.capacity)[:, None], T)
        cols = torch.arange(T, device=self.device)[None, :]
        see = ((cols <= pos[:, None]) & live[:, None]) | (cols == 0)
        logits = self.forward(tok[:, None], see[:, None, None, :], pos[:, None])
        new, logp, code = choose(logits, n_gen, st.min_new[rows], st.max_new[rows], st.stops[rows], self.sampling,
                                 self.picker(rows))
        code = torch.where(live, code, 0)
        st.out[0, rows] = new.double()
        st.out[1, rows] = logp.double()
        st.out[2, rows] = code.double()
        st.tok[rows] = torch.where(live, new, tok)
        st.pos[rows] = pos + live
        st.n_gen[rows] = n_gen + live
        st.live[rows] = live & (code == 0)

    def picker(self, rows: slice | torch.Tensor) -> Pick:
        """How this step draws for ``rows`` (see module doc)."""
        if self.uniform:
            u = self.state.u[rows]
            return lambda probs: inverse_cdf(probs, u)
        order = self.order
        assert order is not None, "set order (live rows' indices in admission order) before a CPU step"

        def pick(probs: torch.Tensor) -> tuple[torch.Tensor, None]:
            tok = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
            tok[order] = draw(probs[order], self.generator)
            return tok, None

        return pick

    # ------------------------------------------------------------------ prefill (eager)
    def prefill(self, slots: list[int], starts: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """Feed ``seqs[i]`` into slot ``slots[i]`` from column ``starts[i]``; the logits after each
        run's last token (``[rows, vocab]``, float32)."""
        out, i = [], 0
        while i < len(seqs):
            j, width, keys = i + 1, len(seqs[i]), starts[i] + len(seqs[i])
            while j < len(seqs):  # grow the chunk while its mask and tokens stay in budget
                w, k = max(width, len(seqs[j])), max(keys, starts[j] + len(seqs[j]))
                if (j + 1 - i) * w * k > MASK_BUDGET or (j + 1 - i) * w > TOKEN_BUDGET:
                    break
                j, width, keys = j + 1, w, k
            out.append(self._prefill_chunk(slots[i:j], starts[i:j], seqs[i:j]))
            i = j
        return torch.cat(out)

    def _prefill_chunk(self, slots: list[int], starts: list[int], seqs: list[list[int]]) -> torch.Tensor:
        lens = [len(s) for s in seqs]
        if min(lens) < 1:
            raise ValueError("prefill: every run needs at least one token")
        L, T = max(lens), max(s + n for s, n in zip(starts, lens))
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, L - lens[i]:] = torch.tensor(seq, dtype=torch.long)
        dev = self.device
        start = torch.tensor(starts, dtype=torch.long, device=dev)[:, None]
        pad = torch.tensor([L - n for n in lens], dtype=torch.long, device=dev)[:, None]
        c = torch.arange(L, device=dev)[None, :]
        pos, real = start + c - pad, c >= pad  # [rows, L]
        keys = torch.arange(T, device=dev)[None, None, :]
        see = (real[:, :, None] & (keys <= pos[:, :, None])) | (~real[:, :, None] & (keys == 0))
        index = torch.tensor(slots, dtype=torch.long, device=dev)
        self.cache.bind(index, index, torch.where(real, pos, self.cache.capacity), T)
        return self.forward(ids.to(dev), see[:, None], torch.where(real, pos, 0))

    # ------------------------------------------------------------------ the model
    def forward(self, ids: torch.Tensor, see: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The model over ``ids`` with the bound cache; logits of the last column (float32)."""
        with self._precision(), selected(self.configs):
            out: Any = self.model(input_ids=ids, attention_mask=see, position_ids=pos, past_key_values=self.cache,
                                  use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _precision(self) -> contextlib.AbstractContextManager:
        # cache_enabled=False: autocast's weight-cast cache must not outlive a graph capture
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
