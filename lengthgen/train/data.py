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
        cut = lambda t: None if t is None else t[lo:hi]  # noqa: E731
        extra = {k: cut(v) if torch.is_tensor(v) and v.shape[:1] == (total,) else v for k, v in batch.extra.items()}
        out.append((Batch(cut(batch.tokens), cut(batch.targets), cut(batch.loss_mask), cut(batch.doc_ids), extra),
                    (hi - lo) / total))
    return out
