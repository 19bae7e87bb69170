"""The built-in engine's batch: continuous batching over preallocated slots (the host side).

Design
------
:class:`SlotBatch` runs on a :class:`~asyncflow.engines.slot_pool.SlotPool` (the device side:
cache, per-slot state, step, graphs) and keeps the host's view: which request lives in which slot, the live slots
in admission order, the tokens/log-probs/versions of each live answer in numpy arrays (one
vectorised write per step, lists only when an answer finishes) and the kept rows.

* ``add`` takes the lowest free slots (so a step's range ``0 .. B-1`` stays short), prefills
  each distinct prompt of the call once and **forks** its keys/values into the slots of the
  other requests with the same prompt (a GRPO group: one prefill, n answers), then draws every
  request's first token from its prompt's logits.
* ``step`` runs one device step (a CUDA graph replay where there are graphs), copies its
  packed output to the host once, and finishes the rows that stopped.
* ``recompute_cache`` re-prefills every live row's tokens (in its own slot, positions
  unchanged) under the current weights; ``partials``/``resume`` save and rebuild live rows.
* Multi-turn (:class:`~asyncflow.engines.types.MultiTurnBatch`): a finished ``keep`` row
  stays in its slot (*kept*, not live); ``extend`` prefills only the tokens its cache lacks
  (its last sampled token and the observation) and makes it live again. A kept row whose
  cache is stale (weights changed since) or was evicted (``add`` needed its slot; the oldest
  kept rows go first) is rebuilt from its token history.
* ``fork(key, new_keys)`` copies a live row into new live rows (its cache by
  :meth:`SlotPool.fork <asyncflow.engines.slot_pool.SlotPool.fork>`, its tokens so far), which
  then sample on their own: the primitive for tree rollouts (issue 36's ETMR forks rows at
  high-entropy tokens) and the one ``add`` uses for a group's shared prompt.

Invariants: a slot is free, live (in ``order``) or kept, never two; ``len(batch)`` counts live
rows only; every added request finishes exactly once (or is dropped) with
``len(logprobs) == len(token_versions) == len(response_ids)``; ``pos[slot]`` on the host equals
the device's (the tokens in the slot's cache).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncflow.engines.sampling import BROKEN_ROW, draw, inverse_cdf, uniforms
from asyncflow.engines.slot_graphs import bucket, columns
from asyncflow.engines.slot_pool import SlotPool
from asyncflow.engines.slot_step import BROKEN, REASONS, Pick, choose
from asyncflow.engines.types import Completion, Partial, Request, SamplingParams

RESERVE = 1024  # answer tokens a row reserves in the cache up front (beyond that the cache grows)


@dataclass
class _Live:
    req: Request
    context: list[int]  # tokens before this turn (the prompt; in a continued turn, the whole history)
    version: int  # Completion.version: the version this turn started at
    kv_version: int  # the weights its cached keys/values came from (the oldest of them)
    keep: bool


@dataclass
class _Kept:
    req: Request
    history: list[int]  # every token so far; the last one is not in the cache
    slot: int | None  # None once evicted
    kv_version: int


class SlotBatch:
    """Rows decoding in a :class:`SlotPool` (see module doc); an ``EngineBatch`` and a ``MultiTurnBatch``."""

    def __init__(self, pool: SlotPool, sampling: SamplingParams, version: int = 0,
                 on_close: Callable[[SlotPool], None] | None = None):
        self.pool, self.sampling, self.version, self.on_close = pool, sampling, version, on_close
        pool.step.sampling = sampling
        pool.state.live.zero_()
        S = pool.slots
        self.rows: dict[int, _Live] = {}
        self.order: list[int] = []  # live slots, admission order (the draw order)
        self.kept: OrderedDict[Any, _Kept] = OrderedDict()  # oldest first
        self.used = np.zeros(S, dtype=bool)
        self.n = np.zeros(S, dtype=np.int64)  # tokens of the current turn
        self.pos = np.zeros(S, dtype=np.int64)  # tokens in the cache
        # the current turn's tokens, log-probs and versions by slot and column (widened on demand)
        self.toks = np.zeros((S, 0), np.int64)
        self.lps = np.zeros((S, 0), np.float64)
        self.vers = np.zeros((S, 0), np.int64)
        self._arrays(16)

    def _arrays(self, width: int) -> None:
        w = self.toks.shape[1]
        for name in ("toks", "lps", "vers"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], width), old.dtype)
            new[:, :w] = old
            setattr(self, name, new)

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        """Give the slots back to the engine (the batch is unusable afterwards)."""
        if self.on_close is not None:
            self.on_close(self.pool)
            self.on_close = None

    # ------------------------------------------------------------------ start rows
    @torch.no_grad()
    def add(self, requests: list[Request]) -> list[Completion]:
        """Prefill ``requests`` (each distinct prompt once) and draw their first tokens; the ones
        that finished at it."""
        if not requests:
            return []
        for r in requests:
            r.version = self.version
        self.pool.ensure(max(self._room(r.prompt_ids, r) for r in requests), 1 + max(len(r.stop_ids) for r in requests))
        slots = self._take(len(requests))
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(r.prompt_ids), i) for i, r in enumerate(requests)]
        uniq = list(first.values())
        logits = self.pool.step.prefill([slots[i] for i in uniq], [0] * len(uniq),
                                        [requests[i].prompt_ids for i in uniq])
        for i in uniq:  # the rest of each group: the prompt's keys/values copied, not recomputed
            self.pool.cache.fork(slots[i], [slots[j] for j, s in enumerate(src) if s == i and j != i],
                                 len(requests[i].prompt_ids))
        row_of = {i: k for k, i in enumerate(uniq)}
        logits = logits[torch.tensor([row_of[s] for s in src], device=logits.device)]
        rows = [_Live(r, r.prompt_ids, self.version, self.version, r.keep) for r in requests]
        return self._start(slots, rows, logits)

    def _start(self, slots: list[int], rows: list[_Live], logits: torch.Tensor) -> list[Completion]:
        """Rows whose context is in their slots' caches: draw their first tokens, make them live."""
        st, width, eos = self.pool.state, self.pool.state.stops.shape[1], self.pool.eos_id
        # one host table, one copy: slot, context length, min, max, stop table (EOS, stop ids, EOS padding)
        meta = torch.tensor([[s, len(r.context), r.req.min_new_tokens, self._limit(r.req), eos, *r.req.stop_ids,
                              *[eos] * (width - 1 - len(r.req.stop_ids))] for s, r in zip(slots, rows)],
                            dtype=torch.long).to(st.tok.device)
        idx, ctx, mins, maxs, stops = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3], meta[:, 4:]
        n0 = torch.zeros_like(ctx)
        tok, logp, code = choose(logits, n0, mins, maxs, stops, self.sampling, self._pick_rows(len(rows)))
        st.put(idx, tok=tok, pos=ctx, n_gen=n0 + 1, live=code == 0, min_new=mins, max_new=maxs, stops=stops)
        packed = torch.stack([tok.double(), logp.double(), code.double()]).cpu().numpy()
        at = np.asarray(slots, dtype=np.int64)
        for s, row in zip(slots, rows):
            self.rows[s] = row
        self.n[at], self.pos[at] = 0, [len(r.context) for r in rows]
        self.order += slots
        return self._record(at, packed[0], packed[1], packed[2])

    def _pick_rows(self, k: int) -> Pick:
        gen = self.pool.generator
        if self.pool.step.uniform:
            u = uniforms(k, gen).to(self.pool.state.u.device)
            return lambda probs: inverse_cdf(probs, u)
        return lambda probs: (draw(probs, gen), None)

    def _limit(self, req: Request) -> int:
        return req.max_new_tokens or self.sampling.max_new_tokens

    def _room(self, context: list[int], req: Request) -> int:
        """Cache columns to reserve for a row: its context and answer, at most RESERVE of answer
        ahead (a step grows the cache when a longer answer needs it: rare, but it recaptures graphs)."""
        return len(context) + min(self._limit(req), RESERVE) + 1

    def _take(self, k: int) -> list[int]:
        """The ``k`` lowest free slots, evicting the oldest kept rows' caches if needed."""
        free = np.flatnonzero(~self.used)
        for kept in list(self.kept.values()):
            if len(free) >= k:
                break
            if kept.slot is not None:
                self.used[kept.slot], kept.slot = False, None
                free = np.flatnonzero(~self.used)
        if len(free) < k:
            raise RuntimeError(f"{k} rows asked, {len(free)} of {self.pool.slots} slots free: add at most "
                               f"max_batch - len(batch) requests")
        out = [int(s) for s in free[:k]]
        self.used[out] = True
        return out

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def step(self) -> list[Completion]:
        """One token for every live row; the rows that finished (admission order)."""
        if not self.order:
            return []
        pool, live = self.pool, np.asarray(self.order, dtype=np.int64)
        need, hi = int(self.pos[live].max()) + 1, int(live.max()) + 1
        pool.ensure(need, 1)
        rows: slice | torch.Tensor
        if pool.graphs is not None:  # fixed ranges: a graph per bucket
            hi, T = bucket(hi, pool.slots), columns(need, pool.cache.capacity)
            rows = slice(0, hi)
        elif hi == len(live):  # no holes: a view of the first rows
            rows, T = slice(0, hi), need
        else:  # eager with holes: the live slots only (a tail of long answers costs what it is)
            rows, T = torch.as_tensor(np.sort(live), device=pool.state.tok.device), need
        self._draws(live, hi, rows)
        if pool.graphs is not None:
            pool.graphs.run(hi, T)
        else:
            pool.step.decode(rows, T)
        packed = pool.state.out[:, :hi].cpu().numpy()
        self.pos[live] += 1
        return self._record(live, packed[0, live], packed[1, live], packed[2, live])

    def _draws(self, live: np.ndarray, hi: int, rows: slice | torch.Tensor) -> None:
        """The step's random numbers: uniforms into the state (GPU rule), or where the live rows
        sit among ``rows`` in admission order (the CPU's draw order)."""
        step = self.pool.step
        if step.uniform:
            u = self.pool.u_host
            u[:hi] = 0.5
            u[torch.from_numpy(live)] = uniforms(len(live), self.pool.generator)
            self.pool.state.u[:hi].copy_(u[:hi], non_blocking=True)
        else:
            at = live if isinstance(rows, slice) else np.searchsorted(np.sort(live), live)
            step.order = torch.as_tensor(at, device=self.pool.state.tok.device)

    def _record(self, slots: np.ndarray, tok: np.ndarray, lp: np.ndarray, code: np.ndarray) -> list[Completion]:
        """Append one token to each row of ``slots``; finish the ones whose ``code`` says so."""
        if (code == BROKEN).any():
            raise ValueError(BROKEN_ROW)
        cols = self.n[slots]
        if len(cols) and cols.max() >= self.toks.shape[1]:
            self._arrays(2 * int(cols.max()) + 2)
        self.toks[slots, cols], self.lps[slots, cols], self.vers[slots, cols] = tok, lp, self.version
        self.n[slots] += 1
        ended = code != 0
        if not ended.any():
            return []
        done = [self._finish(int(s), int(c)) for s, c in zip(slots[ended], code[ended])]
        gone = set(int(s) for s in slots[ended])
        self.order = [s for s in self.order if s not in gone]
        return done

    def _finish(self, slot: int, code: int) -> Completion:
        row, n = self.rows.pop(slot), int(self.n[slot])
        resp = self.toks[slot, :n].tolist()
        c = Completion(row.req.key, row.context, resp, self.lps[slot, :n].tolist(), row.version,
                       resp[-1] == self.pool.eos_id, self.vers[slot, :n].tolist(), REASONS[code])
        if row.keep:
            old = self.kept.pop(row.req.key, None)
            if old is not None and old.slot is not None:
                self.used[old.slot] = False
            self.kept[row.req.key] = _Kept(row.req, row.context + resp, slot, row.kv_version)
        else:
            self.used[slot] = False
        return c

    def fork(self, key: Any, new_keys: list[Any]) -> None:
        """Copy the live row ``key`` into new live rows, one per key of ``new_keys`` (the same
        request otherwise): each starts with its tokens, log-probs and versions so far and its
        cache (copied, not recomputed), and samples on its own from the next step. The caller
        counts them against ``max_batch``."""
        src = next((s for s in self.order if self.rows[s].req.key == key), None)
        if src is None:
            raise KeyError(f"fork: no live row with key {key!r}")
        dsts = self._take(len(new_keys))
        self.pool.fork(src, dsts)
        row, n = self.rows[src], int(self.n[src])
        for d, k in zip(dsts, new_keys):
            self.rows[d] = dataclasses.replace(row, req=dataclasses.replace(row.req, key=k))
            for arr in (self.toks, self.lps, self.vers):
                arr[d, :n] = arr[src, :n]
            self.n[d], self.pos[d] = n, self.pos[src]
        self.order += dsts

    # ------------------------------------------------------------------ remove rows
    def drop_all(self) -> list[Request]:
        """Remove every live row; return their requests (kept rows stay kept)."""
        return self.drop(lambda req: True)

    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        """Remove the live rows whose request ``which(req)`` is true; return their requests."""
        gone = [s for s in self.order if which(self.rows[s].req)]
        if not gone:
            return []
        self.pool.state.live[torch.tensor(gone, device=self.pool.state.live.device)] = False
        self.used[gone] = False
        self.order = [s for s in self.order if s not in set(gone)]
        return [self.rows.pop(s).req for s in gone]

    # ------------------------------------------------------------------ weights and restarts
    @torch.no_grad()
    def recompute_cache(self) -> None:
        """Rebuild the live rows' caches under the current weights; kept rows' caches go stale."""
        for kept in self.kept.values():
            kept.kv_version = -1
        if not self.order:
            return
        seqs = [self.rows[s].context + self.toks[s, :self.n[s] - 1].tolist() for s in self.order]
        self.pool.step.prefill(list(self.order), [0] * len(seqs), seqs)
        for s in self.order:
            self.rows[s].kv_version = self.version

    def partials(self) -> list[Partial]:
        """The live rows as they stand (copies; they stay live). A continued turn's request
        carries its whole history as ``prompt_ids``."""
        out = []
        for s in self.order:
            row, n = self.rows[s], int(self.n[s])
            req = row.req if row.context is row.req.prompt_ids else dataclasses.replace(row.req, prompt_ids=row.context)
            out.append(Partial(req, self.toks[s, :n].tolist(), self.lps[s, :n].tolist(), self.vers[s, :n].tolist(),
                               row.version))
        return out

    @torch.no_grad()
    def resume(self, parts: list[Partial]) -> list[Completion]:
        """Continue answers saved by :meth:`partials`: caches rebuilt from prompt + tokens under
        the current weights, the last token the next input; their tokens, log-probs, versions and
        start version kept. Nothing finishes here."""
        parts = [p for p in parts if p.response_ids]  # (a live row has sampled at least one token)
        if not parts:
            return []
        self.pool.ensure(max(self._room(p.req.prompt_ids + p.response_ids, p.req) for p in parts),
                         1 + max(len(p.req.stop_ids) for p in parts))
        slots = self._take(len(parts))
        self.pool.step.prefill(slots, [0] * len(parts), [p.req.prompt_ids + p.response_ids[:-1] for p in parts])
        width = max(len(p.response_ids) for p in parts)
        if width >= self.toks.shape[1]:
            self._arrays(2 * width)
        for s, p in zip(slots, parts):
            n = len(p.response_ids)
            self.rows[s] = _Live(p.req, p.req.prompt_ids, p.version, self.version, p.req.keep)
            self.toks[s, :n], self.lps[s, :n], self.vers[s, :n] = p.response_ids, p.logprobs, p.token_versions
            self.n[s], self.pos[s] = n, len(p.req.prompt_ids) + n - 1
            self._put_live(s, p.req, p.response_ids[-1], n)
        self.order += slots
        return []

    def _put_live(self, slot: int, req: Request, tok: int, n_gen: int) -> None:
        st = self.pool.state
        stops = [self.pool.eos_id, *req.stop_ids]
        st.stops[slot] = self.pool.eos_id
        st.stops[slot, :len(stops)] = torch.tensor(stops, dtype=torch.long)
        st.tok[slot], st.pos[slot], st.n_gen[slot] = tok, int(self.pos[slot]), n_gen
        st.min_new[slot], st.max_new[slot], st.live[slot] = req.min_new_tokens, self._limit(req), True

    # ------------------------------------------------------------------ multi-turn
    @torch.no_grad()
    def extend(self, key: Any, append_ids: list[int], max_new_tokens: int, min_new_tokens: int = 0) -> list[Completion]:
        """Continue the kept row ``key`` after ``append_ids`` (see
        :class:`~asyncflow.engines.types.MultiTurnBatch`); the turn if it finished at once."""
        if key not in self.kept:
            raise KeyError(f"extend: no kept row with key {key!r} (not added with keep=True, released, "
                           f"or still generating)")
        kept = self.kept.pop(key)
        context = kept.history + list(append_ids)
        req = dataclasses.replace(kept.req, prompt_ids=context, max_new_tokens=max_new_tokens,
                                  min_new_tokens=min_new_tokens, version=self.version)
        self.pool.ensure(self._room(context, req), 1 + len(req.stop_ids))
        fresh = kept.slot is not None and kept.kv_version == self.version
        slot = kept.slot if kept.slot is not None else self._take(1)[0]
        if fresh:  # only what the cache lacks: the last sampled token and the observation
            logits = self.pool.step.prefill([slot], [len(kept.history) - 1], [[kept.history[-1], *append_ids]])
        else:  # evicted or stale: the whole history under the current weights
            logits = self.pool.step.prefill([slot], [0], [context])
        row = _Live(req, context, self.version, kept.kv_version if fresh else self.version, True)
        return self._start([slot], [row], logits)

    def release(self, key: Any) -> None:
        """Forget the kept row ``key`` (a live one is not kept when it finishes)."""
        if key in self.kept:
            kept = self.kept.pop(key)
            if kept.slot is not None:
                self.used[kept.slot] = False
            return
        for row in self.rows.values():
            if row.req.key == key:
                row.keep = False
                return
        raise KeyError(f"release: no kept or live row with key {key!r}")
