"""Splitting a batch into micro-batches (gradient accumulation) and per-rank shares (DDP)."""

from __future__ import annotations

import torch

from lengthgen.data.tasks.base import Batch


def counted(batch: Batch) -> int:
    """How many entries the batch's loss averages over (`GPT.loss`): its loss-mask positions, or with one target
    per sequence (``classify``) its sequences with any position in the mask."""
    mask = batch.loss_mask
    if batch.targets.dim() == 1 and mask.dim() == 2:
        mask = mask.any(-1)
    return int(mask.sum())


def split_batch(batch: Batch, parts: int) -> list[tuple[Batch, float]]:
    """Split along the batch axis into ``parts`` micro-batches, each with its weight in the batch's mean loss: its
    share of the counted entries (`counted`), so that the weighted sum of the parts' mean losses is the batch's
    even when the rows count unequal numbers of positions (its share of the sequences when none counts)."""
    total = batch.tokens.shape[0]
    parts = max(1, min(parts, total))
    if parts == 1:
        return [(batch, 1.0)]
    count = counted(batch)
    out = []
    for idx in torch.arange(total).tensor_split(parts):
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        micro = batch.rows(lo, hi)
        out.append((micro, counted(micro) / count if count else (hi - lo) / total))
    return out
