"""Advantage estimators: rewards of finished answers -> per-token advantages.

Inputs are what the data plane holds for a micro-batch: one scalar ``reward`` per answer,
its ``group`` id (the N answers of one prompt share it) and its response length. A KL
penalty folded into the reward (``kl_in_reward``) arrives as one row of per-token
penalties per answer. Every estimator returns one float32 array per answer, of that
answer's length (sequence-level estimators broadcast their value to every token), so the
loss sees one shape whatever the estimator.

Sequence-level (group) estimators see the answer's score ``s_i = r_i - sum_t pen_{i,t}``:

* ``grpo``: ``(s_i - mean_g s) / (std_g s + eps)`` (population std over the group);
* ``dr_grpo``: ``s_i - mean_g s`` (Dr.GRPO: no std, which biases toward easy/hard prompts);
* ``rloo``: ``s_i - mean_{j != i} s_j = N / (N - 1) * (s_i - mean_g s)``; a group of one
  answer has no baseline and gets 0.

Any of the three may be reshaped by EAR (ETTRL's entropy-based advantage reshaping,
:mod:`asyncflow.algorithms.ear`): each answer's value moves by its entropy relative to its
group's, within ``|A| / kappa``.

Token-level estimators build per-token rewards (``r_i`` on the last token, ``-pen_{i,t}`` on
every token), take the undiscounted return-to-go ``G_{i,t} = sum_{t' >= t} rew_{i,t'}``
and then whiten over **every valid token of the step** (``mean``/``std`` token-weighted):

* ``reinforce_pp`` (REINFORCE++): whiten ``G``;
* ``reinforce_pp_baseline``: subtract the group mean of ``r`` first, then as above.

Whitening needs the whole step's rewards, so these two are *batch-level*
(:data:`BATCH_LEVEL`): the actor collects the whole step before its first backward pass.
Group estimators need only whole groups and keep streaming.

``gae`` is the PPO estimator (:data:`CRITIC_LEVEL`): :func:`ppo_targets` builds the same
per-token rewards, then GAE on a critic's per-token values gives advantages and the
critic's regression targets (returns). It runs in the critic role, which has the values;
the actor reads the advantages it writes (see :mod:`asyncflow.workflow.roles.critic`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncflow.algorithms.ear import EAR, answer_entropy

# One value per answer: a list, or a 1-D array.
Floats = Sequence[float] | np.ndarray

GROUP_LEVEL = ("grpo", "dr_grpo", "rloo")
BATCH_LEVEL = ("reinforce_pp", "reinforce_pp_baseline")
CRITIC_LEVEL = ("gae",)
ESTIMATORS = GROUP_LEVEL + BATCH_LEVEL + CRITIC_LEVEL


def _f64(x: object) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def group_mean_baseline(scores: Floats, groups: np.ndarray) -> np.ndarray:
    """``s_i - mean`` of ``s`` over ``i``'s group."""
    scores, out = _f64(scores), np.zeros(len(scores))
    for g in np.unique(groups):
        idx = groups == g
        out[idx] = scores[idx] - scores[idx].mean()
    return out


def grpo_advantages(scores: Floats, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: group mean/std normalised, one value per answer."""
    scores, out = _f64(scores), np.zeros(len(scores))
    for g in np.unique(groups):
        idx = groups == g
        s = scores[idx]
        out[idx] = (s - s.mean()) / (s.std() + eps)
    return out.astype(np.float32)


def dr_grpo_advantages(scores: Floats, groups: np.ndarray) -> np.ndarray:
    """Dr.GRPO: group mean subtracted, no std division."""
    return group_mean_baseline(scores, groups).astype(np.float32)


def rloo_advantages(scores: Floats, groups: np.ndarray) -> np.ndarray:
    """RLOO: leave-one-out baseline, ``s_i - mean_{j != i} s_j``."""
    scores, out = _f64(scores), np.zeros(len(scores))
    for g in np.unique(groups):
        idx = groups == g
        n = int(idx.sum())
        if n > 1:
            s = scores[idx]
            out[idx] = n / (n - 1) * (s - s.mean())
    return out.astype(np.float32)


def token_rewards(rewards: Floats, lengths: Sequence[int],
                  penalties: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Per-token rewards: the outcome ``r_i`` on the last token, minus each token's penalty."""
    rows = []
    for i, n in enumerate(lengths):
        row = np.zeros(n) if penalties is None else -_f64(penalties[i])[:n]
        if n:
            row[n - 1] += float(rewards[i])
        rows.append(row)
    return rows


def returns_to_go(rows: Sequence[np.ndarray], gamma: float = 1.0) -> list[np.ndarray]:
    """``G_t = rew_t + gamma * G_{t+1}`` along each row (``G`` past the end is 0)."""
    out = []
    for row in rows:
        g, acc = np.zeros(len(row)), 0.0
        for t in range(len(row) - 1, -1, -1):
            acc = row[t] + gamma * acc
            g[t] = acc
        out.append(g)
    return out


def whiten_tokens(rows: Sequence[np.ndarray], eps: float = 1e-6) -> list[np.ndarray]:
    """``(x - mean) / (std + eps)`` with mean and (population) std over every token of every row."""
    flat = np.concatenate([_f64(r) for r in rows]) if rows else np.zeros(0)
    if flat.size == 0:
        return [np.zeros(0, np.float32) for _ in rows]
    mu, sd = flat.mean(), flat.std()
    return [((_f64(r) - mu) / (sd + eps)).astype(np.float32) for r in rows]


def reinforce_pp_advantages(rewards: Floats, lengths: Sequence[int],
                            penalties: Sequence[np.ndarray] | None = None, gamma: float = 1.0,
                            eps: float = 1e-6) -> list[np.ndarray]:
    """REINFORCE++: batch-whitened returns-to-go of the per-token rewards."""
    return whiten_tokens(returns_to_go(token_rewards(rewards, lengths, penalties), gamma), eps)


def reinforce_pp_baseline_advantages(rewards: Floats, groups: Sequence[int] | np.ndarray,
                                     lengths: Sequence[int], penalties: Sequence[np.ndarray] | None = None,
                                     gamma: float = 1.0, eps: float = 1e-6) -> list[np.ndarray]:
    """REINFORCE++-baseline: group-mean-centred outcome reward, then as REINFORCE++."""
    centred = group_mean_baseline(rewards, np.asarray(groups))
    return reinforce_pp_advantages(centred, lengths, penalties, gamma, eps)


def gae(rewards: Sequence[np.ndarray], values: Sequence[np.ndarray], gamma: float = 1.0,
        lam: float = 1.0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Generalised advantage estimation on ragged rows of per-token rewards and values.

    ``delta_t = rew_t + gamma * V_{t+1} - V_t`` (``V`` past the last token is 0: the answer
    ended), ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``(advantages, returns)``
    with ``returns = A + V`` (the critic's regression target).
    """
    advs, rets = [], []
    for rew, val in zip(rewards, values):
        rew, val = _f64(rew), _f64(val)
        a, acc = np.zeros(len(rew)), 0.0
        for t in range(len(rew) - 1, -1, -1):
            nxt = val[t + 1] if t + 1 < len(rew) else 0.0
            acc = rew[t] + gamma * nxt - val[t] + gamma * lam * acc
            a[t] = acc
        advs.append(a.astype(np.float32))
        rets.append((a + val).astype(np.float32))
    return advs, rets


def ppo_targets(rewards: Floats, values: Sequence[np.ndarray], penalties: Sequence[np.ndarray] | None = None,
                gamma: float = 1.0, lam: float = 1.0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """PPO: per-token rewards (outcome on the last token, minus each token's KL penalty), then
    :func:`gae` on the critic's ``values`` (one row per answer, its response length)."""
    rows = token_rewards(rewards, [len(v) for v in values], penalties)
    return gae(rows, values, gamma, lam)


def compute_advantages(name: str, rewards: Floats, groups: Sequence[int] | np.ndarray, lengths: Sequence[int],
                       penalties: Sequence[np.ndarray] | None = None, eps: float = 1e-6,
                       ear: EAR | None = None, logprobs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Per-token advantage rows of estimator ``name`` (one of :data:`ESTIMATORS`). ``ear`` (group
    estimators only): reshape each answer's advantage by its entropy, estimated from its
    ``logprobs`` (:mod:`asyncflow.algorithms.ear`)."""
    groups = np.asarray(groups)
    if ear is not None and name not in GROUP_LEVEL:
        raise ValueError(f"EAR reshapes the advantages of a group estimator ({', '.join(GROUP_LEVEL)}), not {name!r}")
    if name in GROUP_LEVEL:
        scores = _f64(rewards).copy()
        if penalties is not None:
            scores -= np.array([_f64(p)[:n].sum() for p, n in zip(penalties, lengths)])
        if name == "grpo":
            seq = grpo_advantages(scores, groups, eps)
        elif name == "dr_grpo":
            seq = dr_grpo_advantages(scores, groups)
        else:
            seq = rloo_advantages(scores, groups)
        if ear is not None:
            if logprobs is None:
                raise ValueError("EAR needs the answers' logprobs (their entropy)")
            seq = ear.reshape(seq, answer_entropy(logprobs), groups)
        return [np.full(n, a, dtype=np.float32) for a, n in zip(seq, lengths)]
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, lengths, penalties, eps=eps)
    if name == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, groups, lengths, penalties, eps=eps)
    if name in CRITIC_LEVEL:
        raise ValueError(f"estimator {name!r} needs a critic's values: use ppo_targets")
    raise ValueError(f"unknown advantage estimator {name!r} (known: {', '.join(ESTIMATORS)})")
