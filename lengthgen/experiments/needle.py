"""`lengthgen needle RUN`: a trained run's retrieval map, needle-in-a-haystack accuracy by depth and length
(`lengthgen.eval.needle`), on its own retrieval task or, for text runs, in its corpus's text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.data.config import DataConfig, make_source
from lengthgen.eval import NeedleMap
from lengthgen.eval import DEPTHS, check_needles, needle_map, validation_text
from lengthgen.experiments.eval_run import checked_lengths
from lengthgen.train import load_run
from lengthgen.train.run_folder import load_newest
from lengthgen.train.weights import check_trained_data
from lengthgen.train.config import RunConfig
from lengthgen.train.setup import autocast_dtype, for_inference, run_threads


def needle_filler(data: DataConfig, source: Any) -> Any:
    """What a run's needles are hidden in: its task, or for text its corpus's validation split (the run's own
    split where the corpus has none), as single long evaluations use."""
    if data.kind != "text":
        return source
    val = validation_text(data)
    return source if val is None else val


def run_map(model: nn.Module, cfg: RunConfig, source: Any, lengths: list[int], depths: list[float], *,
            needles: int = 1, samples: int = 100, autocast: torch.dtype | None = None, progress: bool = False
            ) -> NeedleMap:
    """The retrieval map of a model trained with ``cfg``, on ``source`` (`needle_filler`), seeded with its
    ``train.seed``, in forward passes of ``train.eval_batch_size`` x training length tokens."""
    train_length = max(cfg.lengths())
    return needle_map(model, source, lengths, depths, needles=needles, samples=samples, seed=cfg.train.seed,
                      autocast=autocast, forward_tokens=cfg.train.eval_batch_size * train_length, progress=progress,
                      train_length=train_length)


def needle_run(path: str | Path, *, lengths: list[int] | None = None, depths: list[float] = DEPTHS,
               needles: int = 1, samples: int = 100, bema: bool = False, progress: bool = True) -> NeedleMap:
    """The retrieval map of the run folder or checkpoint ``path`` (its BEMA weights with ``bema``) at ``lengths``
    (default: `checked_lengths`') and ``depths``, on the run's device, autocast (`for_inference`) and CPU threads
    (`run_threads`). Bad lengths, depths or needle counts, and a run without needles, are `ConfigError` before the model
    runs."""
    ckpt, (cfg, model) = load_newest(path, lambda c: load_run(c, bema=bema))
    model, kind = for_inference(model, cfg.train)
    data = make_source(cfg.data)
    check_trained_data(ckpt, data)
    source = needle_filler(cfg.data, data)
    lengths = checked_lengths(cfg, source, lengths)
    check_needles(source, lengths, list(depths), needles)
    with run_threads(cfg.train):
        result = run_map(model, cfg, source, lengths, list(depths), needles=needles, samples=samples,
                         autocast=autocast_dtype(cfg.train, kind), progress=progress)
    return dataclasses.replace(result, config=cfg.to_dict(), seed=cfg.train.seed, run_dir=str(path), bema=bema)


__all__ = ["needle_filler", "needle_run", "run_map"]
