"""Retrieval maps: how well a model finds needles at each depth of each context length, through the one
evaluator.

A cell (depth, L) is `lengthgen.eval.evaluate` at length L on `lengthgen.data.needles.needle_source` at that
depth, ``samples`` sequences, seeded with the evaluation generator of length L: every depth of one length sees
the same haystacks, keys and values and only the needles move. It runs like any evaluation (the model's device,
the training autocast, eval mode, forward passes of at most ``forward_tokens`` tokens, the memory-linear
attention backends ``auto`` picks), with a measure that scores answers (`answer_scores`).

Greedy exact match needs no generation loop: with the answer tokens teacher-forced, greedy decoding produces the
answer iff the argmax at every answer position is its target (up to the first miss greedy decoding has the same
prefix as the teacher-forced input), so one forward pass scores exact match and the answer tokens' loss together.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.config import MAX_SIZE, ConfigError, check_value
from lengthgen.data.needles import needle_source
from lengthgen.data.tasks.base import Batch
from lengthgen.eval.evaluate import Measure, evaluate, listed, model_rows_at_once
from lengthgen.eval.results import NeedleCell, NeedleMap

#: default depths: 0, 0.1, ..., 1 (fractions of the filler before the needle)
DEPTHS = tuple(i / 10 for i in range(11))


def answer_scores(logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
    """Per sequence (B,): ``exact_match`` (the fraction of its answers whose every token's argmax is the target),
    ``token_accuracy`` and ``answer_loss`` (mean cross-entropy, nats) over its answer tokens. ``logits``: (N, V)
    at the N positions of ``batch.loss_mask`` in row-major order; ``batch.extra["answer"]`` numbers the answers.

    An answer token whose logits are not all finite (a diverged model) is wrong, with loss +inf, and a warning:
    greedy decoding has no token to pick there (`lengthgen.model.gpt.next_token` refuses), whereas argmax would
    return a NaN's index, scoring the answers that start with token 0 right."""
    mask = batch.loss_mask
    rows, targets, groups = mask.nonzero()[:, 0], batch.targets[mask], batch.extra["answer"][mask]
    failed = ~logits.isfinite().all(-1)
    right = ((logits.argmax(-1) == targets) & ~failed).float()
    loss = F.cross_entropy(logits.float(), targets, reduction="none").masked_fill(failed, math.inf)
    if bool(failed.any()):
        warnings.warn(f"the model's output is not finite at {int(failed.sum())} of {failed.numel()} answer tokens: "
                      "they count as wrong, with loss +inf", stacklevel=2)
    count, width = mask.shape[0], int(groups.max()) + 1
    answers = rows * width + groups                                   # one index per (sequence, answer)
    ones = torch.ones_like(loss)
    tokens, answer_tokens = _sums(ones, rows, count), _sums(ones, answers, count * width)
    exact = ((_sums(right, answers, count * width) == answer_tokens) & (answer_tokens > 0)).view(count, width)
    return {"exact_match": exact.sum(1) / (answer_tokens > 0).view(count, width).sum(1),
            "token_accuracy": _sums(right, rows, count) / tokens, "answer_loss": _sums(loss, rows, count) / tokens}


def _sums(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """(size,) sums of ``values`` by ``index``."""
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def measure_needle_gpt(model: nn.Module, source: Any, batch: Batch) -> dict[str, torch.Tensor]:
    """The evaluator's adapter for a lengthgen `GPT`: logits only at the answer positions (the head never sees
    the rest of the sequence), then `answer_scores`. The logits are `GPT.head_logits`, outside autocast as
    `GPT.generate` reads them: bfloat16 logits would tie close candidates (argmax then takes the lowest id) and shift
    the answer loss, so exact match would not be greedy decoding's."""
    hidden = model.features(batch.tokens, doc_ids=batch.doc_ids)[batch.loss_mask]
    return answer_scores(model.head_logits(hidden), batch)


def check_needles(source: Any, lengths: list[int], depths: list[float], needles: int, key: str | None = None
                  ) -> None:
    """A `ConfigError` before any model runs: bad depths or needle count, a source without needles, or a length
    it cannot build; ``key`` (the option that asks for the maps) heads every message."""
    try:
        check_value("depths", list(depths), list[float], ge=0, le=1)
        check_value("needles", needles, int, ge=1)
        if not depths:
            raise ConfigError("depths: give at least one depth in [0, 1], e.g. 0,0.5,1", "depths")
        if not lengths:
            raise ConfigError("lengths: give at least one context length, e.g. 256,1024", "lengths")
        limit = getattr(source, "max_length", None)
        for length in lengths:
            if limit is not None and length > limit:
                raise ConfigError(f"lengths: length {length} exceeds the data's maximum length {limit}", "lengths")
            for depth in (min(depths), max(depths)):
                try:
                    needle_source(source, depth, needles).sample(1, length, torch.Generator().manual_seed(0))
                except ConfigError:
                    raise
                except ValueError as err:
                    raise ConfigError(f"lengths: length {length}: {err}", "lengths") from None
    except ConfigError as err:
        raise err if key is None else ConfigError(f"{key}: {err}", key) from None


def needle_map(model: nn.Module, source: Any, lengths: list[int], depths: list[float], *, needles: int = 1,
               samples: int = 100, seed: int = 0, autocast: torch.dtype | None = None,
               forward_tokens: int | None = None, measure: Measure = measure_needle_gpt, progress: bool = True,
               train_length: int | None = None) -> NeedleMap:
    """The retrieval map of ``model`` on ``source`` (a retrieval task or text data) at every (depth, length), each
    cell ``samples`` sequences with ``needles`` needles (see the module docstring); checked first by
    `check_needles`. A progress bar over the cells on a terminal (``progress``)."""
    lengths = sorted(set(check_value("lengths", listed(lengths), list[int], ge=1, le=MAX_SIZE)))
    depths = sorted(set(check_value("depths", listed(depths), list[float], ge=0, le=1)))
    check_value("samples", samples, int, ge=1)
    check_needles(source, lengths, depths, needles)
    try:        # each cell's batch of ``samples`` sequences, at the longest length: before any cell is computed
        model_rows_at_once(model, samples, lengths[-1], forward_tokens, autocast)
    except MemoryError as err:
        raise ConfigError(f"samples={samples}: {err}; map fewer sequences per cell (lengthgen needle --samples, "
                          "compare.needle_samples)", "samples") from None
    start, cells = time.perf_counter(), []
    with _bar(len(lengths) * len(depths), progress) as bar:
        for length in lengths:
            for depth in depths:
                result = evaluate(model, needle_source(source, depth, needles), [length],
                                  tokens_per_length=samples * length, seed=seed, autocast=autocast,
                                  forward_tokens=forward_tokens, diagnostics=False, measure=measure)
                row = result.lengths[0]
                cells.append(NeedleCell(depth, length, row.batch_size, **row.at_length, chance=row.chance))
                if bar is not None:
                    bar.update()
                    bar.set_postfix(length=length, depth=depth, exact_match=f"{cells[-1].exact_match:.3f}")
    return NeedleMap(source=getattr(source, "name", "text"), needles=needles, depths=depths, lengths=lengths,
                     cells=cells, eval_seed=seed, provenance=result.provenance,
                     train_length=train_length, eval_seconds=round(time.perf_counter() - start, 2))


def _bar(total: int, progress: bool) -> contextlib.AbstractContextManager:
    """A tqdm bar on a terminal's stdout (as training's), else nothing."""
    if not (progress and sys.stdout.isatty()):
        return contextlib.nullcontext()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="needle cells", file=sys.stdout, dynamic_ncols=True)


__all__ = ["DEPTHS", "answer_scores", "check_needles", "measure_needle_gpt", "needle_map"]
