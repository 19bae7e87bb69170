"""The records every inference engine speaks (built-in, fake, vLLM, SGLang); no torch here.

The rollout role talks to an engine only through these and a small protocol:
``engine.version``, ``engine.max_batch``, ``engine.new_batch(sampling)`` returning a batch
with ``add(requests) -> [Completion]``, ``step() -> [Completion]``, ``len()``,
``version``, ``recompute_cache()``, ``drop_all() -> [Request]`` and ``drop(which) -> [Request]``
(the live rows whose request ``which(req)`` is true: over-provisioned stragglers); and
``engine.load_weights(version, tensors)``. Completions carry one log-prob and one policy
version per generated token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8


@dataclass
class Request:
    """One sequence to generate. ``key`` is opaque to the engine (the caller's id)."""

    key: Any
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # overrides SamplingParams.max_new_tokens
    min_new_tokens: int = 0
    version: int = 0  # policy version when the request was admitted (filled by the engine)


@dataclass
class Completion:
    """A finished sequence: generated ids (EOS included when it stopped on EOS)."""

    key: Any
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    version: int  # oldest policy version that produced any of its tokens
    finished_on_eos: bool
    token_versions: list[int] = field(default_factory=list)  # policy version that sampled each token
