"""Drawing one token per row from a batch of probability rows: the built-in engine's sampler.

``torch.multinomial`` on a CPU walks each row serially; at a 32k vocabulary and 64 rows it costs
~45 ms, as much as a small model's whole forward. :func:`draw` samples large vocabularies on a
CPU by inverse CDF instead (vectorized running sums and a binary search: 6-17x cheaper there,
``benchmarks/sampling.py``). It keeps multinomial below :data:`INVERSE_CDF_MIN_VOCAB`, so the
tiny model's seeded random streams (the tests', the default example's) stay what they were, and
on GPUs (whose multinomial is a parallel kernel; the inverse CDF's per-chunk checks would each
wait for the device).

Invariants: exact in distribution (each index with probability its entry over the row's sum, in
float64); an entry of 0 (e.g. cut by top-p) is never drawn; the same generator state gives the
same draws; a row whose sum is NaN, inf or 0 raises ``ValueError`` instead of drawing garbage.
"""

from __future__ import annotations

import torch

INVERSE_CDF_MIN_VOCAB = 4096  # from this vocabulary size on, ``draw`` samples by inverse CDF
CHUNK_ELEMENTS = 1 << 19  # running sums of at most this many entries at a time (4 MB of float64)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``probs`` (B, V), drawn with probability proportional to the row's
    entries (each row sums to ~1; an entry of 0 is never drawn).

    Below :data:`INVERSE_CDF_MIN_VOCAB` entries, or off the CPU: ``torch.multinomial``. From there
    on, on a CPU, by inverse CDF: one uniform number per row (all drawn first: the stream does not
    depend on the chunks), scaled by the row's total, then the first index whose running sum
    (float64: rounding moves no measurable mass even over 152k entries) exceeds it. The running
    sums are taken a few rows at a time (:data:`CHUNK_ELEMENTS`): one (B, V) float64 buffer per
    call cost more in fresh pages than the sums themselves (18 against 2.4 ms at 64 x 32k on the
    project machine)."""
    rows, vocab = probs.shape
    if vocab < INVERSE_CDF_MIN_VOCAB or probs.device.type != "cpu":  # (a GPU's multinomial is parallel)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    u = torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=probs.device)
    out = torch.empty(rows, dtype=torch.long, device=probs.device)
    step = max(1, CHUNK_ELEMENTS // vocab)
    for i in range(0, rows, step):
        tok, ok = inverse_cdf(probs[i:i + step], u[i:i + step, 0])
        if not bool(ok.all()):
            raise ValueError(BROKEN_ROW)
        out[i:i + step] = tok
    return out


BROKEN_ROW = "sampling: a row's probabilities are not finite or sum to 0 (NaN/inf logits?)"


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One index per row of ``probs`` (B, V) for the uniform numbers ``u`` (B, float64): the first
    index whose running sum (float64) exceeds ``u`` times the row's total; and whether each row's
    total is finite and positive (else its index is garbage). No host synchronisation: this is
    :func:`draw`'s rule for large vocabularies, and the sampler of the built-in engine's captured
    decode step (:mod:`asyncflow.engines.slot_step`), whose uniforms are drawn by :func:`uniforms`."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    ok = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    return torch.searchsorted(cdf, x, right=True)[:, 0], ok


def uniforms(rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The ``rows`` uniform numbers (float64, on the generator's device) that :func:`draw` takes
    from ``generator`` for ``rows`` rows of a large vocabulary: the same stream, drawn ahead."""
    device = generator.device if generator is not None else "cpu"
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=device)[:, 0]


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (rows summing to 1) with every entry outside the row's top-``p`` nucleus set to 0
    (the smallest set of the largest entries whose mass reaches ``top_p``; not renormalised)."""
    sorted_p, order = probs.sort(-1, descending=True)
    cut = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(cut, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_p)

