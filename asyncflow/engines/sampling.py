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
        cdf = torch.cumsum(probs[i:i + step], -1, dtype=torch.float64)
        total = cdf[:, -1:]
        if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
            raise ValueError("sampling: a row's probabilities are not finite or sum to 0 (NaN/inf logits?)")
        x = torch.minimum(u[i:i + step] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
        out[i:i + step] = torch.searchsorted(cdf, x, right=True)[:, 0]
    return out
