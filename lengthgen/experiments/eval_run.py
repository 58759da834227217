"""`lengthgen eval RUN`: a trained run's evaluation by position and length, far beyond its training length."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lengthgen.config import MAX_SIZE, check_value
from lengthgen.eval import MULTIPLES, RunEval, eval_source, evaluate
from lengthgen.train import load_run
from lengthgen.data.config import make_source
from lengthgen.train.setup import autocast_dtype, check_length, for_inference


def eval_run(path: str | Path, *, lengths: list[int] | None = None, tokens: int = 8192, bema: bool = False
             ) -> RunEval:
    """Evaluate the run folder or checkpoint ``path`` (its BEMA weights with ``bema``) with the one evaluator,
    on the run's device and autocast (`for_inference`), seeded with its ``train.seed``, at ``lengths`` (default:
    the training length x `MULTIPLES`) with ``tokens`` tokens per length, in forward passes of at most
    ``train.eval_batch_size`` x training length tokens as the trainer's and compare's evaluations; text runs on
    single long documents. A bad length or token count is a `ConfigError`, checked before the model is run."""
    tokens = check_value("tokens", tokens, int, ge=1, le=MAX_SIZE)
    cfg, model = load_run(path, bema=bema)
    model, kind = for_inference(model, cfg.train)
    lengths = lengths or [max(cfg.lengths()) * m for m in MULTIPLES]
    data = make_source(cfg.data)
    for length in lengths:
        check_length(data, "lengths", length)
    source = eval_source(cfg.data, data)
    result = evaluate(model, source, lengths, tokens_per_length=tokens, seed=cfg.train.seed,
                      autocast=autocast_dtype(cfg.train, kind),
                      forward_tokens=cfg.train.eval_batch_size * max(cfg.lengths()))
    return dataclasses.replace(result, config=cfg.to_dict(), seed=cfg.train.seed, run_dir=str(path), bema=bema)


__all__ = ["eval_run"]
