"""What the vLLM and SGLang stand-ins (``tests/fake_vllm.py``, ``tests/fake_sglang.py``) share:
a real tiny Hugging Face model decoding with a real KV cache and a prefix cache.

Both real engines keep the KV of full blocks of tokens after a request ends (vLLM 0.33.0:
``vllm/v1/core/block_pool.py``, hashes kept until evicted or ``reset_prefix_cache``; SGLang
0.5.23: the radix cache in ``sglang/srt/mem_cache``, cleared by ``flush_cache``), and a new
request whose tokens start with a cached prefix reuses that KV instead of recomputing it.
This module does the same with ``transformers``' ``DynamicCache``: the KV of every full
block is stored under its token prefix, whatever weights computed it. So when an adapter
loads new weights and forgets to clear the cache, a re-submitted answer is continued from
KV of the old weights and its log-probs differ from a recompute under the new weights,
exactly the error the real engines would make.

Sampling: ``log_softmax(logits / T)`` of the sampled token (vLLM's ``processed_logprobs``,
SGLang's default), ``min_tokens`` masks the end token first (a logits processor in both).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

BLOCK = 4  # tokens per KV block (vLLM's default is 16, SGLang's radix pages 1: small here so short prompts fill blocks)


@dataclass
class Seq:
    """One request inside an engine: its tokens so far and the KV computed for them."""

    rid: str
    tokens: list[int]
    n_prompt: int
    max_tokens: int
    min_tokens: int
    temperature: float
    seed: int
    logprobs: list[float] = field(default_factory=list)
    cache: Any = None  # DynamicCache for tokens[:computed], or None (to be (re)computed)
    computed: int = 0
    reused: int = 0  # tokens whose KV came from the prefix cache at the last prefill
    generator: torch.Generator | None = None

    @property
    def n_out(self) -> int:
        return len(self.tokens) - self.n_prompt

    def drop_kv(self) -> None:
        """Preempted / retracted: its KV is freed and will be recomputed from its tokens."""
        self.cache, self.computed = None, 0


def request_seed(seed: int, rid: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(rid.encode())) % (2**31)


class PrefixDecoder:
    """Decodes :class:`Seq` rows one token at a time with a block prefix cache."""

    def __init__(self, model: torch.nn.Module, eos_id: int):
        self.model, self.eos_id = model.eval(), eos_id
        self.prefix: dict[tuple[int, ...], Any] = {}  # token prefix (whole blocks) -> KV of exactly those tokens
        self.hits = 0  # prefills that reused a cached prefix

    def clear(self) -> None:
        self.prefix.clear()

    def _feed(self, seq: Seq, upto: int) -> torch.Tensor:
        """Run the model on ``tokens[computed:upto]`` block by block; store each full block's KV."""
        from transformers import DynamicCache

        if seq.cache is None:
            seq.cache, seq.computed = DynamicCache(config=self.model.config), 0
        logits = None
        while seq.computed < upto:
            stop = min(upto, (seq.computed // BLOCK + 1) * BLOCK)
            ids = torch.tensor([seq.tokens[seq.computed:stop]])
            out = self.model(ids, past_key_values=seq.cache, use_cache=True)
            seq.cache, seq.computed, logits = out.past_key_values, stop, out.logits[0, -1]
            if stop % BLOCK == 0:
                self.prefix.setdefault(tuple(seq.tokens[:stop]), copy.deepcopy(seq.cache))
        assert logits is not None
        return logits

    def _prefill_start(self, seq: Seq) -> None:
        """Reuse the longest cached whole-block prefix (at least the last token is computed)."""
        for length in range(((len(seq.tokens) - 1) // BLOCK) * BLOCK, 0, -BLOCK):
            kv = self.prefix.get(tuple(seq.tokens[:length]))
            if kv is not None:
                seq.cache, seq.computed, seq.reused = copy.deepcopy(kv), length, length
                self.hits += 1
                return
        seq.reused = 0

    @torch.no_grad()
    def next_token(self, seq: Seq) -> tuple[int, float]:
        """Sample ``seq``'s next token (appended) and return it with its processed log-prob."""
        if seq.cache is None:
            self._prefill_start(seq)
        logits = self._feed(seq, len(seq.tokens)).float().clone()
        if seq.n_out < seq.min_tokens:
            logits[self.eos_id] = float("-inf")
        if seq.temperature <= 0:
            logp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(logp))
        else:
            logp = torch.log_softmax(logits / seq.temperature, -1)
            if seq.generator is None:
                seq.generator = torch.Generator().manual_seed(seq.seed)
            tok = int(torch.multinomial(logp.exp(), 1, generator=seq.generator))
        seq.tokens.append(tok)
        seq.logprobs.append(float(logp[tok]))
        return tok, float(logp[tok])

    def finish_reason(self, seq: Seq) -> str | None:
        if seq.n_out >= seq.max_tokens:
            return "length"
        if seq.tokens[-1] == self.eos_id and seq.n_out >= seq.min_tokens:
            return "stop"
        return None


def load_named(model: torch.nn.Module, weights: Any) -> set[str]:
    """Copy ``(name, tensor)`` pairs into ``model`` by Hugging Face name, as the engines'
    ``load_weights`` do: an unknown name is a ``KeyError``, a wrong shape a ``ValueError``,
    and anything but a tensor a ``TypeError`` (a ``[dtype, shape, buffer]`` list included)."""
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, t in weights:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weight {name!r} arrived as a {type(t).__name__}, not a tensor")
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)}, the model has {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
            loaded.add(name)
    return loaded
