"""The corpus interface: documents in a fixed order, a train/val split by a stable hash of a key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from lengthgen.config import check_value

Split = Literal["train", "val", "all"]


class CorpusError(ValueError):
    """A corpus is empty, or one of its files is malformed (the message names the file)."""


def check_split_options(owner: str, split: str, val_fraction: float) -> tuple[str, float]:
    """``split`` (train | val | all) and ``val_fraction`` (in [0, 1]) checked; errors name ``owner.split``."""
    return (check_value(f"{owner}.split", split, Split),
            check_value(f"{owner}.val_fraction", val_fraction, float, ge=0, le=1))


def split_of(key: str, val_fraction: float) -> str:
    """``"val"`` for a fraction ``val_fraction`` of keys, ``"train"`` otherwise; a pure function of
    ``key`` (the first 8 bytes of its sha1 as a fraction of 2**64)."""
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return "val" if h / 2.0**64 < val_fraction else "train"


class Corpus:
    """Base class. ``documents()`` yields each document (``str``, or a 1-D integer array of token
    ids) in a fixed order; ``fingerprint()`` identifies the content for on-disk caches (``None``:
    do not cache); ``describe()`` says what was found (for errors about empty corpora)."""

    name: str = ""
    split: str = "all"
    val_fraction: float = 0.05

    def documents(self) -> Iterator[str | np.ndarray]:
        raise NotImplementedError

    def fingerprint(self) -> str | None:
        return None

    def describe(self) -> str:
        return self.name

    def _keep(self, key: str) -> bool:
        return self.split == "all" or split_of(key, self.val_fraction) == self.split

    def _split_documents(self, keyed_docs, is_empty):
        """The non-empty documents of ``keyed_docs`` (``(key, document)`` pairs, the key ``"<file>#<index>"``)
        that fall in this split; counts ``_seen`` (non-empty) and ``_kept`` (in the split) for `describe`."""
        for key, doc in keyed_docs:
            if is_empty(doc):
                continue
            self._seen += 1
            if self._keep(key):
                self._kept += 1
                yield doc

    def __iter__(self):
        return self.documents()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, split={self.split!r})"


def stat_fingerprint(parts: list[str], files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha1("\0".join(parts).encode())
    for rel, path in files:
        st = path.stat()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogatepass"))
    return h.hexdigest()
