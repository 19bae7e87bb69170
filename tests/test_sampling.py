"""``asyncflow.engines.sampling.draw``: inverse-CDF sampling for large vocabularies is exact in
distribution, never draws a zero entry, is reproducible from a generator's seed, refuses broken
rows, and leaves small vocabularies on ``torch.multinomial``'s stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncflow.engines.inference import SamplingParams, sample_tokens
from asyncflow.engines.sampling import INVERSE_CDF_MIN_VOCAB, draw

V = INVERSE_CDF_MIN_VOCAB + 904  # 5000: the inverse-CDF path


def _row(mass: dict[int, float]) -> torch.Tensor:
    p = torch.zeros(V)
    for i, m in mass.items():
        p[i] = m
    return p


def test_frequencies_match_the_probabilities_and_zeros_are_never_drawn():
    """80,000 draws (20 batches of 4,000 rows, one generator) of a row with mass on 5 entries (the
    rest 0, as top-p leaves it), among them the first and the last (the edges of the CDF): each
    frequency within 4.5 standard errors of its probability (the binomial bound)."""
    mass = {0: 0.5, 7: 0.25, 2500: 0.125, 4998: 0.0625, V - 1: 0.0625}
    g, probs = torch.Generator().manual_seed(0), _row(mass).repeat(4000, 1)
    got = torch.cat([draw(probs, g) for _ in range(20)])
    n = len(got)
    counts = np.bincount(got.numpy(), minlength=V)
    assert counts.sum() == n and set(np.flatnonzero(counts)) == set(mass)
    for i, p in mass.items():
        se = (p * (1 - p) / n) ** 0.5
        assert abs(counts[i] / n - p) < 4.5 * se, (i, counts[i] / n, p)


def test_unnormalized_rows_and_tiny_masses_are_drawn_in_proportion():
    """Rows that do not sum to 1 are drawn in proportion to their entries; an entry of 1e-9 next to
    one of 1 is (almost) never drawn, and one that is all the row's mass always is."""
    probs = torch.stack([_row({3: 2.0, 9: 2.0}), _row({5: 1.0, 6: 1e-9}), _row({V - 1: 1e-30})])
    got = torch.stack([draw(probs, torch.Generator().manual_seed(s)) for s in range(4000)])
    assert set(got[:, 0].tolist()) == {3, 9} and 0.45 < (got[:, 0] == 3).float().mean().item() < 0.55
    assert set(got[:, 1].tolist()) == {5}
    assert set(got[:, 2].tolist()) == {V - 1}


def test_the_same_seed_gives_the_same_draws():
    probs = torch.softmax(torch.randn(64, V, generator=torch.Generator().manual_seed(1)), -1)
    a = draw(probs, torch.Generator().manual_seed(7))
    b = draw(probs, torch.Generator().manual_seed(7))
    c = draw(probs, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_broken_row_is_an_error_not_a_token(bad):
    probs = _row({1: 0.5, 2: 0.5}).repeat(2, 1)
    probs[1, 2] = bad
    with pytest.raises(ValueError, match="not finite or sum to 0"):
        draw(probs)
    with pytest.raises(ValueError, match="not finite or sum to 0"):
        draw(torch.zeros(1, V))


def test_a_small_vocabulary_keeps_multinomials_stream():
    probs = torch.softmax(torch.randn(32, 308, generator=torch.Generator().manual_seed(2)), -1)
    ours = draw(probs, torch.Generator().manual_seed(3))
    theirs = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3))[:, 0]
    assert torch.equal(ours, theirs)


def test_top_p_on_a_large_vocabulary_draws_only_from_the_nucleus():
    """Through ``sample_tokens``: top-p 0.7 over (0.6, 0.3, 0.1 spread over the rest) keeps the
    first two; the recorded log-probs stay the untruncated ones."""
    p = torch.full((V,), 0.1 / (V - 2))
    p[0], p[1] = 0.6, 0.3
    logits = p.log().repeat(2000, 1)
    tok, logp = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1} and 0.6 < (tok == 0).float().mean().item() < 0.73
    np.testing.assert_allclose(logp.numpy(), p.log().numpy()[tok.numpy()], rtol=1e-5)
