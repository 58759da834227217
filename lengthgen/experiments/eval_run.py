"""`lengthgen eval RUN`: a trained run's evaluation by position and length, far beyond its training length."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lengthgen.eval import MULTIPLES, RunEval, eval_source, evaluate
from lengthgen.train import load_run
from lengthgen.data.config import make_source
from lengthgen.train.setup import autocast_dtype, device_type


def eval_run(path: str | Path, *, lengths: list[int] | None = None, tokens: int = 8192, bema: bool = False
             ) -> RunEval:
    """Evaluate the run folder or checkpoint ``path`` (its BEMA weights with ``bema``) with the one evaluator,
    on the run's device and autocast, seeded with its ``train.seed``, at ``lengths`` (default: the training
    length x `MULTIPLES`) with ``tokens`` tokens per length; text runs on single long documents."""
    cfg, model = load_run(path, bema=bema)
    kind = device_type(cfg.train)
    lengths = lengths or [max(cfg.lengths()) * m for m in MULTIPLES]
    source = eval_source(cfg.data, make_source(cfg.data))
    result = evaluate(model.to(kind), source, lengths, tokens_per_length=tokens, seed=cfg.train.seed,
                      autocast=autocast_dtype(cfg.train, kind))
    return dataclasses.replace(result, config=cfg.to_dict(), seed=cfg.train.seed, run_dir=str(path), bema=bema)


__all__ = ["eval_run"]
