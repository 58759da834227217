"""Loss (or any metric) by position, in power-of-2 buckets (seed 000's stratified evaluation)."""

from __future__ import annotations

import math

import torch


def bucket_edges(length: int) -> list[tuple[int, int]]:
    """1-based position buckets ``[2^(k-1), 2^k)`` covering positions 1..length; the last one is cut at length."""
    edges, lo = [], 1
    while lo <= length:
        edges.append((lo, min(2 * lo, length + 1)))
        lo *= 2
    return edges


def nanmean_by_position(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the batch of (B, L) values with NaN = undefined: (means (L,), counts (L,))."""
    valid = ~torch.isnan(values)
    counts = valid.sum(0)
    sums = torch.where(valid, values, torch.zeros_like(values)).sum(0)
    return sums / counts.clamp(min=1), counts


def bucket_means(values: torch.Tensor) -> list[dict]:
    """Per-bucket mean of (B, L) or (L,) values (NaN ignored). Rows: lo, hi (1-based, hi exclusive), mean, count."""
    values = values.reshape(-1, values.shape[-1]).double()
    rows = []
    for lo, hi in bucket_edges(values.shape[-1]):
        chunk = values[:, lo - 1:hi - 1]
        valid = ~torch.isnan(chunk)
        count = int(valid.sum())
        mean = float(chunk[valid].mean()) if count else math.nan
        rows.append({"lo": lo, "hi": hi, "mean": mean, "count": count})
    return rows


def prefix_means(values: torch.Tensor) -> list[dict]:
    """Mean over positions 1..P for P = 1, 2, 4, ..., and the full length. Rows: length, mean, count."""
    values = values.reshape(-1, values.shape[-1]).double()
    length = values.shape[-1]
    ends = sorted({lo for lo, _ in bucket_edges(length)} | {length})
    rows = []
    for end in ends:
        chunk = values[:, :end]
        valid = ~torch.isnan(chunk)
        count = int(valid.sum())
        rows.append({"length": end, "mean": float(chunk[valid].mean()) if count else math.nan, "count": count})
    return rows
