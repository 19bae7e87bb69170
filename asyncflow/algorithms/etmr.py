"""ETMR's fork rule: which answers fork where, as a pure planner (no engine, no torch).

ETMR (entropy-fork tree majority rollout, ETTRL arXiv 2508.11356) grows a prompt's answer group
as trees that share prefixes: a few *root* answers are sampled whole, then new answers branch off
them at their most uncertain tokens, reusing the prefix (and its KV cache) instead of sampling it
again. Every chain of the trees, root or branch, is one answer of the group: it votes (TTRL) and
is trained like an independent sample, with its own tokens, log-probs and versions.

Source of the rule: ETTRL's method section could not be read here (no internet, no stored copy
of it); ETTRL builds ETMR on TreeRL's EPTree (Hou et al. 2025, arXiv 2506.11902), whose public
code (``THUDM/TreeRL``, ``entropy_chain_local_manager.py``) is the documented reading used:

* ``roots`` (``M``) chains per prompt are sampled whole (round 0); each is the root of a tree;
* then ``rounds`` (``L``) times, once every chain of a tree has finished: the tree's ``forks``
  (``N``) eligible tokens of highest score become fork points, and ``branches`` (``T``) new
  chains start at each; a branch shares its parent's answer *before* the fork token and samples
  the fork token and everything after it afresh (the token the parent was unsure of is exactly
  the one resampled);
* a token's score is its entropy: the engine's full next-token entropy when it reports one,
  else (as TreeRL) the sampled token's surprisal ``-log p``;
* eligible: a token of a chain's own part at index ``k >= 1`` (``k = 0``: a root would share
  nothing; a branch would repeat its own fork point), not forked before.

So a tree ends with ``1 + rounds * forks * branches`` chains and a group with
``leaves = roots * (1 + rounds * forks * branches)`` answers, which must equal
``rollout.group_size``. The group size is kept whatever the answers look like: when a tree has
fewer eligible tokens than ``forks`` the branches are spread over the ones it has (round-robin
from the highest score), and with none at all a branch starts from the prompt (an independent
sample, counted in ``fallbacks``).

Token budget (``budget``, optional): the group may generate at most ``budget`` x the tokens of
the same number of independent answers, estimated as ``leaves x`` the mean length of the chains
finished so far. A branch is expected to cost its parent's length after the fork point; a fork
point whose ``branches`` would overrun what is left is skipped for the next best, and when none
fits the cheapest is taken and counted (``over_budget``): the budget steers where forks go, it
never changes the group size.

Accounting is exact: ``generated`` counts every token a chain sampled itself (a shared prefix
once); ``independent`` counts every answer's full length (prefix included), i.e. what the same
answers would have cost sampled independently.

What an engine needs to run a plan (``docs/ttrl.md``): ``fork(row, keep, n)``, ``n`` new live
rows whose cache is the first ``keep`` positions of ``row`` (its prompt and ``keep - prompt``
answer tokens, with their log-probs and versions) that each sample on independently; and a way
to keep a finished row's cache until its tree's last round (:meth:`TreePlan.retained`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TreeShape:
    """How a group grows: ``roots`` trees, ``rounds`` rounds of ``forks`` fork points with
    ``branches`` chains each; ``budget``: generated tokens at most this fraction of independent
    sampling's (None: no cap)."""

    roots: int = 2
    forks: int = 1
    branches: int = 3
    rounds: int = 1
    budget: float | None = None

    def __post_init__(self) -> None:
        if min(self.roots, self.forks, self.branches) < 1 or self.rounds < 0:
            raise ValueError(f"TreeShape needs roots, forks, branches >= 1 and rounds >= 0, got {self}")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"TreeShape.budget must be in (0, 1], got {self.budget}")

    @property
    def leaves(self) -> int:
        """Answers of a group: ``roots * (1 + rounds * forks * branches)``."""
        return self.roots * (1 + self.rounds * self.forks * self.branches)


@dataclass(frozen=True)
class Branch:
    """A chain to start: ``chain`` (its id in the group, 0..leaves-1), its tree, and where it
    branches off: ``parent`` chain and ``at`` = the number of the parent's *full* answer tokens it
    shares (None parent: from the prompt, ``at = 0``)."""

    chain: int
    tree: int
    parent: int | None = None
    at: int = 0


@dataclass
class _Chain:
    tree: int
    prefix: list[int]  # shared tokens (the parent's full answer up to the fork point)
    prefix_scores: list[float]
    expected: float = 0.0  # a branch's expected own length when it started (the budget's estimate)
    own: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    done: bool = False


class TreePlan:
    """The plan of one prompt's group: :meth:`start` gives the roots, :meth:`finish` each chain's
    tokens and per-token scores as it ends and returns the branches to start now."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self.chains: dict[int, _Chain] = {}
        self.forked: set[tuple[int, int]] = set()  # (chain, own index) fork points used
        self.round = [0] * shape.roots  # rounds of forks each tree has had
        self.fallbacks = self.over_budget = 0
        self._committed = 0.0  # expected tokens of branches started and not finished

    def start(self) -> list[Branch]:
        """The ``roots`` root chains (ids ``0..roots-1``, tree = id)."""
        for t in range(self.shape.roots):
            self.chains[t] = _Chain(t, [], [])
        return [Branch(t, t) for t in range(self.shape.roots)]

    def finish(self, chain: int, tokens: Sequence[int], scores: Sequence[float]) -> list[Branch]:
        """Chain ``chain`` ended having sampled ``tokens`` itself (after its shared prefix), with a
        score (entropy) per token; the branches that start now (its tree's next round, once every
        chain of the tree has finished)."""
        c = self.chains[chain]
        if c.done:
            raise ValueError(f"chain {chain} finished twice")
        if len(tokens) != len(scores):
            raise ValueError(f"chain {chain}: {len(tokens)} tokens but {len(scores)} scores")
        c.own, c.scores, c.done = list(tokens), [float(s) for s in scores], True
        self._committed -= c.expected  # (a branch's expected cost is no longer pending)
        tree = c.tree
        if self.round[tree] >= self.shape.rounds or not all(x.done for x in self._tree(tree)):
            return []
        self.round[tree] += 1
        return self._grow(tree)

    def _tree(self, tree: int) -> list[_Chain]:
        return [c for c in self.chains.values() if c.tree == tree]

    def _candidates(self, tree: int) -> list[tuple[float, int, int]]:
        """Eligible fork points of a tree, best first: (score, chain, own index)."""
        out = [(s, cid, k) for cid, c in self.chains.items() if c.tree == tree
               for k, s in enumerate(c.scores) if k >= 1 and (cid, k) not in self.forked]
        return sorted(out, key=lambda x: (-x[0], x[1], x[2]))

    def _grow(self, tree: int) -> list[Branch]:
        """One round of the tree: ``forks`` points (budget permitting), ``branches`` chains each."""
        s = self.shape
        points = self._pick(self._candidates(tree), s.forks)
        out: list[Branch] = []
        for j in range(s.forks * s.branches):
            cid = len(self.chains)
            if not points:  # nothing to share: an independent sample from the prompt
                self.fallbacks += 1
                self.chains[cid] = _Chain(tree, [], [], expected=self._mean_length())
                self._committed += self.chains[cid].expected
                out.append(Branch(cid, tree))
                continue
            _, parent, k = points[j // s.branches % len(points)]
            self.forked.add((parent, k))
            p = self.chains[parent]
            at = len(p.prefix) + k
            # expected own length: the parent's after the fork point (the token there is resampled)
            self.chains[cid] = _Chain(tree, (p.prefix + p.own)[:at], (p.prefix_scores + p.scores)[:at],
                                      expected=float(len(p.own) - k))
            self._committed += self.chains[cid].expected
            out.append(Branch(cid, tree, parent, at))
        return out

    def _pick(self, cands: list[tuple[float, int, int]], n: int) -> list[tuple[float, int, int]]:
        """Up to ``n`` fork points, best score first, that keep the plan within the budget."""
        if self.shape.budget is None:
            return cands[:n]
        picked: list[tuple[float, int, int]] = []
        for _ in range(min(n, len(cands))):
            rest = [x for x in cands if x not in picked]
            fits = [x for x in rest if self._projected() + sum(self._cost(y) for y in picked + [x]) <= self._cap()]
            if not fits:
                self.over_budget += 1
                fits = [min(rest, key=lambda x: (self._cost(x), -x[0]))]
            picked.append(fits[0])
        return picked

    def _cost(self, point: tuple[float, int, int]) -> float:
        """Expected tokens of ``branches`` chains forked at ``point``."""
        c = self.chains[point[1]]
        return self.shape.branches * float(len(c.own) - point[2])

    def _projected(self) -> float:
        return self.generated + self._committed

    def _mean_length(self) -> float:
        """Mean full length of the chains finished so far (the independent answer's estimate)."""
        done = [len(c.prefix) + len(c.own) for c in self.chains.values() if c.done]
        return sum(done) / len(done) if done else 0.0

    def _cap(self) -> float:
        assert self.shape.budget is not None  # (only called with a budget)
        return self.shape.budget * self.shape.leaves * self._mean_length()

    # ------------------------------------------------------------------ results
    @property
    def done(self) -> bool:
        """Every chain of the group has finished and no round is left."""
        return len(self.chains) == self.shape.leaves and all(c.done for c in self.chains.values())

    def answer(self, chain: int) -> tuple[list[int], list[float]]:
        """A chain's full answer (shared prefix + its own tokens) and per-token scores."""
        c = self.chains[chain]
        return c.prefix + c.own, c.prefix_scores + c.scores

    def retained(self) -> list[int]:
        """Finished chains whose cache a later round may fork from (their tree has rounds left)."""
        return [cid for cid, c in self.chains.items() if c.done and self.round[c.tree] < self.shape.rounds]

    @property
    def generated(self) -> int:
        """Tokens the group's chains sampled themselves: a shared prefix counted once."""
        return sum(len(c.own) for c in self.chains.values())

    @property
    def independent(self) -> int:
        """Tokens the same answers cost sampled independently: every full answer's length."""
        return sum(len(c.prefix) + len(c.own) for c in self.chains.values() if c.done)
