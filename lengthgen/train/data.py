"""Splitting a batch into micro-batches (gradient accumulation) and per-rank shares (DDP)."""

from __future__ import annotations

import torch

from lengthgen.data.tasks.base import Batch


def split_batch(batch: Batch, parts: int) -> list[tuple[Batch, float]]:
    """Split along the batch axis into ``parts`` micro-batches, each with its share of the sequences."""
    total = batch.tokens.shape[0]
    parts = max(1, min(parts, total))
    out = []
    for idx in torch.arange(total).tensor_split(parts):
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        out.append((batch.rows(lo, hi), (hi - lo) / total))
    return out
