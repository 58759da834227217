"""Loss (or any metric) by position, in power-of-2 buckets (seed 000's stratified evaluation).

Positions are 0-based (position p predicts with p + 1 tokens of context): buckets ``[0, 1)``, ``[1, 2)``,
``[2, 4)``, ..., ``[2^(k-1), 2^k)``; at a power-of-2 length L the last bucket is exactly ``[L/2, L)``."""

from __future__ import annotations

import math

import torch


def bucket_edges(length: int) -> list[tuple[int, int]]:
    """Position buckets ``[0, 1)``, then ``[2^(k-1), 2^k)`` covering 0..length-1; the last one is cut at length."""
    edges, lo = [(0, 1)], 1
    while lo < length:
        edges.append((lo, min(2 * lo, length)))
        lo *= 2
    return edges


def nanmean_by_position(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the batch of (B, L) values with NaN = undefined: (means (L,), counts (L,))."""
    valid = ~torch.isnan(values)
    counts = valid.sum(0)
    sums = torch.where(valid, values, torch.zeros_like(values)).sum(0)
    return sums / counts.clamp(min=1), counts


def bucket_means(values: torch.Tensor) -> list[dict]:
    """Per-bucket mean of (B, L) or (L,) values (NaN ignored). Rows: lo, hi (0-based, hi exclusive), mean, count."""
    values = values.reshape(-1, values.shape[-1]).double()
    rows = []
    for lo, hi in bucket_edges(values.shape[-1]):
        chunk = values[:, lo:hi]
        valid = ~torch.isnan(chunk)
        count = int(valid.sum())
        mean = float(chunk[valid].mean()) if count else math.nan
        rows.append({"lo": lo, "hi": hi, "mean": mean, "count": count})
    return rows


def prefix_means(values: torch.Tensor) -> list[dict]:
    """Mean over the first P positions for P = 1, 2, 4, ..., and the full length. Rows: length, mean, count."""
    values = values.reshape(-1, values.shape[-1]).double()
    ends = sorted({hi for _, hi in bucket_edges(values.shape[-1])})
    rows = []
    for end in ends:
        chunk = values[:, :end]
        valid = ~torch.isnan(chunk)
        count = int(valid.sum())
        rows.append({"length": end, "mean": float(chunk[valid].mean()) if count else math.nan, "count": count})
    return rows
