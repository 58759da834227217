"""Loss by position far beyond the training length, for a run's final evaluation and for retrofits.

`evaluate_by_position` runs `lengthgen.eval.evaluate.evaluate` (power-of-2 position buckets, value "at
length" = mean over the last bucket) on the data source of a run. For text data each row is *one long
document* (BOS + its first L tokens, no packing) of the validation split, so position p really has p tokens
of context; where a split has too few documents that long, the training split's documents are used, and
failing that packed rows (several documents back to back, as in training). Every row of the result says
which (``"rows"``). Synthetic tasks generate any length, so their own ``sample`` is used.

`position_table` formats the buckets as a text table (rows: position buckets, columns: eval lengths).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch

from lengthgen.data.tasks.base import Batch


class LongDocumentSource:
    """A task-like view of text data whose ``sample(count, length, generator)`` returns single long documents.

    ``candidates``: (label, TextData) tried in order; the first with at least one document of ``length``
    tokens gives ``min(count, available)`` rows. ``fallback`` (packed rows) is used when none has one.
    ``used[length]`` records what each length got.
    """

    head = "lm"
    metric = "loss"
    higher_is_better = False
    max_length = None
    min_length = 1

    def __init__(self, candidates: list[tuple[str, Any]], fallback: Any) -> None:
        self.candidates, self.fallback = candidates, fallback
        self.vocab_size = fallback.vocab_size
        self.name = getattr(fallback, "name", "text")
        self.used: dict[int, str] = {}

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        seed = int(torch.randint(2 ** 62, (1,), generator=generator))
        for label, data in self.candidates:
            available = int(np.count_nonzero(data.stream.doc_lengths >= length))
            if available:
                count = min(batch_size, available)
                self.used[length] = f"{count} long documents ({label})"
                return data.long_batch(length, count, seed)
        self.used[length] = f"{batch_size} packed rows (no document of {length} tokens)"
        return self.fallback.sample(batch_size, length, torch.Generator().manual_seed(seed))

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return self.fallback.metrics(output, batch)


def position_eval_source(data_cfg: Any, source: Any) -> Any:
    """The source to evaluate by position: long documents for text data (validation split first), else
    ``source`` itself."""
    if data_cfg.kind != "text" or not hasattr(source, "long_batch"):
        return source
    from lengthgen.data.text import CorpusError, make_text_data

    candidates: list[tuple[str, Any]] = []
    split = data_cfg.text.get("split", "train")
    if split != "all":
        try:
            candidates.append(("val split", make_text_data(**{**data_cfg.text, "split": "val"})))
        except (CorpusError, ValueError):
            pass
    candidates.append((f"{split} split", source))
    return LongDocumentSource(candidates, source)


def evaluate_by_position(model: torch.nn.Module, task: Any, lengths: list[int], *, tokens_per_length: int,
                         seed: int = 0, device: str | torch.device = "cpu", autocast: Any = None,
                         diagnostics: bool = False) -> list[dict]:
    """`evaluate` at ``lengths`` (ascending) on ``task`` (see `position_eval_source`), under ``autocast`` (a
    context manager factory or None). Each row gains ``"rows"``: what was evaluated at that length."""
    from lengthgen.eval.evaluate import evaluate

    with (autocast() if autocast is not None else contextlib.nullcontext()):
        rows = evaluate(model, task, lengths, tokens_per_length=tokens_per_length, seed=seed, device=device,
                        diagnostics=diagnostics)
    used = getattr(task, "used", {})
    for row in rows:
        row["rows"] = used.get(row["length"], f"{row['batch_size']} sampled sequences")
    return rows


def position_table(rows: list[dict], metric: str = "loss", *, train_length: int | None = None) -> str:
    """Text table of ``metric`` by position bucket (rows) and eval length (columns); ``*`` marks buckets
    beyond the training length."""
    rows = [r for r in rows if metric in r.get("buckets", {})]
    if not rows:
        return ""
    longest = max(rows, key=lambda r: r["length"])
    header = ["positions", *(str(r["length"]) for r in rows)]
    body = []
    for i, bucket in enumerate(longest["buckets"][metric]):
        label = f"[{bucket['lo']}, {bucket['hi']})"
        if train_length is not None and bucket["hi"] > train_length:
            label += " *"
        cells = []
        for r in rows:
            buckets = r["buckets"][metric]
            value = buckets[i]["mean"] if i < len(buckets) and buckets[i]["hi"] == bucket["hi"] else math.nan
            cells.append("" if math.isnan(value) else f"{value:.4f}")
        body.append([label, *cells])
    body.append([f"at length ({metric})", *(f"{r['at_length'].get(metric, math.nan):.4f}" for r in rows)])
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    notes = [f"{metric} by position (columns: eval length)"
             + (f"; * = positions beyond the training length {train_length}" if train_length else "")]
    notes += [f"  length {r['length']}: {r['rows']}" for r in rows if "rows" in r]
    return "\n".join([notes[0], *lines, *notes[1:]])


__all__ = ["LongDocumentSource", "evaluate_by_position", "position_eval_source", "position_table"]
