"""``lengthgen sample RUN --prompt TEXT``: a trained text run continues a prompt (KV-cached `GPT.generate`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lengthgen.config import ConfigError, check_value
from lengthgen.data.text import make_tokenizer
from lengthgen.train import load_run
from lengthgen.train.setup import autocast_dtype, for_inference, run_threads
from lengthgen.train.weights import check_trained_tokenizer


def sample_run(path: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
               top_k: int | None = None, seed: int = 0, bema: bool = False) -> str:
    """``prompt`` and its continuation by the run folder or checkpoint ``path`` (its BEMA weights with ``bema``).

    The prompt is encoded with the run's tokenizer after a BOS (every training document starts with one), then
    continued by `GPT.generate` (``temperature`` 0: greedy; ``top_k``; a generator seeded with ``seed``) on the
    run's device, autocast (`for_inference`) and CPU threads (`run_threads`), until the model writes a BOS or EOS
    (its document ends there) or an id the tokenizer lacks (a padded vocabulary's rows), decoded up to that id.
    A task run is a `ConfigError`: its ids are the task's symbols, not text.
    """
    seed = check_value("seed", seed, int, ge=0, le=2**63 - 1)
    cfg, model = load_run(path, bema=bema)
    if cfg.data.kind != "text":
        raise ConfigError(f"{path} is a {cfg.data.task!r} task run, whose tokens are the task's symbols: sample "
                          f"continues text runs (data.kind = 'text'); evaluate a task run with lengthgen eval {path}",
                          "data.kind")
    tokenizer = make_tokenizer(cfg.data.text.get("tokenizer", "byte"))
    check_trained_tokenizer(path, tokenizer)
    model, kind = for_inference(model, cfg.train)
    ids = tokenizer.encode(prompt)
    dtype = autocast_dtype(cfg.train, kind)
    with run_threads(cfg.train), torch.autocast(kind, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        vocab = model.config.vocab_size
        stops = [i for i in (tokenizer.bos_id, tokenizer.eos_id, *range(tokenizer.vocab_size, vocab))
                 if i is not None and i < vocab]
        out = model.generate(torch.tensor([[tokenizer.bos_id, *ids]], device=kind), max_new_tokens,
                             temperature=temperature, top_k=top_k, generator=torch.Generator(kind).manual_seed(seed),
                             bos_id=tokenizer.bos_id, stop_ids=stops)
    new = out[0, len(ids) + 1:].tolist()
    end = next((i for i, t in enumerate(new) if t in stops), len(new))
    return tokenizer.decode(ids + new[:end])


__all__ = ["sample_run"]
