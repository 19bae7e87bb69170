"""Figures of a label-free (TTRL) run, per step and for the whole run: the majority vote, and
the tokens ETMR's trees generate.

The group reward (:class:`~asyncflow.tasks.majority.MajorityVote`, ``reward.mode=majority``)
keeps cumulative ``vote_*`` counters in the stats of the role that scores (rollout, or the
reward role; every data-parallel rank's are summed). :class:`VoteMeter` turns two successive
readings into one step's figures, as the run meter does for dropped groups: the groups voted
*during* the step (in ``sync`` exactly the step's groups; in ``stream``/``async`` those scored
while it trained, which run ahead by at most the staleness bound):

* ``majority_ratio``: mean over those groups of (the pseudo-label's votes / the group's answers);
* ``pseudo_label_acc``: of those groups whose rows carry a reference answer, the fraction whose
  pseudo-label equals it (a group without a pseudo-label, a tie, counts as wrong); logged only,
  never a reward;
* ``reward_acc``: of their answers, the fraction whose pseudo-reward equals the reward the
  reference would have given (TTRL's "reward accuracy");
* ``vote_ties``, ``vote_unextractable``: groups with no majority, answers with no extractable answer.

The figures are absent from a step in which no group was voted (and the accuracies where no
voted group carried a reference), never a made-up zero.

ETMR (``rollout.etmr``): rollout's :class:`~asyncflow.workflow.tree_batch.TreeEngine` counts, for
the groups it finished, the tokens the trees sampled (``etmr_generated``: a shared prefix once)
and what the same answers cost sampled independently (``etmr_independent``): per step
``generated_tokens``, ``independent_tokens`` and their ratio ``generated_frac``.
"""

from __future__ import annotations

TREE_COUNTERS = ("etmr_groups", "etmr_generated", "etmr_independent", "etmr_fallbacks", "etmr_over_budget")
COUNTERS = ("vote_groups", "vote_answers", "vote_ties", "vote_no_label", "vote_unextractable",
            "vote_extractor_errors", "vote_labelled", "vote_label_hits", "vote_labelled_answers",
            "vote_reward_hits", "vote_ratio_sum")


def vote_counters(stats: dict) -> dict[str, float]:
    """The ``vote_*`` and ``etmr_*`` counters summed over every role's stats that has them (empty: none)."""
    out: dict[str, float] = {}
    for role in stats.values():
        for names, first in ((COUNTERS, "vote_groups"), (TREE_COUNTERS, "etmr_groups")):
            if isinstance(role, dict) and first in role:
                for k in names:
                    out[k] = out.get(k, 0) + role.get(k, 0)
    return out


def tree_figures(d: dict[str, float]) -> dict[str, float]:
    """ETMR's tokens of (a difference of) counters: see the module doc."""
    if not d.get("etmr_groups"):
        return {}
    return {"generated_tokens": int(d["etmr_generated"]), "independent_tokens": int(d["etmr_independent"]),
            "generated_frac": d["etmr_generated"] / max(d["etmr_independent"], 1)}


def vote_figures(d: dict[str, float]) -> dict[str, float]:
    """Ratios of (a difference of) counters: see the module doc."""
    if not d.get("vote_groups"):
        return {}
    out = {"majority_ratio": d["vote_ratio_sum"] / d["vote_groups"], "vote_groups": int(d["vote_groups"]),
           "vote_ties": int(d.get("vote_ties", 0)), "vote_unextractable": int(d.get("vote_unextractable", 0))}
    if d.get("vote_labelled"):
        out["pseudo_label_acc"] = d["vote_label_hits"] / d["vote_labelled"]
        out["reward_acc"] = d["vote_reward_hits"] / max(d["vote_labelled_answers"], 1)
    return out


class VoteMeter:
    """Per-step figures (votes, ETMR tokens) from successive readings of the workers' stats."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def step(self, stats: dict) -> dict[str, float]:
        now = vote_counters(stats)
        delta = {k: v - self.last.get(k, 0) for k, v in now.items()}
        self.last = now
        return {**vote_figures(delta), **tree_figures(delta)}


def vote_summary(stats: dict) -> dict:
    """The whole run's figures (``majority_vote``, ``etmr`` in the summary), or nothing without either."""
    c = vote_counters(stats)
    out: dict = {}
    if c.get("vote_groups"):
        out["majority_vote"] = {**vote_figures(c), "extractor_errors": int(c.get("vote_extractor_errors", 0))}
    if c.get("etmr_groups"):
        out["etmr"] = {**tree_figures(c), "groups": int(c["etmr_groups"]), "fallbacks": int(c["etmr_fallbacks"]),
                       "over_budget": int(c["etmr_over_budget"])}
    return out


def vote_line(s: dict) -> str:
    """The summary's lines on the votes and the trees ('' without)."""
    t, line = s.get("etmr"), ""
    if t:
        line = (f"ETMR trees         {t['generated_tokens']} tokens generated for answers of {t['independent_tokens']} "
                f"({t['generated_frac']:.1%}; {t['groups']} groups, {t['fallbacks']} fallbacks)\n")
    v = s.get("majority_vote")
    if not v or "majority_ratio" not in v:
        return line
    acc = f", pseudo-label accuracy {v['pseudo_label_acc']:.1%}" if "pseudo_label_acc" in v else ""
    return line + (f"majority vote      ratio {v['majority_ratio']:.1%}{acc} over {v['vote_groups']} groups "
                   f"({v['vote_ties']} ties, {v['vote_unextractable']} unextractable answers)\n")
