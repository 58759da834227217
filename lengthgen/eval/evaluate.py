"""Evaluate a model far beyond its training length: loss and task metrics by position and by length.

For each evaluated length L a fresh seeded batch is drawn (constant tokens per length), the model runs
once (memory-linear attention backends pick themselves), and every per-position quantity is averaged in
power-of-2 position buckets (seed 000). The value "at length L" of a per-position metric is its mean over
positions ``[L/2, L)`` (0-based; the last bucket): how the model does at positions only that length reaches. Per-sequence
metrics (``classify`` tasks) are averaged over the batch at each length.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.eval.buckets import bucket_means, prefix_means
from lengthgen.eval.diagnostics import STATS, model_diagnostics


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = values.detach().float()
    return values if values.dim() == 1 else torch.where(mask, values, torch.full_like(values, math.nan))


def _last_bucket_mean(values: torch.Tensor) -> float:
    """Mean over positions [L/2, L) (NaN ignored); the whole sequence for per-sequence values."""
    if values.dim() == 1:
        return float(values.nanmean())
    length = values.shape[-1]
    chunk = values[:, length // 2:]
    return float(chunk.nanmean())


@torch.no_grad()
def evaluate_length(model: torch.nn.Module, task: Task, length: int, *, batch_size: int, seed: int = 0,
                    diagnostics: bool = False, device: str | torch.device = "cpu") -> dict:
    """One length: per-position (bucketed) loss and metrics, their values at this length, and optionally
    attention diagnostics (bucketed, averaged over heads, per layer) on the first sequence."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + length)
    batch: Batch = task.sample(batch_size, length, generator).to(device)
    model.eval()
    output = model(batch.tokens, doc_ids=batch.doc_ids)
    _, per_item = model.loss(output, batch)
    values = {"loss": _masked(per_item, batch.loss_mask)}
    values.update({name: v.detach().float() for name, v in task.metrics(output, batch).items()})
    result = {
        "length": length,
        "batch_size": batch_size,
        "at_length": {name: _last_bucket_mean(v) for name, v in values.items()},
        "mean": {name: float(v.nanmean()) for name, v in values.items()},
        "buckets": {name: bucket_means(v) for name, v in values.items() if v.dim() == 2},
        "prefix": {name: prefix_means(v) for name, v in values.items() if v.dim() == 2},
    }
    if diagnostics:
        one = Batch(batch.tokens[:1], batch.targets[:1], batch.loss_mask[:1],
                    None if batch.doc_ids is None else batch.doc_ids[:1])
        layers = model_diagnostics(model, lambda: model(one.tokens, doc_ids=one.doc_ids))
        result["diagnostics"] = [{stat: bucket_means(layer[stat].mean(0)) for stat in STATS if stat in layer}
                                 for layer in layers]
    return result


def evaluate(model: torch.nn.Module, task: Task, lengths: list[int], *, tokens_per_length: int = 8192,
             seed: int = 0, diagnostics: bool = True, device: str | torch.device = "cpu",
             progress: Callable[[int], None] | None = None) -> list[dict]:
    """Evaluate at every length (ascending); diagnostics at the longest. ``progress(length)`` is called
    after each length."""
    results = []
    lengths = sorted(set(lengths))
    for length in lengths:
        if task.max_length is not None and length > task.max_length:
            raise ValueError(f"task {task.name!r} cannot generate length {length} (max_length {task.max_length})")
        batch_size = max(1, tokens_per_length // length)
        results.append(evaluate_length(model, task, length, batch_size=batch_size, seed=seed, device=device,
                                       diagnostics=diagnostics and length == lengths[-1]))
        if progress is not None:
            progress(length)
    return results
