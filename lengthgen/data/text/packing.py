"""Pre-tokenized token streams, packed language-modelling batches and long-document evaluation rows.

A corpus is tokenized once into a ``TokenStream``: one flat token array holding every document with
BOS in front, plus the offsets of those BOS tokens. ``TextData`` samples fixed-length rows from it
(the stream is read cyclically, so any length works) and returns the same ``Batch`` as the synthetic
tasks, with ``doc_ids`` for document masking.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from lengthgen.atomic import atomic_write
from lengthgen.config import ConfigWarning, check_value, counted
from lengthgen.data.tasks.base import Batch, Task, check_generator
from lengthgen.data.text.corpora import Corpus, CorpusError, make_corpus
from lengthgen.data.text.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

CACHE_FORMAT = 1


@dataclass
class TokenStream:
    """``tokens``: (N,) uint16 (int32 for vocabularies over 65536 ids), every document preceded by
    ``bos_id``. ``starts``: (D,) int64, the offset of each document's BOS (``starts[0] == 0``)."""

    tokens: np.ndarray
    starts: np.ndarray
    vocab_size: int
    bos_id: int
    name: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def num_documents(self) -> int:
        return int(self.starts.size)

    @property
    def doc_lengths(self) -> np.ndarray:
        """(D,) tokens per document, not counting its BOS."""
        return np.diff(np.append(self.starts, self.tokens.size)) - 1

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens without its BOS."""
        end = self.starts[i + 1] if i + 1 < self.starts.size else self.tokens.size
        return self.tokens[self.starts[i] + 1:end]

    def save(self, path: str | os.PathLike) -> None:
        """Write to ``path`` (``.npz``) atomically: a temporary file in the same directory, renamed."""
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, tokens=self.tokens, starts=self.starts,
                         meta=np.array(json.dumps({"vocab_size": self.vocab_size, "bos_id": self.bos_id,
                                                   "name": self.name, "format": CACHE_FORMAT})))

        atomic_write(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TokenStream":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(f"token cache {path} has format {meta.get('format')}, expected "
                                 f"{CACHE_FORMAT}")
            return cls(z["tokens"], z["starts"], meta["vocab_size"], meta["bos_id"], meta["name"])


def default_cache_dir() -> Path:
    """``$LENGTHGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/lengthgen``, else ``~/.cache/lengthgen``."""
    if os.environ.get("LENGTHGEN_CACHE_DIR"):
        return Path(os.environ["LENGTHGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lengthgen"


def _cache_path(corpus: Corpus, tokenizer: Tokenizer, cache_dir, max_documents, max_tokens
                ) -> Path | None:
    fingerprint = corpus.fingerprint()
    if fingerprint is None:
        return None
    key = json.dumps([CACHE_FORMAT, sys.version, corpus.name, fingerprint, tokenizer.cache_key,
                      max_documents, max_tokens])
    digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in
                   f"{corpus.name}-{tokenizer.name}")[-80:]
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return Path(cache_dir or default_cache_dir()) / f"{stem}-{py}-{digest}.npz"


def pretokenize(corpus: Corpus, tokenizer: Tokenizer, *, max_documents: int | None = None,
                max_tokens: int | None = None, cache: bool | str = "auto",
                cache_dir: str | os.PathLike | None = None, batch_docs: int = 256) -> TokenStream:
    """Tokenize ``corpus`` into a ``TokenStream`` (documents in corpus order, BOS before each).

    ``max_documents`` / ``max_tokens``: stop after that many documents / once the stream holds at
    least that many tokens. ``cache``: ``True`` reads and writes ``<cache_dir>/<name>.npz`` keyed by
    the Python version, corpus fingerprint and tokenizer; ``"auto"`` caches for every tokenizer but
    the byte one (which is faster than the cache); ``False`` never caches. Corpora without a
    fingerprint (streamed) are never cached. Raises ``CorpusError`` for an empty corpus, or a document holding
    an id outside the vocabulary or the BOS id."""
    check_value("pretokenize.cache", cache, Literal[True, False, "auto"])
    use_cache = cache is True or (cache == "auto" and not isinstance(tokenizer, ByteTokenizer))
    path = _cache_path(corpus, tokenizer, cache_dir, max_documents, max_tokens) if use_cache else None
    if path is not None and path.is_file():
        try:
            cached = TokenStream.load(path)
        except Exception:   # noqa: BLE001  (a corrupt or foreign cache file: rebuild it)
            cached = None
        # one written before a BOS id inside a document was refused: rebuild it (which raises)
        if cached is not None and np.count_nonzero(cached.tokens == cached.bos_id) == cached.num_documents:
            return cached

    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    bos = np.array([tokenizer.bos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    total = 0
    pending: list[str] = []

    def add(doc: np.ndarray) -> None:
        nonlocal total
        if doc.size and (int(doc.max()) >= tokenizer.vocab_size or int(doc.min()) < 0):
            raise CorpusError(f"corpus {corpus.name}: document {len(lengths)} holds token ids outside "
                              f"[0, {tokenizer.vocab_size}) of tokenizer {tokenizer.name!r}")
        if doc.size and (doc == tokenizer.bos_id).any():     # a BOS mid-document: doc_ids would not count it
            raise CorpusError(f"corpus {corpus.name}: document {len(lengths)} encodes to the BOS id "
                              f"{tokenizer.bos_id} of tokenizer {tokenizer.name!r} inside its text; remove that "
                              "text from the corpus or choose a BOS no text encodes to (HFTokenizer(path, "
                              "bos_token=...))")
        pieces.append(bos)
        pieces.append(doc.astype(dtype, copy=False))
        lengths.append(doc.size + 1)
        total += doc.size + 1

    def done() -> bool:
        return ((max_documents is not None and len(lengths) >= max_documents)
                or (max_tokens is not None and total >= max_tokens))

    def flush() -> None:
        for doc in tokenizer.encode_batch(pending):
            if done():
                break
            add(doc)
        pending.clear()

    for doc in corpus.documents():
        if done():
            break
        if isinstance(doc, str):
            if isinstance(tokenizer, ByteTokenizer):
                add(tokenizer.encode_array(doc))
            else:
                pending.append(doc)
                if len(pending) >= batch_docs:
                    flush()
        else:
            flush()
            add(np.asarray(doc))
    flush()
    if not lengths:
        raise CorpusError(f"corpus {corpus.name} has no documents: {corpus.describe()}")
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    stream = TokenStream(np.concatenate(pieces), starts, tokenizer.vocab_size, tokenizer.bos_id,
                         f"{corpus.name}:{tokenizer.name}")
    if path is not None:
        try:
            stream.save(path)
        except OSError:
            pass   # an unwritable cache directory only costs the next run the tokenization
    return stream


def long_document_rows(stream: TokenStream, min_length: int, count: int, seed: int = 0,
                       *, row_length: int | None = None) -> torch.Tensor:
    """(count, row_length) long: ``[BOS] + the start of one document`` per row, from ``count``
    distinct documents with at least ``min_length`` tokens chosen by a permutation seeded with
    ``seed``. ``row_length`` defaults to ``min_length`` and may be at most ``min_length + 1``."""
    check_value("long_documents.min_length", min_length, int, ge=1)
    check_value("long_documents.count", count, int, ge=1)
    row_length = min_length if row_length is None else row_length
    check_value("long_documents.row_length", row_length, int, ge=1, le=min_length + 1)
    lengths = stream.doc_lengths
    eligible = np.flatnonzero(lengths >= min_length)
    if eligible.size < count:
        longest = int(lengths.max()) if lengths.size else 0
        raise CorpusError(
            f"long_documents: need {count} documents of at least {min_length} tokens from "
            f"{stream.name}, found {eligible.size} (of {lengths.size} documents; the longest has "
            f"{longest} tokens). Use a shorter length, fewer documents, or a larger corpus/split.")
    g = torch.Generator().manual_seed(int(seed))
    chosen = eligible[torch.randperm(eligible.size, generator=g)[:count].numpy()]
    idx = stream.starts[chosen][:, None] + np.arange(row_length)[None, :]
    return torch.from_numpy(stream.tokens[idx].astype(np.int64))


class TextData(Task):
    """Language modelling on a pre-tokenized corpus, with the synthetic tasks' interface.

    ``sample(batch_size, length, generator)`` draws each row's start uniformly over the stream's
    tokens (``bos_aligned``: then moves it back to the BOS of the document it falls in, so each row
    starts a document, documents are drawn in proportion to their length plus one (their BOS), and a document's
    tokens past the first ``length`` are never read, as under modded-nanogpt's ``align_to_bos``) and reads
    ``length + 1`` tokens cyclically (with a warning where that is more than the whole stream, whose text then
    repeats within a row): ``tokens`` the first ``length``, ``targets`` the last ``length``. ``doc_ids`` number the
    documents of a row from 0 and increase by one exactly at each BOS; ``loss_mask`` is
    all True (a target that is the next document's BOS is the end-of-document prediction).
    """

    head = "lm"
    metric = "loss"
    higher_is_better = False
    max_length = None
    min_length = 1

    def __init__(self, stream: TokenStream, tokenizer: Tokenizer | None = None, *,
                 bos_aligned: bool = False, name: str | None = None):
        if stream.num_tokens < 2:
            raise CorpusError(f"TextData: the token stream {stream.name} has {stream.num_tokens} "
                              f"tokens; at least 2 are needed")
        self.stream = stream
        self.tokenizer = tokenizer
        self.vocab_size = stream.vocab_size
        self.bos_id = stream.bos_id
        self.bos_aligned = check_value("TextData.bos_aligned", bos_aligned, bool)
        self.name = name or f"text:{stream.name}"
        is_start = np.zeros(stream.num_tokens, dtype=bool)
        is_start[stream.starts] = True
        self._is_start = is_start
        self._digest: str | None = None

    def __repr__(self) -> str:
        return (f"TextData({self.name!r}, documents={self.stream.num_documents}, "
                f"tokens={self.stream.num_tokens}, bos_aligned={self.bos_aligned})")

    def digest(self) -> str:
        """The token stream's size, vocabulary, document starts and every k-th token (k = max(1, tokens >> 24): at
        most 2**25 of them), hashed (blake2b): another corpus, or the same files edited, give another digest; a
        copy gives the same."""
        if self._digest is None:
            s = self.stream
            h = hashlib.blake2b(f"{s.num_tokens} {s.num_documents} {s.vocab_size} {s.bos_id}".encode(),
                                digest_size=16)
            h.update(np.ascontiguousarray(s.starts[::max(1, s.num_documents >> 20)]).tobytes())
            h.update(np.ascontiguousarray(s.tokens[::max(1, s.num_tokens >> 24)]).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def _rows(self, starts: np.ndarray, width: int) -> np.ndarray:
        return (starts[:, None] + np.arange(width)[None, :]) % self.stream.num_tokens

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_value("TextData.batch_size", batch_size, int, ge=1)
        check_value("TextData.length", length, int, ge=1)
        check_generator("TextData.generator", generator)
        n = self.stream.num_tokens
        if length + 1 > n:
            warnings.warn(f"{self.name}: rows of {length} tokens hold more than all {n} tokens of the text: it repeats "
                          "within each row, where a model can copy it", ConfigWarning, stacklevel=2)
        pos = torch.randint(n, (batch_size,), generator=generator, device=generator.device)
        pos = pos.cpu().numpy().astype(np.int64)
        if self.bos_aligned:
            pos = self.stream.starts[np.searchsorted(self.stream.starts, pos, side="right") - 1]
        idx = self._rows(pos, length + 1)
        window = torch.from_numpy(self.stream.tokens[idx].astype(np.int64))
        doc_ids = torch.from_numpy(np.cumsum(self._is_start[idx[:, :length]], axis=1, dtype=np.int64))
        doc_ids -= doc_ids[:, :1].clone()
        device = generator.device
        return Batch(window[:, :length].contiguous().to(device), window[:, 1:].contiguous().to(device),
                     torch.ones(batch_size, length, dtype=torch.bool, device=device), doc_ids.to(device))

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``loss``: (B, L) per-position cross-entropy in nats, NaN outside ``loss_mask``."""
        b, l, v = output.shape
        loss = F.cross_entropy(output.float().reshape(b * l, v), batch.targets.reshape(b * l),
                               reduction="none").view(b, l)
        return {"loss": torch.where(batch.loss_mask, loss, torch.full_like(loss, float("nan")))}

    def plain_tokens(self, start: int, count: int) -> np.ndarray:
        """(count,) int64: the documents' tokens back to back without their BOS, read cyclically from stream
        position ``start`` (the filler of text needles)."""
        if self.stream.num_tokens <= self.stream.num_documents:
            raise CorpusError(f"{self.name}: its documents are empty; no text to read")
        width, n = count, self.stream.num_tokens
        while True:
            index = (start + np.arange(width)) % n
            index = index[~self._is_start[index]]
            if index.size >= count:
                return self.stream.tokens[index[:count]].astype(np.int64)
            width += count - index.size

    def long_documents(self, min_length: int, count: int, seed: int = 0) -> torch.Tensor:
        """See ``long_documents``: (count, min_length) rows, each the start of one long document."""
        return long_document_rows(self.stream, min_length, count, seed)

    def long_batch(self, length: int, count: int, seed: int = 0) -> Batch:
        """A ``Batch`` of ``count`` rows, each ``[BOS] + the first length tokens`` of one document of
        at least ``length`` tokens (no packing): ``tokens`` (count, length), ``targets`` the next
        tokens (all inside the document), ``doc_ids`` zero."""
        rows = long_document_rows(self.stream, length, count, seed, row_length=length + 1)
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(),
                     torch.ones(count, length, dtype=torch.bool),
                     torch.zeros(count, length, dtype=torch.long))


def long_documents(corpus: Corpus | str | TokenStream | TextData = "stdlib",
                   tokenizer: Tokenizer | str = "byte", min_length: int = 1024, count: int = 8,
                   seed: int = 0, *, split: str = "val", **options) -> torch.Tensor:
    """(count, min_length) long tokens for long-context evaluation: each row is BOS followed by the
    first ``min_length - 1`` tokens of one document with at least ``min_length`` tokens (no
    packing), from ``count`` distinct documents picked by a permutation seeded with ``seed``.

    ``corpus``: a ``Corpus``, a corpus spec (see ``make_corpus``; ``split`` and ``options`` apply),
    a ``TokenStream`` or a ``TextData``. Raises ``CorpusError`` naming the length, how many documents
    were needed and found, and the longest one, when too few are long enough."""
    if isinstance(corpus, TextData):
        stream = corpus.stream
    elif isinstance(corpus, TokenStream):
        stream = corpus
    else:
        tok = make_tokenizer(tokenizer)
        stream_opts = {k: options.pop(k) for k in ("cache", "cache_dir", "max_documents", "max_tokens")
                       if k in options}
        stream = pretokenize(make_corpus(corpus, split, tokenizer=tok, **options), tok, **stream_opts)
    return long_document_rows(stream, min_length, count, seed)


def _local_files(corpus: Corpus) -> set[Path]:
    """The resolved paths of the files a local corpus reads (none for a streamed one)."""
    files = getattr(corpus, "files", ())
    return {path.resolve() for _, path in (files() if callable(files) else files)}


def make_text_data(corpus: str | Corpus = "stdlib", tokenizer: str | Tokenizer = "byte",
                   split: str = "train", *, val_corpus: str | None = None, bos_aligned: bool = False,
                   cache: bool | str = "auto", cache_dir: str | os.PathLike | None = None,
                   max_documents: int | None = None, max_tokens: int | None = None, verbose: bool = False,
                   **options) -> TextData:
    """A ``TextData`` from a corpus spec and a tokenizer name.

    ``corpus``: ``"stdlib"`` (default; options ``val_fraction``, ``include_tests``, ``root``), a
    ``.txt``/``.jsonl``/``.parquet`` file, directory or glob (``separator``, ``text_field``,
    ``val_fraction``), ``"bin:<glob>"`` (``val_fraction``; usually ``split="all"``) or
    ``"hf:<dataset>[:config]"`` (``text_field``, ``hf_split``, ``streaming``, ``val_fraction``; needs
    ``max_documents`` or ``max_tokens``). ``tokenizer``: see ``make_tokenizer``. ``split``:
    ``train | val | all``. ``val_corpus``: a validation corpus of its own (modded-nanogpt's
    ``bin:fineweb_val_*.bin``; not ``hf:``): the val split is all of it, the train split all of ``corpus``; a file
    both name is a ValueError (the run would train on its validation text). ``cache`` /
    ``cache_dir`` / ``max_documents`` / ``max_tokens``: see ``pretokenize``."""
    if val_corpus is not None:
        check_value("make_text_data.val_corpus", val_corpus, str)
        if split == "all":
            raise ValueError("make_text_data: split='all' never reads val_corpus (it is the val split); use "
                             "split='train'")
        check_value("make_text_data.split", split, Literal["train", "val"])
        if val_corpus.startswith("hf:"):
            raise ValueError(f"val_corpus {val_corpus!r}: a Hugging Face dataset has its own validation split "
                             "(hf_split); leave val_corpus unset")
        unread = corpus if split == "val" else val_corpus     # the other side of the split, checked apart below
        corpus, split = (val_corpus, "all") if split == "val" else (corpus, "all")
    check_value("make_text_data.bos_aligned", bos_aligned, bool)     # before the corpus is read
    max_documents = check_value("make_text_data.max_documents", max_documents, int | None, ge=1)
    max_tokens = check_value("make_text_data.max_tokens", max_tokens, int | None, ge=1)
    check_value("make_text_data.verbose", verbose, bool)
    check_value("make_text_data.cache_dir", os.fspath(cache_dir) if isinstance(cache_dir, os.PathLike) else cache_dir,
                str | None)
    tok = make_tokenizer(tokenizer)
    if isinstance(corpus, str) and corpus.startswith("hf:") and max_documents is None \
            and max_tokens is None:
        raise ValueError(f"corpus {corpus!r} is streamed: pass max_documents= or max_tokens= to bound "
                         f"how much of it is tokenized")
    keys = tuple(name for name in inspect.signature(make_text_data).parameters if name != "options")
    c = make_corpus(corpus, split, tokenizer=tok, keys=keys, **options)
    if val_corpus is not None:
        try:
            other = make_corpus(unread, "all", tokenizer=tok, keys=keys, **options)
        except (ValueError, FileNotFoundError):
            other = None        # an error of its own, raised where that side is read
        shared = sorted(_local_files(c) & _local_files(other)) if other is not None else []
        if shared:
            training = unread if corpus == val_corpus else corpus
            raise ValueError(f"val_corpus {val_corpus!r} shares {counted(len(shared), 'file')} "
                             f"with corpus {training!r} (e.g. {shared[0]}): the run would train on its validation "
                             "text; name the training files apart (a glob)")
    t0 = time.perf_counter()
    stream = pretokenize(c, tok, max_documents=max_documents, max_tokens=max_tokens, cache=cache,
                         cache_dir=cache_dir)
    if verbose:
        print(f"[text] {stream.name}: {stream.num_documents} documents, {stream.num_tokens} tokens "
              f"in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return TextData(stream, tok, bos_aligned=bos_aligned)
