"""Majority-vote rewards (TTRL): an answer group votes, and an answer is rewarded for agreeing.

Test-time RL (Zuo et al. 2025, arXiv 2504.16084; ETTRL, arXiv 2508.11356) trains without
labels: each prompt's group of answers is reduced to extracted final answers, the most
common one becomes the group's *pseudo-label*, and answer ``i`` scores 1.0 when its own
extracted answer equals it, else 0.0. ``reward.mode: majority`` selects it; it replaces the
task's reward (and ``reward.fn``) for training only: held-out evaluation keeps the task's
own, labelled metric.

Rules (what :func:`majority_vote` decides; hand-checked in ``tests/test_ttrl.py``):

* **extraction**: ``extract(response) -> str | None`` (default :func:`stripped`, the
  whitespace-stripped response, empty = None; or a user function by import path,
  ``reward.extractor``, e.g. ``asyncflow.tasks.rewards:extract_gsm8k`` for the number after
  ``####``). None (or an exception, counted in ``vote_extractor_errors``) is an
  *unextractable* answer: it does not vote and scores 0 (counted in ``vote_unextractable``);
* **votes** are the extracted strings compared exactly (an extractor normalises if it wants
  ``46.0`` to vote with ``46``);
* **ties**: when two or more answers share the top count there is no majority, so no
  pseudo-label: every answer of the group scores 0 (counted in ``vote_ties``). Breaking the tie
  by the answers' order would make the label depend on which answer finished first;
* **majority ratio** of a group = the pseudo-label's votes / the group's answers (the
  unextractable ones count in the denominator; 0 without a pseudo-label); an empty group has
  none and ratio 0.

The reference answer, when a row carries one, is **never used for the reward**: the rewards
are computed from the responses alone (a test scrambles the references and gets the same
rewards). It is compared afterwards, for the logs only: ``vote_label_hits`` counts groups
whose pseudo-label equals the reference (numerically when both parse, after unwrapping a
GSM8K ``####`` reference), ``vote_reward_hits`` answers whose pseudo-reward equals the reward
the reference would have given (TTRL's "reward accuracy").

Shape: :class:`MajorityVote` is a *group* reward. It is ``batched`` (the roles call
``call_batch(texts)`` with ``(prompt, response, answer)`` triples) and ``grouped``: every call
must be exactly one prompt's whole group. Rollout's :class:`~asyncflow.workflow.roles.reward.GroupScorer`
already calls a batched function once per group, at its last answer; the separate reward role
fetches whole groups through the data plane's ``GroupSampler`` when its function is
``grouped``. It never raises and always returns one finite score per answer.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncflow.tasks.plugins import load_callable
from asyncflow.tasks.rewards import answers_equal, extract_gsm8k

Extractor = Callable[[str], "str | None"]


def stripped(response: str) -> str | None:
    """The default extractor: the whitespace-stripped response (an empty one is unextractable)."""
    s = response.strip()
    return s or None


@dataclass(frozen=True)
class Vote:
    """One group's vote: the pseudo-label (None: a tie, or nothing extractable), its ratio,
    the reward of each answer in order, and what was counted on the way."""

    label: str | None
    ratio: float
    rewards: list[float]
    tie: bool = False
    unextractable: int = 0


def majority_vote(extracted: Sequence[str | None]) -> Vote:
    """The vote of a group of already extracted answers (None = unextractable); see the module doc.

    >>> majority_vote(["46", "46", "45", None]).rewards
    [1.0, 1.0, 0.0, 0.0]
    >>> majority_vote(["1", "2"]).label is None  # a tie: no pseudo-label
    True
    """
    votes = Counter(a for a in extracted if a is not None)
    missing = sum(a is None for a in extracted)
    top = votes.most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return Vote(None, 0.0, [0.0] * len(extracted), tie=len(top) == 2, unextractable=missing)
    label, count = top[0]
    return Vote(label, count / len(extracted), [1.0 if a == label else 0.0 for a in extracted],
                unextractable=missing)


def load_extractor(path: str | None) -> Extractor:
    """``reward.extractor`` by import path, or :func:`stripped` when None."""
    return stripped if path is None else load_callable(path, what="reward.extractor")


class MajorityVote:
    """The TTRL reward of one answer group (``reward.mode: majority``; see the module doc).

    ``call_batch(texts)``: ``(prompt, response, answer)`` triples of *one* group -> one reward
    each. ``stats()``: cumulative counters (``vote_*``) that the run meter turns into per-step
    ``majority_ratio`` and ``pseudo_label_acc``. Thread-safe (a lock around the counters).
    """

    batched = True  # called with a list of answers ...
    grouped = True  # ... that is always exactly one prompt's whole group

    def __init__(self, extractor: Extractor = stripped) -> None:
        self.extract = extractor
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("groups", "answers", "ties", "no_label", "unextractable", "extractor_errors", "labelled",
             "label_hits", "labelled_answers", "reward_hits"), 0)
        self.ratio_sum = 0.0
        self.failures: list[str] = []

    def _extract(self, response: str) -> tuple[str | None, bool]:
        """(the extracted answer or None, whether the extractor raised)."""
        try:
            got = self.extract(response)
        except Exception as e:  # a user's extractor: counted, the answer does not vote
            if len(self.failures) < 5:
                self.failures.append(f"reward.extractor raised {type(e).__name__}: {e}"[:300])
            return None, True
        return (str(got).strip() or None) if got is not None else None, False

    def call_batch(self, texts: Sequence[tuple[str, str, str]]) -> list[float]:
        """One group's ``(prompt, response, answer)`` triples -> one reward each, in order."""
        got = [self._extract(t[1]) for t in texts]
        vote = majority_vote([g[0] for g in got])
        self._count(vote, [g[0] for g in got], sum(g[1] for g in got), [t[2] for t in texts])
        return vote.rewards

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        """A group of one (an answer agrees with itself when extractable); the roles never call it."""
        return self.call_batch([(prompt, response, answer)])[0]

    def _count(self, vote: Vote, extracted: list[str | None], errors: int, refs: list[str]) -> None:
        """Counters of one group; the reference (logged only) is read here and nowhere else."""
        ref = refs[0].strip() if refs else ""
        want = (extract_gsm8k(ref) or ref) if ref else None
        with self._lock:
            c = self.counts
            c["groups"] += 1
            c["answers"] += len(extracted)
            c["ties"] += vote.tie
            c["no_label"] += vote.label is None
            c["unextractable"] += vote.unextractable
            c["extractor_errors"] += errors
            self.ratio_sum += vote.ratio
            if want is not None and extracted:
                c["labelled"] += 1
                c["label_hits"] += answers_equal(vote.label, want)
                c["labelled_answers"] += len(extracted)
                c["reward_hits"] += sum(r == float(answers_equal(a, want)) for a, r in zip(extracted, vote.rewards))

    def stats(self) -> dict:
        """Cumulative ``vote_*`` counters (and ``vote_ratio_sum``), plus the extractor's first failures."""
        with self._lock:
            out: dict = {f"vote_{k}": v for k, v in self.counts.items()}
            out["vote_ratio_sum"] = self.ratio_sum
            if self.failures:
                out["failures"] = list(self.failures)
        return out

    def close(self) -> None:
        """Nothing to release (the roles close every reward function)."""
