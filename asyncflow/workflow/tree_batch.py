"""ETMR on any engine that can continue answers: each prompt group decodes as entropy-fork trees.

:class:`TreeEngine` wraps an engine (``rollout.etmr``); its batches (:class:`TreeBatch`) keep the
:class:`~asyncflow.engines.types.EngineBatch` contract towards rollout, which is unchanged: rollout
adds a prompt's ``group_size`` requests and gets ``group_size`` completions back, one per request.
Inside, the group is a :class:`~asyncflow.algorithms.etmr.TreePlan`: only the roots start; when a
chain finishes, the plan names the branches to start (at its tree's most uncertain tokens, scored
by the sampled tokens' ``-log p``), and each branch is started from its parent's answer up to the
fork point with that prefix's recorded log-probs and versions (:class:`~asyncflow.engines.types.Partial`
through ``batch.resume``: the cache of prompt + prefix is rebuilt by one prefill, and the fork token
is sampled afresh); the other branches of the same fork point copy that row's cache with the
engine's slot fork (``batch.fork``, the built-in engine) rather than prefilling it again. Every
chain comes back as the completion of one of the group's requests, its full answer (prefix + its
own tokens) with per-token log-probs and versions, as an independent answer would.

Why a prefill and not a copy of the parent's cache: EPTree forks a chain once it has *finished*,
at a past position, and the engine frees a finished row's slot (its ``fork`` copies a *live*
row as it stands). So one prefill of prompt + prefix per fork point, then slot copies for its
siblings; a ``fork(row, keep)`` of a kept finished row's first ``keep`` positions would save that
prefill too (``docs/ttrl.md``). The *generated* tokens (sampled by decoding) are what ETMR saves,
and they are exact here.

Invariants (``tests/test_tree_batch.py``): every request added comes back exactly once, unless
dropped; ``len(batch)`` counts live chains plus the group's chains not started yet (they are
requests rollout is owed); ``drop_all``/``drop`` return a group's requests not yet returned and
forget its tree; a group's prefix log-probs are the parent's, so each answer's recorded log-probs
equal a full forward of it under the weights that sampled it. Counters (``stats()``, cumulative,
groups finished): ``etmr_generated`` tokens sampled, ``etmr_independent`` what the same answers cost
sampled independently, ``etmr_groups``, ``etmr_fallbacks``, ``etmr_over_budget``.

Resume: a checkpoint keeps a running group only if all its answers are started (rollout's rule), so
a tree group mid-way restarts from its prompt; one whose chains are all started continues as plain
rows (nothing more to fork).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncflow.algorithms.etmr import Branch, TreePlan, TreeShape
from asyncflow.engines.types import Completion, Partial, Request, SamplingParams


@dataclass(frozen=True)
class ChainKey:
    """The inner engine's key of a chain: its group's number and the chain id."""

    group: int
    chain: int


@dataclass
class _Group:
    plan: TreePlan
    reqs: list[Request]  # rollout's requests; chain i answers reqs[i]
    done: dict[int, Completion] = field(default_factory=dict)  # finished chains (inner completions)
    started: int = 0


def group_id(req: Request) -> Any:
    """Rollout's group of a request: ``key[0]`` of a ``(group, answer)`` key, else the key."""
    return req.key[0] if isinstance(req.key, tuple) else req.key


class TreeBatch:
    """An engine batch that grows each whole group of ``shape.leaves`` requests as ETMR trees."""

    def __init__(self, inner: Any, shape: TreeShape, totals: dict[str, int]):
        self.inner, self.shape, self.totals = inner, shape, totals
        self.groups: dict[int, _Group] = {}
        self._next = 0

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, v: int) -> None:
        self.inner.version = v

    def __len__(self) -> int:
        return len(self.inner) + sum(len(g.reqs) - g.started for g in self.groups.values())

    # ------------------------------------------------------------------ add, step
    def add(self, requests: list[Request]) -> list[Completion]:
        """Whole runs of ``leaves`` requests of one group become trees; anything else decodes plainly."""
        n, plain, roots = self.shape.leaves, [], []
        i = 0
        while i < len(requests):
            run = requests[i:i + n]
            if len(run) == n and all(group_id(r) == group_id(run[0]) for r in run):
                roots += self._open(run)
                i += n
            else:
                plain.append(requests[i])
                i += 1
        for r in requests:
            r.version = self.inner.version
        done = self.inner.add(plain + roots) if plain or roots else []
        return self._collect(done)

    def _open(self, reqs: list[Request]) -> list[Request]:
        g, self._next = self._next, self._next + 1
        group = self.groups[g] = _Group(TreePlan(self.shape), list(reqs))
        roots = group.plan.start()
        group.started = len(roots)
        return [self._request(g, b.chain) for b in roots]

    def _request(self, g: int, chain: int) -> Request:
        return dataclasses.replace(self.groups[g].reqs[chain], key=ChainKey(g, chain))

    def step(self) -> list[Completion]:
        return self._collect(self.inner.step())

    def _collect(self, done: list[Completion]) -> list[Completion]:
        """Rollout's completions for the finished chains; start the branches they make due."""
        out: list[Completion] = []
        todo = list(done)
        while todo:
            c = todo.pop(0)
            if not isinstance(c.key, ChainKey):
                out.append(c)  # (a plain row: rollout's own key)
                continue
            group = self.groups[c.key.group]
            group.done[c.key.chain] = c
            own = self._own(group, c)
            branches = group.plan.finish(c.key.chain, c.response_ids[-own:] if own else [],
                                         [-x for x in c.logprobs[-own:]] if own else [])
            out.append(dataclasses.replace(c, key=group.reqs[c.key.chain].key))
            todo += self._start(c.key.group, branches)
            if group.plan.done:
                self._close(c.key.group)
        return out

    def _own(self, group: _Group, c: Completion) -> int:
        """Tokens the chain sampled itself (after its shared prefix)."""
        return len(c.response_ids) - len(group.plan.chains[c.key.chain].prefix)

    def _start(self, g: int, branches: list[Branch]) -> list[Completion]:
        """Start a round's chains: from the prompt, or branches; the branches of one fork point
        share one rebuilt cache when the engine can fork a live row (``batch.fork``: the built-in
        engine copies the row's slot), else each is rebuilt."""
        self.groups[g].started += len(branches)
        fresh = [self._request(g, b.chain) for b in branches if b.parent is None]
        done = self.inner.add(fresh) if fresh else []
        points: dict[tuple, list[Branch]] = {}
        for b in branches:
            if b.parent is not None:
                points.setdefault((b.parent, b.at), []).append(b)
        fork: Callable[..., Any] | None = getattr(self.inner, "fork", None)
        lead = [bs[0] for bs in points.values()] if fork is not None else [b for bs in points.values() for b in bs]
        if lead:
            done += self.inner.resume([self._start_branch(g, b) for b in lead])
        if fork is not None:
            for bs in points.values():
                if len(bs) > 1:  # (live since the resume: its siblings copy its cache and tokens so far)
                    fork(ChainKey(g, bs[0].chain), [ChainKey(g, b.chain) for b in bs[1:]])
        return done

    def _start_branch(self, g: int, b: Branch) -> Partial:
        """A branch as a saved answer to continue: the parent's first ``at`` tokens, with their
        log-probs and versions; its next token (the fork token) is sampled afresh."""
        assert b.parent is not None  # (fresh chains start from the prompt)
        p = self.groups[g].done[b.parent]
        return Partial(self._request(g, b.chain), list(p.response_ids[:b.at]), list(p.logprobs[:b.at]),
                       list(p.token_versions[:b.at]), p.version)

    def _close(self, g: int) -> None:
        plan = self.groups.pop(g).plan
        t = self.totals
        t["etmr_groups"] += 1
        t["etmr_generated"] += plan.generated
        t["etmr_independent"] += plan.independent
        t["etmr_fallbacks"] += plan.fallbacks
        t["etmr_over_budget"] += plan.over_budget

    # ------------------------------------------------------------------ drop, weights, resume
    def drop(self, which: Callable[[Request], bool]) -> list[Request]:
        """Remove the live requests ``which`` selects: a tree group goes whole (its requests not
        yet returned), plain rows one by one."""
        gone = [g for g, grp in self.groups.items() if any(which(r) for r in grp.reqs)]
        out = self._forget(gone)
        return out + self.inner.drop(lambda r: not isinstance(r.key, ChainKey) and which(r))

    def drop_all(self) -> list[Request]:
        out = self._forget(list(self.groups))
        return out + [r for r in self.inner.drop_all() if not isinstance(r.key, ChainKey)]

    def _forget(self, groups: list[int]) -> list[Request]:
        if not groups:
            return []
        mine = set(groups)
        self.inner.drop(lambda r: isinstance(r.key, ChainKey) and r.key.group in mine)
        out = []
        for g in groups:
            grp = self.groups.pop(g)
            out += [r for i, r in enumerate(grp.reqs) if i not in grp.done]
        return out

    def recompute_cache(self) -> None:
        self.inner.recompute_cache()

    def partials(self) -> list[Partial]:
        """The live chains as rollout's requests (a group mid-tree is incomplete: it restarts)."""
        out = []
        for p in self.inner.partials():
            if isinstance(p.req.key, ChainKey):
                p = Partial(self.groups[p.req.key.group].reqs[p.req.key.chain], p.response_ids, p.logprobs,
                            p.token_versions, p.version)
            out.append(p)
        return out

    def resume(self, parts: list[Partial]) -> list[Completion]:
        """Saved answers continue as plain rows (their trees are not saved)."""
        return self._collect(self.inner.resume(parts))


class TreeEngine:
    """An engine whose batches are :class:`TreeBatch` es (``rollout.etmr``); everything else is the
    wrapped engine's. ``stats()``: the trees' cumulative counters (module doc)."""

    def __init__(self, engine: Any, shape: TreeShape, group_size: int):
        if shape.leaves != group_size:
            raise ValueError(f"ETMR trees of {shape.leaves} answers for groups of {group_size}")
        if not hasattr(engine.new_batch(SamplingParams()), "resume"):
            raise ValueError("ETMR needs an engine that continues answers (batch.resume): the built-in one")
        self.engine, self.shape = engine, shape
        self.totals = dict.fromkeys(("etmr_groups", "etmr_generated", "etmr_independent", "etmr_fallbacks",
                                     "etmr_over_budget"), 0)

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, v: int) -> None:
        self.engine.version = v

    @property
    def max_batch(self) -> int:
        return self.engine.max_batch

    def new_batch(self, sampling: SamplingParams) -> TreeBatch:
        return TreeBatch(self.engine.new_batch(sampling), self.shape, self.totals)

    def load_weights(self, version: int, tensors: Any) -> None:
        self.engine.load_weights(version, tensors)

    def __getattr__(self, name: str) -> Any:  # generate, shutdown...: the wrapped engine's
        if name == "engine":  # (not set yet: unpickling)
            raise AttributeError(name)
        return getattr(self.engine, name)

    def stats(self) -> dict[str, int]:
        return dict(self.totals)
