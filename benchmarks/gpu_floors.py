"""Floors of what ``benchmarks/gpu_scale.py`` measures: the fewest bytes and FLOPs a step must
move and compute, over the card's bandwidth and matrix rate (METHOD.md's "two numbers first").

* a decode step of ``c`` answers at mean context ``ctx``: read every weight once (bf16: 2 bytes
  a parameter; the tied head is the embedding, counted once) and the KV cache of every live
  token (``layers x 2 x kv_heads x head_dim`` bf16 values a token); FLOPs ``2 N c`` plus
  attention ``4 c ctx layers heads head_dim``. Floor = the larger of bytes / bandwidth and
  FLOPs / peak;
* training: model FLOPs of a pass over sequences of lengths ``s`` = ``6 N sum(s) +
  12 layers hidden sum(s^2)`` (PaLM's model-FLOPs convention: no recompute counted, attention
  not halved for causality); floor = FLOPs / peak, MFU = FLOPs / (seconds x peak);
* a ``sync`` step of ``P x G`` long-tailed answers: decode steps one after another (the short
  answers' ``short`` steps at ``P x G`` rows, then the long ones' remaining steps at the long
  rows only) plus training the step's tokens.

Card figures are the datasheets' (H200: 4.8 TB/s, ~989 TFLOP/s dense bf16; H100 SXM: 3.35 TB/s,
989): a floor is what no implementation beats; this workplace measured ~4.3 TB/s copies and
~790 TFLOP/s bf16 matrix products on an H200 (KINDS.md), so ~0.8-0.9 of a floor is the ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass

CARDS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}  # (bytes/s, bf16 dense FLOP/s)


@dataclass
class Shape:
    """The model's dimensions and parameter count (tied embeddings counted once)."""

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @staticmethod
    def of(dims: dict, params: int) -> Shape:
        return Shape(params, dims["num_hidden_layers"], dims["hidden_size"], dims["num_attention_heads"],
                     dims["num_key_value_heads"])


def card(name: str) -> tuple[float, float] | None:
    """(bandwidth, bf16 peak) of a card whose name contains H200 or H100; None otherwise."""
    return next((v for k, v in CARDS.items() if k in name), None)


def mean_context(prompt: int, short: int, long: int, frac: float) -> float:
    """Mean KV length a generated token attends to with answers ``long`` (share ``frac``) or
    ``short``: ``prompt + E[L^2] / (2 E[L])`` (the tokens of long answers weigh more).

    >>> round(mean_context(32, 128, 1024, 0.125), 1)
    334.9
    """
    m1 = frac * long + (1 - frac) * short
    m2 = frac * long**2 + (1 - frac) * short**2
    return prompt + m2 / (2 * m1)


def decode_step(shape: Shape, rows: float, ctx: float, bandwidth: float, peak: float) -> dict:
    """Bytes, FLOPs and floor seconds of one decode step of ``rows`` answers at context ``ctx``."""
    kv = rows * ctx * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    weights = 2 * shape.params
    flops = 2 * shape.params * rows + 4 * rows * ctx * shape.layers * shape.heads * shape.head_dim
    seconds = max((weights + kv) / bandwidth, flops / peak)
    return {"weight_bytes": weights, "kv_bytes": kv, "flops": flops, "floor_s": seconds,
            "floor_tokens_per_s": rows / seconds}


def train_flops(shape: Shape, lengths: list[int]) -> float:
    """Model FLOPs of one forward+backward over sequences of these lengths (module doc).

    >>> train_flops(Shape(100, 2, 8, 2, 1), [3, 4])  # 6 x 100 x 7 + 12 x 2 x 8 x (9 + 16)
    9000.0
    """
    return 6.0 * shape.params * sum(lengths) + 12.0 * shape.layers * shape.hidden * sum(s * s for s in lengths)


def sync_step(shape: Shape, answers: int, prompt: int, short: int, long: int, frac: float, bandwidth: float,
              peak: float) -> dict:
    """Floor seconds and samples/s of one ``sync`` step (module doc); ``async`` overlaps decode
    and training, so its floor is the larger of the two instead of their sum."""
    n_long = max(1.0, answers * frac)
    ctx_short, ctx_long = prompt + short / 2, prompt + short + (long - short) / 2
    decode = (short * decode_step(shape, answers, ctx_short, bandwidth, peak)["floor_s"]
              + (long - short) * decode_step(shape, n_long, ctx_long, bandwidth, peak)["floor_s"])
    lengths = [prompt + long] * int(n_long) + [prompt + short] * int(answers - n_long)
    train = train_flops(shape, lengths) / peak
    return {"decode_s": decode, "train_s": train, "sync_samples_per_s": answers / (decode + train),
            "async_samples_per_s": answers / max(decode, train)}
