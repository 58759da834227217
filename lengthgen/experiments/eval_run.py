"""`lengthgen eval RUN`: a trained run's evaluation by position and length, far beyond its training length."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lengthgen.config import MAX_SIZE, check_value
from lengthgen.eval import MULTIPLES, RunEval, eval_source, evaluate
from lengthgen.train import load_run
from lengthgen.train.run_folder import load_newest
from lengthgen.train.weights import check_trained_data
from lengthgen.train.config import RunConfig
from lengthgen.data.config import make_source
from lengthgen.train.setup import autocast_dtype, check_length, for_inference, run_threads


def checked_lengths(cfg: RunConfig, source: Any, lengths: list[int] | None, key: str = "lengths") -> list[int]:
    """The evaluation lengths, sorted: ``lengths``, or by default the training length x `MULTIPLES` up to the
    data's ``max_length`` (mqar's vocabulary bounds it), each one ``source`` can generate and the memory hold
    (`check_length`; the error names ``key``, and the default when it is one). Used by eval, needle, compare and
    retrofit."""
    train_length = max(cfg.lengths())
    if not lengths:
        key += f" (default {train_length} x {', '.join(map(str, MULTIPLES))})"
        limit = getattr(source, "max_length", None)
        lengths = [train_length * m for m in MULTIPLES if limit is None or train_length * m <= limit]
    lengths = sorted(set(lengths))
    for length in lengths:
        check_length(source, key, length, cfg)
    return lengths


def eval_run(path: str | Path, *, lengths: list[int] | None = None, tokens: int = 8192, bema: bool = False
             ) -> RunEval:
    """Evaluate the run folder or checkpoint ``path`` (its BEMA weights with ``bema``) with the one evaluator, on the
    run's device, autocast (`for_inference`) and CPU threads (`run_threads`), seeded with its ``train.seed``, at
    ``lengths`` (default: `checked_lengths`') with ``tokens`` tokens per length, in forward passes of at most
    ``train.eval_batch_size`` x training length tokens as the trainer's and compare's evaluations; text runs on single
    long documents. A bad length or token count is a `ConfigError`, checked before the model is run."""
    tokens = check_value("tokens", tokens, int, ge=1, le=MAX_SIZE)
    ckpt, (cfg, model) = load_newest(path, lambda c: load_run(c, bema=bema))
    model, kind = for_inference(model, cfg.train)
    data = make_source(cfg.data)
    check_trained_data(ckpt, data)
    lengths = checked_lengths(cfg, data, lengths)
    source = eval_source(cfg.data, data)
    with run_threads(cfg.train):
        result = evaluate(model, source, lengths, tokens_per_length=tokens, seed=cfg.train.seed,
                          autocast=autocast_dtype(cfg.train, kind),
                          forward_tokens=cfg.train.eval_batch_size * max(cfg.lengths()))
    return dataclasses.replace(result, config=cfg.to_dict(), seed=cfg.train.seed, run_dir=str(path), bema=bema)


__all__ = ["checked_lengths", "eval_run"]
