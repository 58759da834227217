"""What a run is evaluated on: its own source, or for text data single long documents.

Text data is trained on packed rows (documents back to back), but loss by position needs position p to have
p tokens of context: `LongDocuments` gives rows that are each *one* document (BOS + its first L tokens), from
the validation split first, then the training split (its label says the run trained on it; a warning too), and
packed rows only where no document is that long (of the validation split when there is one).
Synthetic tasks generate any length, so they are evaluated on themselves (`eval_source`).
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np
import torch

from lengthgen.config import ConfigError, ConfigWarning, counted
from lengthgen.data.tasks.base import Batch


class LongDocuments:
    """A source whose ``sample(count, length, generator)`` returns single long documents.

    ``candidates``: (label, TextData) tried in order; the first with at least one document of ``length``
    tokens gives ``min(count, available)`` rows. ``fallback`` (one of the candidates' TextData, packed rows) is
    sampled when none has one. `describe` says which, and when it is ``trained_on``, the text the run trained on;
    `sample` warns once per length when it takes ``trained_on`` for want of a long enough document in the first.
    """

    head = "lm"
    metric = "loss"
    higher_is_better = False
    max_length = None
    min_length = 1

    def __init__(self, candidates: list[tuple[str, Any]], fallback: Any, trained_on: Any = None) -> None:
        self.candidates, self.fallback, self.trained_on = candidates, fallback, trained_on
        self._warned: set[int] = set()
        self.vocab_size = fallback.vocab_size
        self.name = getattr(fallback, "name", "text")

    def digest(self) -> str:
        """The candidates' token digests (`TextData.digest`) hashed together: other evaluation text, another
        digest."""
        h = hashlib.blake2b(digest_size=16)
        for label, data in self.candidates:
            h.update(f"{label} {data.digest()};".encode())
        return h.hexdigest()

    def _pick(self, count: int, length: int) -> tuple[str, Any, int, int] | None:
        """(label, data, rows, available) of the first candidate with a document of ``length`` tokens."""
        for label, data in self.candidates:
            available = int(np.count_nonzero(data.stream.doc_lengths >= length))
            if available:
                return label, data, min(count, available), available
        return None

    def describe(self, count: int, length: int) -> str:
        """What ``sample(count, length, ...)`` returns, e.g. ``"2 long documents (val split)"``; when it takes
        every document that long, it says that every seed then evaluates the same ones; packed rows, that their
        positions' context is not one document of ``length`` tokens (and when they are longer than the whole text,
        that the text repeats within them)."""
        picked = self._pick(count, length)
        if picked is None:
            label = next(label for label, data in self.candidates if data is self.fallback)
            n = self.fallback.stream.num_tokens
            repeats = f"; its {n} tokens repeat within each row" if length + 1 > n else ""
            return (f"{counted(count, 'packed row')} of the {label}{self._trained(self.fallback)} (no document of "
                    f"{length} tokens: a row joins documents, so a position's context spans earlier documents, or "
                    f"under document masking only its own{repeats})")
        label, data, rows, available = picked
        every = "; all there are, the same for every seed" if rows == available else ""
        return f"{counted(rows, 'long document')} ({label}{self._trained(data)}{every})"

    def _trained(self, data: Any) -> str:
        return ", which the run trained on" if data is self.trained_on else ""

    def sample(self, count: int, length: int, generator: torch.Generator) -> Batch:
        seed = int(torch.randint(2 ** 62, (1,), generator=generator))
        picked = self._pick(count, length)
        if picked is None:
            return self.fallback.sample(count, length, torch.Generator().manual_seed(seed))
        _, data, rows, _ = picked
        first, held_out = self.candidates[0]
        if data is self.trained_on and data is not held_out and length not in self._warned:
            self._warned.add(length)
            warnings.warn(f"no document of the {first} has {length} tokens: length {length} is evaluated on "
                          f"{self.describe(count, length)}", ConfigWarning, stacklevel=2)
        return data.long_batch(length, rows, seed)

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return self.fallback.metrics(output, batch)


def validation_text(data_cfg: Any) -> Any:
    """The validation split of a text run's corpus (``data.text.val_corpus`` when set), or None where the run
    trains on ``split="all"`` or the corpus has no validation split. A ``val_corpus`` that cannot be read is a
    `ConfigError` naming it: it was asked for."""
    from lengthgen.data.text import make_text_data

    text = data_cfg.text
    if text.get("split", "train") == "all" and text.get("val_corpus") is None:
        return None
    try:
        return make_text_data(**{**text, "split": "val"})
    except (ValueError, TypeError, FileNotFoundError) as err:
        if text.get("val_corpus") is not None:
            raise ConfigError(f"data.text.val_corpus: {err}", "data.text.val_corpus") from None
        return None


def eval_source(data_cfg: Any, source: Any) -> Any:
    """The source to evaluate a run on: `LongDocuments` of its corpus for text data (the validation split
    first, `validation_text`; its training text after, labelled as such, with a warning when a validation split
    was expected but cannot be read; packed rows of the first of them), else ``source`` itself. A run trained
    on ``split="val"`` is evaluated on its training text, the val split, labelled as such, with a warning."""
    if data_cfg.kind != "text" or not hasattr(source, "long_batch"):
        return source
    split = data_cfg.text.get("split", "train")
    if split == "val":
        warnings.warn("the run trains on the validation split (data.text.split='val'): long documents are "
                      "evaluated on the text it trained on", ConfigWarning, stacklevel=2)
        return LongDocuments([("val split", source)], source, trained_on=source)
    val = validation_text(data_cfg)
    if val is None and split != "all":
        warnings.warn(f"corpus {data_cfg.text.get('corpus', 'stdlib')!r} has no validation split to read: long "
                      "documents are evaluated on the text the run trains on", ConfigWarning, stacklevel=2)
    return LongDocuments(([("val split", val)] if val is not None else []) + [(f"{split} split", source)],
                         source if val is None else val, trained_on=source)


__all__ = ["LongDocuments", "eval_source", "validation_text"]
