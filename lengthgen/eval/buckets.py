"""Loss (or any metric) by position, in power-of-2 buckets (seed 000's stratified evaluation).

Positions are 0-based (position p predicts with p + 1 tokens of context): buckets ``[0, 1)``, ``[1, 2)``,
``[2, 4)``, ..., ``[2^(k-1), 2^k)``; at a power-of-2 length L the last bucket is exactly ``[L/2, L)``."""

from __future__ import annotations

import math

import torch

from lengthgen.eval.results import Bucket


def bucket_edges(length: int) -> list[tuple[int, int]]:
    """Position buckets ``[0, 1)``, then ``[2^(k-1), 2^k)`` covering 0..length-1; the last one is cut at length."""
    edges, lo = [(0, 1)], 1
    while lo < length:
        edges.append((lo, min(2 * lo, length)))
        lo *= 2
    return edges


def _mean(values: torch.Tensor, lo: int, hi: int) -> Bucket:
    chunk = values[:, lo:hi]
    valid = ~torch.isnan(chunk)
    count = int(valid.sum())
    return Bucket(lo, hi, float(chunk[valid].mean()) if count else math.nan, count)


def bucket_means(values: torch.Tensor) -> list[Bucket]:
    """Per-bucket mean of (B, L) or (L,) values (NaN ignored; an empty bucket's mean is NaN)."""
    values = values.reshape(-1, values.shape[-1]).double()
    return [_mean(values, lo, hi) for lo, hi in bucket_edges(values.shape[-1])]


def prefix_means(values: torch.Tensor) -> list[Bucket]:
    """Mean over the first P positions, ``[0, P)``, for P = 1, 2, 4, ... and the full length."""
    values = values.reshape(-1, values.shape[-1]).double()
    return [_mean(values, 0, hi) for _, hi in bucket_edges(values.shape[-1])]
