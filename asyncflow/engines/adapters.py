"""What the external engine adapters (vLLM, SGLang) share; no engine import (see import_engine).

Design
------
An external engine is reached through a small **backend** (:class:`Backend`): ``submit``
a request under a string id, ``poll`` for progress, ``abort`` ids, ``load`` named weights.
:class:`StepEngine` owns the backend and routes each :class:`Update` to the
:class:`StepBatch` that submitted it (several batches may share one engine).
:class:`StepBatch` is the batch protocol the rollout role drives
(:mod:`asyncflow.engines.types`): ``add`` submits, ``step`` polls, ``drop_all`` / ``drop``
abort, ``recompute_cache`` re-submits each live answer with its generated prefix appended
to the prompt (the engine recomputes the prefix's KV under the new weights) and the
remaining token budget; the tokens already generated are kept. So the adapters keep the
built-in engine's partial-rollout semantics with no access to the engine's cache.

A weight update (``StepEngine.load_weights``) is the backend's: each engine pauses,
loads, clears its prefix cache and resumes through its own supported path (see
:mod:`~asyncflow.engines.vllm_engine`, :mod:`~asyncflow.engines.sglang_engine`); a step it
refuses or fails raises :class:`EngineStepError` naming the engine and the step, and the
backend refuses any further use (its weights are unknown). Updates the engine delivered
while loading (``Loaded.settled``: SGLang returns every live answer's tokens when it
pauses) are routed before the version changes, so their tokens keep the old version.

Invariants
----------
* A row's answer is the concatenation of its segments (one per submission); its log-probs
  and per-token versions line up with its tokens; ``token_versions`` records the batch
  version at the poll (or the load) that first reported each token; weights change only
  inside ``load_weights``.
* Backend updates are *cumulative per submission* (all tokens of that submission so far).
  An ``interrupted`` update ends its submission without ending the answer: the row is
  re-submitted (prompt + tokens so far) at the next ``step`` or ``recompute_cache``.
* ``len(batch)`` counts every answer not yet returned by ``step`` (live, waiting to be
  re-submitted, or finished during a load); ``drop_all`` / ``drop`` return all of those.
* Request ids are prefix-free (:func:`request_id`): SGLang aborts every id that starts
  with the aborted one.
* ``named_tensors`` (weight-name mapping): the weight store's numpy buffers become
  ``(hf_name, torch.Tensor)`` pairs in the Hugging Face checkpoint naming that both vLLM's
  and SGLang's ``load_weights`` expect: the checksum entry is dropped and wrapper prefixes
  (``module.`` from DDP, ``_orig_mod.`` from ``torch.compile``) are stripped.
"""

from __future__ import annotations

import importlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from asyncflow.engines.types import Completion, Request, SamplingParams

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
CHECKSUMS = "__crc32__"  # asyncflow.weights.store.CHECKSUMS (not imported: keeps this module light)


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face checkpoint name (wrapper prefixes stripped).

    >>> hf_name("module._orig_mod.model.layers.0.self_attn.q_proj.weight")
    'model.layers.0.self_attn.q_proj.weight'
    """
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def named_tensors(buffers: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(hf_name, torch tensor)`` for every weight in ``buffers`` (numpy or torch), sorted by
    name, without the checksum entry. Numpy buffers are wrapped without a copy."""
    out = []
    for name in sorted(buffers):
        if name == CHECKSUMS:
            continue
        t = buffers[name]
        out.append((hf_name(name), t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))))
    return out


@dataclass
class Update:
    """Progress of one submission: every token so far, their log-probs, and how it stands."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    stop_reason: str | None = None  # "stop" (EOS / stop token) or "length"
    interrupted: bool = False  # the engine ended the submission, not the answer (it goes on in a new one)


@dataclass
class Loaded:
    """What ``Backend.load`` did: ``path`` (how the weights went in, for logs and tests) and
    ``settled``: updates the engine delivered while loading (produced by the old weights)."""

    path: str
    settled: list[Update] = field(default_factory=list)


class EngineStepError(RuntimeError):
    """An external engine refused or failed a step (a weight update's, an abort): one line
    naming the engine and the step."""

    def __init__(self, engine: str, step: str, detail: str):
        super().__init__(f"{engine}: {step} failed: {' '.join(str(detail).split())}")
        self.engine, self.step = engine, step


class Backend(Protocol):
    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, min_tokens: int,
               sampling: SamplingParams) -> None: ...
    def poll(self) -> list[Update]: ...
    def abort(self, rids: Sequence[str]) -> None: ...
    def load(self, weights: list[tuple[str, Any]]) -> Loaded: ...


def request_id(n: int) -> str:
    """The engine-side id of submission ``n``: prefix-free (the final ``-`` ends every id).

    >>> request_id(1), request_id(10)
    ('af-1-', 'af-10-')
    """
    return f"af-{n}-"


class _Row:
    def __init__(self, req: Request, version: int):
        self.req, self.version = req, version
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.base = 0  # tokens generated by earlier submissions of this row


class StepBatch:
    """The batch protocol over a :class:`StepEngine`'s backend (see module doc)."""

    _ids = itertools.count()

    def __init__(self, engine: StepEngine, sampling: SamplingParams, version: int = 0):
        self.engine, self.backend, self.sampling = engine, engine.backend, sampling
        self.eos_id, self.version = engine.eos_id, version
        self.rows: dict[str, _Row] = {}  # live submission id -> row
        self.parked: list[_Row] = []  # answers whose submission the engine ended: re-submitted next
        self.ready: list[tuple[_Row, Completion]] = []  # finished during a load, returned by the next step

    def __len__(self) -> int:
        return len(self.rows) + len(self.parked) + len(self.ready)

    def _limit(self, req: Request) -> int:
        return req.max_new_tokens or self.sampling.max_new_tokens

    def _submit(self, row: _Row) -> None:
        rid = request_id(next(self._ids))
        row.base = len(row.out)
        left = self._limit(row.req) - row.base
        self.engine.route(rid, self)
        self.backend.submit(rid, list(row.req.prompt_ids) + row.out, left,
                            max(0, row.req.min_new_tokens - row.base), self.sampling)
        self.rows[rid] = row

    def add(self, requests: Iterable[Request]) -> list[Completion]:
        for r in requests:
            r.version = self.version
            self._submit(_Row(r, self.version))
        return []  # tokens arrive at the next step

    def deliver(self, u: Update) -> None:
        """One update from the engine (through :meth:`StepEngine.pump`), at this batch's version."""
        row = self.rows.get(u.rid)
        if row is None:  # an aborted submission still reporting
            return
        new = u.token_ids[len(row.out) - row.base:]
        row.out += new
        row.logprobs += u.logprobs[len(row.logprobs) - row.base:][: len(new)]
        row.versions += [self.version] * len(new)
        if len(row.logprobs) != len(row.out):
            raise ValueError(f"engine returned {len(u.logprobs)} log-probs for {len(u.token_ids)} tokens "
                             f"(request {row.req.key!r}): sampled-token log-probs are required")
        eos = bool(row.out) and row.out[-1] == self.eos_id
        done = u.finished or len(row.out) >= self._limit(row.req) or (u.interrupted and eos)
        if not (done or u.interrupted):
            return
        del self.rows[u.rid]
        self.engine.unroute(u.rid)
        if done:
            self.ready.append((row, Completion(row.req.key, list(row.req.prompt_ids), row.out, row.logprobs,
                                               row.version, eos, row.versions)))
        else:
            self.parked.append(row)

    def step(self) -> list[Completion]:
        parked, self.parked = self.parked, []
        for row in parked:
            self._submit(row)
        if self.rows:
            self.engine.pump()
        done, self.ready = [c for _, c in self.ready], []
        return done

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.unroute(rid)
        if rids:
            self.backend.abort(rids)

    def drop_all(self) -> list[Request]:
        """Abort every live submission; the requests of every answer not yet returned
        (``rollout.on_swap=discard``)."""
        return self.drop(lambda r: True)

    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        """Abort the answers whose request ``which(req)`` is true (live, parked or finished
        but not yet returned); their requests."""
        rids = [rid for rid, row in self.rows.items() if which(row.req)]
        self._abort(rids)
        out = [self.rows.pop(rid).req for rid in rids]
        out += [row.req for row in self.parked if which(row.req)]
        out += [row.req for row, _ in self.ready if which(row.req)]
        self.parked = [row for row in self.parked if not which(row.req)]
        self.ready = [(row, c) for row, c in self.ready if not which(row.req)]
        return out

    def recompute_cache(self) -> None:
        """Continue every live answer under the current weights: abort, then re-submit it with
        its generated tokens appended to the prompt (prefix recomputed by the engine)."""
        rows, self.rows = list(self.rows.items()), {}
        self._abort([rid for rid, _ in rows])
        parked, self.parked = [row for _, row in rows] + self.parked, []
        for row in parked:
            self._submit(row)


class StepEngine:
    """Engine-protocol shell around a backend: ``new_batch``, ``generate``, ``version``; routes
    each backend update to the batch that submitted it."""

    def __init__(self, backend: Backend, eos_id: int, max_batch: int):
        self.backend, self.eos_id, self.max_batch = backend, eos_id, max_batch
        self.version = 0
        self.load_path: str | None = None
        self.busy_slots = 0
        self.total_slots = 0
        self._routes: weakref.WeakValueDictionary[str, StepBatch] = weakref.WeakValueDictionary()

    def new_batch(self, sampling: SamplingParams) -> StepBatch:
        return StepBatch(self, sampling, self.version)

    def route(self, rid: str, batch: StepBatch) -> None:
        self._routes[rid] = batch

    def unroute(self, rid: str) -> None:
        self._routes.pop(rid, None)

    def _deliver(self, updates: Iterable[Update]) -> None:
        for u in updates:
            batch = self._routes.get(u.rid)
            if batch is not None:
                batch.deliver(u)

    def pump(self) -> None:
        """Poll the backend once; each update goes to its batch."""
        self._deliver(self.backend.poll())

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        """Our weight store's buffers into the engine (HF names, see :func:`named_tensors`).
        Updates settled during the load reach their batches before ``version`` changes;
        ``load_path`` keeps how the backend loaded them. Raises :class:`EngineStepError`."""
        loaded = self.backend.load(named_tensors(tensors))
        self._deliver(loaded.settled)
        self.load_path = loaded.path
        self.version = version

    def generate(self, requests: Iterable[Request], sampling: SamplingParams,
                 on_done: Callable[[Completion], None] | None = None) -> list[Completion]:
        """All ``requests`` (the engine schedules them), results in completion order."""
        batch, results = self.new_batch(sampling), []
        batch.add(requests)
        while len(batch):
            done = batch.step()
            results += done
            if on_done:
                for c in done:
                    on_done(c)
        return results

    def shutdown(self) -> None:
        """Release the backend's resources (its engine, its files), if it holds any."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


def import_engine(module: str, label: str) -> Any:
    """The optional engine library ``module``, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"rollout.engine={module} needs {label}: pip install 'asyncflow[{module}]' "
                          f"(a CUDA machine)") from e


def sampled_logprobs(token_ids: Sequence[int], per_position: Sequence[Any] | None) -> list[float]:
    """The sampled tokens' log-probs from per-position ``{token_id: logprob}`` maps, where a
    value is a float or has ``.logprob`` (vLLM's ``Logprob``). Raises naming the position if
    the sampled token is missing (the engine was not asked for log-probs)."""
    if per_position is None:
        raise ValueError("the engine returned no log-probs: request logprobs=0 (the sampled token's)")
    out = []
    for i, (tok, entry) in enumerate(zip(token_ids, per_position)):
        if entry is None or tok not in entry:
            raise ValueError(f"no log-prob for sampled token {tok} at position {i}")
        v = entry[tok]
        out.append(float(getattr(v, "logprob", v)))
    return out


def chunked(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    """Consecutive slices of at most ``n`` items (weight buckets)."""
    for i in range(0, len(items), n):
        yield items[i: i + n]
