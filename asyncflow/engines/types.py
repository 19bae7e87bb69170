"""The inference engine protocol (:class:`Engine`, :class:`EngineBatch`) and the records
every inference engine speaks (built-in, fake, vLLM, SGLang); no torch here.

The rollout role talks to an engine only through these: ``engine.version``,
``engine.max_batch``, ``engine.new_batch(sampling)`` returning an :class:`EngineBatch`
(``add(requests) -> [Completion]``, ``step() -> [Completion]``, ``len()``, ``version``,
``recompute_cache()``, ``drop_all() -> [Request]`` and ``drop(which) -> [Request]``, the
live rows whose request ``which(req)`` is true: over-provisioned stragglers); and
``engine.load_weights(version, tensors)``. Completions carry one log-prob and one policy
version per generated token, and why they stopped (``stop_reason``). Optional capabilities:
``partials``/``resume`` (continue answers across a restart, :class:`Partial`) and
:class:`MultiTurnBatch` (``extend``/``release``: continue a finished answer on its KV cache).

Implementations (one contract test, ``tests/test_contracts_inference.py``, runs against
each): the built-in :class:`asyncflow.engines.inference.InferenceEngine`, the test double
:class:`asyncflow.engines.fake.FakeEngine`, and the adapters
:class:`asyncflow.engines.adapters.StepEngine` (:class:`~asyncflow.engines.vllm_engine.VLLMEngine`,
:class:`~asyncflow.engines.sglang_engine.SGLangEngine`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8


@dataclass
class Request:
    """One sequence to generate. ``key`` is opaque to the engine (the caller's id).

    ``stop_ids`` and ``keep`` are for multi-turn callers (:class:`MultiTurnBatch`): extra token
    ids that end the answer besides EOS (the stopping token is part of the answer; like EOS,
    barred before ``min_new_tokens``), and whether the engine keeps the row's KV cache when it
    finishes, to continue it with ``extend``. An engine without the capability ignores ``keep``."""

    key: Any
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # overrides SamplingParams.max_new_tokens
    min_new_tokens: int = 0
    version: int = 0  # policy version when the request was admitted (filled by the engine)
    stop_ids: tuple[int, ...] = ()
    keep: bool = False


STOP_REASONS = ("eos", "stop", "length")


@dataclass
class Completion:
    """A finished sequence: generated ids (EOS or the stop id included when it stopped on one).

    ``stop_reason`` is ``"eos"``, ``"stop"`` (one of the request's ``stop_ids``) or ``"length"``
    (``max_new_tokens``); left empty by an engine, it is derived from ``finished_on_eos``."""

    key: Any
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    version: int  # oldest policy version that produced any of its tokens
    finished_on_eos: bool
    token_versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    stop_reason: str = ""

    def __post_init__(self) -> None:
        if not self.stop_reason:
            self.stop_reason = "eos" if self.finished_on_eos else "length"


@dataclass
class Partial:
    """A live answer's state, to continue it elsewhere (a resumed run): its request, the tokens
    generated so far with their log-probs and policy versions, and the version that started it.
    An engine that can continue answers offers ``batch.partials()`` (the live rows, kept live)
    and ``batch.resume(partials) -> [Completion]`` (rebuilds their KV cache from prompt +
    tokens and decodes on); one without them (vLLM, SGLang) has its answers restarted."""

    req: Request
    response_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    version: int


@runtime_checkable
class EngineBatch(Protocol):
    """Sequences decoding together (continuous batching); what ``Engine.new_batch`` returns.

    Invariants every implementation keeps:

    * every request added comes back exactly once, as a :class:`Completion` returned by
      ``add`` or a later ``step`` (unless ``drop_all``/``drop`` returned it first), with
      ``len(logprobs) == len(token_versions) == len(response_ids)`` and
      ``1 <= len(response_ids) <= max_new_tokens`` (the request's, else the sampling's);
    * ``add`` sets each request's ``version`` to the batch's ``version``; every token
      records the batch ``version`` when it was sampled, and ``Completion.version`` is the
      oldest of them (the caller moves ``version`` after a weight swap);
    * ``len(batch)`` is the number of live (unfinished, not dropped) requests;
      ``drop_all()`` returns exactly those and leaves the batch empty; ``drop(which)``
      returns and removes the live ones whose request ``which(req)`` is true;
    * ``recompute_cache()`` keeps every live request (their already generated tokens too)
      and continues them under the engine's current weights.
    """

    version: int

    def __len__(self) -> int: ...

    def add(self, requests: list[Request]) -> list[Completion]:
        """Start ``requests``; the ones that finished at their first token."""

    def step(self) -> list[Completion]:
        """Generate (at least) one token for the live requests; the ones that finished."""

    def recompute_cache(self) -> None:
        """Continue the live requests under the current weights (partial rollout)."""

    def drop_all(self) -> list[Request]:
        """Remove every live request; return them."""

    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        """Remove the live requests for which ``which(req)`` is true; return them."""


@runtime_checkable
class MultiTurnBatch(EngineBatch, Protocol):
    """An :class:`EngineBatch` that continues finished answers on their KV cache (multi-turn
    rollouts, token in / token out): an optional capability; a caller checks
    ``isinstance(batch, MultiTurnBatch)`` and otherwise starts each turn as a new
    :class:`Request` whose ``prompt_ids`` are the whole token history.

    * A request added with ``keep=True`` is *kept* when it finishes: its completion is returned
      as usual, and the engine holds its tokens (and, while it has room, its KV cache) under the
      request's ``key``. A kept row is not live (``len(batch)`` does not count it).
    * ``extend(key, append_ids, max_new_tokens, min_new_tokens=0)`` appends ``append_ids`` (an
      observation's tokens, never re-tokenised) after the kept row's last token, prefills only
      what its cache lacks, and generates the next turn as a live row again (``keep`` still
      holds): it comes back once, from ``extend`` or a later ``step``, as a :class:`Completion`
      whose ``prompt_ids`` are the whole history before the turn (all earlier tokens plus
      ``append_ids``) and whose ``response_ids``, log-probs and versions are the new turn's only.
      The caller counts it against ``max_batch`` like an ``add``.
    * ``release(key)`` forgets a kept row (a live one is simply not kept when it finishes).
    * ``extend``/``release`` of a key that is not kept (never was, released, still live) raise
      ``KeyError`` naming the key.
    * After a weight swap (``recompute_cache``, or ``version`` moved) a kept row's cache is
      stale: ``extend`` rebuilds it from the token history under the current weights. When
      slots run out, kept rows may lose their cache the same way (rebuilt on ``extend``).
    """

    def extend(self, key: Any, append_ids: list[int], max_new_tokens: int,
               min_new_tokens: int = 0) -> list[Completion]:
        """Continue the kept row ``key`` after ``append_ids``; the turn if it finished at once."""

    def release(self, key: Any) -> None:
        """Forget the kept row ``key``."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine as the rollout role drives it (see the module doc).

    ``version`` is the policy version of the weights it runs (writable: a colocated trainer
    moves the tag); ``load_weights(version, tensors)`` copies host buffers, by parameter name
    (numpy or torch; a checksum entry is not passed), into the model and sets ``version``,
    so batches made afterwards sample at the new version. ``max_batch`` is how many
    requests one batch may hold at once.
    """

    version: int
    max_batch: int

    def new_batch(self, sampling: SamplingParams) -> EngineBatch:
        """An empty batch at the engine's current ``version``."""

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        """Swap in ``tensors`` (between two ``step`` calls) and set ``version``."""
