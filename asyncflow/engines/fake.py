"""A deterministic fake inference engine for tests of the other roles (no torch, no model).

It speaks the engine protocol of :mod:`asyncflow.engines.types` (what
:class:`~asyncflow.workflow.rollout.RolloutRole` uses): ``new_batch`` / ``add`` / ``step`` /
``drop_all`` / ``drop`` / ``recompute_cache`` / ``partials`` / ``resume``, the multi-turn
``extend`` / ``release`` (``stop_ids``, ``keep``), ``generate`` and ``load_weights``, with the same
continuous-batching slot rules as the built-in engine, so a role test exercises the real
role code while generation costs microseconds.

Scripted behaviour
------------------
* ``answer(request) -> token ids``: the whole answer a request will produce (default:
  :func:`default_answer`, ``max_new_tokens - 1`` digits then EOS, or exactly
  ``min_new_tokens`` digits when the request forces a length). One token is emitted per
  ``step`` (the first at ``add``, as prefill does), so an answer of n tokens finishes at
  the (n-1)-th step after it was added: long answers really occupy slots longer.
* ``logprob(version, position) -> float``: the recorded log-prob of a token (default
  ``-1.0`` for every token); tests can make it depend on the version to see which weights
  "produced" a token.
* A request's ``stop_ids`` end its answer at the first scripted token among them (after
  ``min_new_tokens``); a ``keep`` request's tokens are kept for ``extend``, whose turn is
  scripted by ``answer`` for a request whose prompt is the whole history. ``FakeEngine(keep=False)``:
  batches without ``extend``/``release``, like an engine without the capability (the caller sends
  the whole history as a new request).
* ``load_weights(version, tensors)`` only records the version (and the names it got);
  ``recompute_cache`` counts its calls.

Invariants: the output is a pure function of the requests, the script and the sequence of
calls (no randomness); ``token_versions`` records the batch version at each token, exactly
like the built-in engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from asyncflow.engines.types import Completion, Partial, Request, SamplingParams

EOS = 2


def default_answer(req: Request, sampling: SamplingParams, eos_id: int = EOS) -> list[int]:
    """Digits 4.. (cycling over 10 ids) then EOS; a forced length (``min_new_tokens``) gives
    exactly that many digits and no EOS, as the built-in engine's long-tail emulation does."""
    if req.min_new_tokens:
        return [4 + j % 10 for j in range(req.min_new_tokens)]
    n = req.max_new_tokens or sampling.max_new_tokens
    return [4 + j % 10 for j in range(n - 1)] + [eos_id]


class _FakeRow:
    def __init__(self, req: Request, answer: Sequence[int], version: int):
        self.req, self.answer, self.version = req, list(answer), version
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []


class FakeBatch:
    """Rows decoding together; one scripted token per row per :meth:`step`."""

    def __init__(self, engine: FakeEngine, sampling: SamplingParams):
        self.engine, self.sampling = engine, sampling
        self.rows: list[_FakeRow] = []
        self.version = engine.version
        self.recomputes = 0
        self.kept: dict[Any, tuple[Request, list[int]]] = {}  # key -> (request, every token so far)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, requests: list[Request]) -> list[Completion]:
        new = []
        for r in requests:
            r.version = self.version
            new.append(_FakeRow(r, self.engine.answer(r, self.sampling), self.version))
        self.rows.extend(new)
        return self._advance(new)

    def step(self) -> list[Completion]:
        return self._advance(list(self.rows))

    def _advance(self, rows: list[_FakeRow]) -> list[Completion]:
        done, ended = [], set()
        for row in rows:
            pos = len(row.out)
            tok = row.answer[pos]
            row.out.append(tok)
            row.logprobs.append(float(self.engine.logprob(self.version, pos)))
            row.versions.append(self.version)
            limit = row.req.max_new_tokens or self.sampling.max_new_tokens
            eos = tok == self.engine.eos_id
            stop = not eos and tok in row.req.stop_ids and len(row.out) > row.req.min_new_tokens
            if eos or stop or len(row.out) >= min(limit, len(row.answer)):
                done.append(Completion(row.req.key, row.req.prompt_ids, row.out, row.logprobs, row.version, eos,
                                       row.versions, "eos" if eos else "stop" if stop else "length"))
                ended.add(id(row))
                if row.req.keep:
                    self.kept[row.req.key] = (row.req, row.req.prompt_ids + row.out)
        if ended:
            self.rows = [r for r in self.rows if id(r) not in ended]
        return done

    def drop_all(self) -> list[Request]:
        reqs = [r.req for r in self.rows]
        self.rows = []
        return reqs

    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        out = [r.req for r in self.rows if which(r.req)]
        self.rows = [r for r in self.rows if not which(r.req)]
        return out

    def recompute_cache(self) -> None:
        self.recomputes += 1

    def partials(self) -> list[Partial]:
        """The live rows as they stand (copies; they stay live)."""
        return [Partial(r.req, list(r.out), list(r.logprobs), list(r.versions), r.version) for r in self.rows]

    def resume(self, parts: list[Partial]) -> list[Completion]:
        """Continue saved answers: each goes on with its scripted answer after its saved tokens."""
        for p in parts:
            row = _FakeRow(p.req, self.engine.answer(p.req, self.sampling), p.version)
            row.out, row.logprobs, row.versions = list(p.response_ids), list(p.logprobs), list(p.token_versions)
            self.rows.append(row)
        return []


class FakeKeepBatch(FakeBatch):
    """A :class:`FakeBatch` with the multi-turn capability (``extend``/``release``,
    :class:`~asyncflow.engines.types.MultiTurnBatch`); ``FakeEngine(keep=False)`` makes a
    plain :class:`FakeBatch` instead, like an engine that cannot keep a row's cache."""

    extended = 0  # extend calls (tests check which path a driver took)

    def extend(self, key: Any, append_ids: list[int], max_new_tokens: int, min_new_tokens: int = 0) -> list[Completion]:
        """Continue a kept row: a new turn scripted by ``answer`` for a request whose prompt is the
        whole history plus ``append_ids`` (``MultiTurnBatch``)."""
        if key not in self.kept:
            raise KeyError(f"extend: no kept row with key {key!r} (not added with keep=True, released, "
                           f"or still generating)")
        old, history = self.kept.pop(key)
        self.extended += 1
        req = Request(key, history + list(append_ids), max_new_tokens, min_new_tokens, stop_ids=old.stop_ids,
                      keep=True)
        return self.add([req])

    def release(self, key: Any) -> None:
        """Forget a kept row (a live one is not kept when it finishes)."""
        if key in self.kept:
            del self.kept[key]
            return
        for r in self.rows:
            if r.req.key == key:
                r.req = Request(r.req.key, r.req.prompt_ids, r.req.max_new_tokens, r.req.min_new_tokens,
                                r.req.version, r.req.stop_ids, keep=False)
                return
        raise KeyError(f"release: no kept or live row with key {key!r}")


class FakeEngine:
    """Drop-in for :class:`~asyncflow.engines.inference.InferenceEngine` in role tests."""

    def __init__(self, answer: Callable[[Request, SamplingParams], Sequence[int]] | None = None,
                 logprob: float | Callable[[int, int], float] = -1.0, eos_id: int = EOS, max_batch: int = 64,
                 keep: bool = True):
        self.eos_id, self.max_batch, self.keep = eos_id, max_batch, keep
        self.answer = answer or (lambda req, sp: default_answer(req, sp, eos_id))
        self.logprob = logprob if callable(logprob) else (lambda version, pos, _v=float(logprob): _v)
        self.version = 0
        self.loaded: list[tuple[int, list[str]]] = []  # (version, tensor names) per load_weights
        self.busy_slots = 0
        self.total_slots = 0

    def new_batch(self, sampling: SamplingParams) -> FakeBatch:
        return FakeKeepBatch(self, sampling) if self.keep else FakeBatch(self, sampling)

    def generate(self, requests: Iterable[Request], sampling: SamplingParams,
                 on_done: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Continuous batching over ``requests``, as the built-in engine; completion order."""
        pending, batch, results = deque(requests), self.new_batch(sampling), []
        while pending or len(batch):
            free = self.max_batch - len(batch)
            done = batch.add([pending.popleft() for _ in range(min(free, len(pending)))]) if free and pending else []
            if len(batch):
                self.busy_slots += len(batch)
                self.total_slots += self.max_batch
                done += batch.step()
            results += done
            if on_done:
                for c in done:
                    on_done(c)
        return results

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        self.loaded.append((version, sorted(tensors)))
        self.version = version
