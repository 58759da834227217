"""Local corpora: ``.txt`` / ``.jsonl`` / ``.parquet`` files and modded-nanogpt ``.bin`` shards,
each given as a file, a directory (searched recursively) or a glob."""

from __future__ import annotations

import glob as globlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from lengthgen.config import check_value, invalid
from lengthgen.data.text.corpus import Corpus, CorpusError, check_split_options, stat_fingerprint
from lengthgen.data.text.shards import read_bin_shard
from lengthgen.optional import require

TEXT_EXTENSIONS = (".txt", ".jsonl", ".parquet")
_GLOB_CHARS = ("*", "?", "[")


def _glob_base(pattern: str) -> Path:
    """The directory part of ``pattern`` before its first wildcard."""
    parts = Path(pattern).parts
    base = []
    for part in parts:
        if any(c in part for c in _GLOB_CHARS):
            break
        base.append(part)
    else:
        base = base[:-1]
    return Path(*base) if base else Path(".")


def resolve_files(source: str | os.PathLike | list, extensions: tuple[str, ...], what: str
                  ) -> list[tuple[str, Path]]:
    """Files named by ``source`` (a file, a directory searched recursively through linked folders, a glob, or a list of
    these) with one of ``extensions``, as ``(key, path)`` sorted by key, where key is the path
    relative to the directory or the glob's fixed prefix (a file a list names twice: once, keyed by its first
    source). Raises a clear error for missing paths,
    globs matching nothing and directories without a usable file."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise CorpusError(f"{what}: empty list of files")
        out: dict[Path, tuple[str, Path]] = {}     # a file named twice keeps the key of its first source
        for s in source:
            for key, path in resolve_files(s, extensions, what):
                out.setdefault(path.resolve(), (key, path))
        return sorted(out.values())
    src = os.path.expanduser(os.fspath(source))
    exts = "/".join(extensions)
    if any(c in src for c in _GLOB_CHARS) and not os.path.exists(src):
        matches = sorted(Path(m) for m in globlib.glob(src, recursive=True))
        files = [m for m in matches if m.is_file()]
        if not files:
            raise FileNotFoundError(f"{what}: no files match the pattern {src!r}")
        usable = [m for m in files if m.suffix.lower() in extensions]
        if not usable:
            found = sorted({m.suffix or "(no extension)" for m in files})
            raise CorpusError(f"{what}: the pattern {src!r} matches {len(files)} files but none is "
                              f"{exts} (found extensions {found})")
        base = _glob_base(src)
        return sorted((os.path.relpath(m, base).replace(os.sep, "/"), m) for m in usable)
    path = Path(src)
    if path.is_dir():
        found_exts: set[str] = set()
        out = []
        visited: set[str] = set()      # real folders walked: a linked folder is read once, a link cycle ends
        for d, dirs, files in os.walk(path, followlinks=True):
            if os.path.realpath(d) in visited:
                dirs[:] = []
                continue
            visited.add(os.path.realpath(d))
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
            for f in files:
                p = Path(d) / f
                if p.suffix.lower() in extensions:
                    out.append((p.relative_to(path).as_posix(), p))
                else:
                    found_exts.add(p.suffix or "(no extension)")
        if not out:
            raise CorpusError(f"{what}: directory {path} has no {exts} files (found "
                              f"{sorted(found_exts) or 'no files'})")
        return sorted(out)
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    if path.suffix.lower() not in extensions:
        raise CorpusError(f"{what}: {path} has unsupported extension {path.suffix or '(none)'!r}; "
                          f"expected {exts}")
    return [(path.name, path)]


def natural_key(name: str) -> tuple:
    """Sort key ordering the numbers in ``name`` by value (``train_2.bin`` before ``train_10.bin``); ties
    (``x_01``, ``x_1``) fall back to the name itself."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))], name


def _read_text(path: Path) -> str:
    """The file's text, strictly UTF-8, without a leading byte-order mark (U+FEFF, written by some editors)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise CorpusError(f"text file {path} is not valid UTF-8 (byte {e.start}: "
                          f"{data[e.start:e.start + 4]!r})") from None


class FileCorpus(Corpus):
    """Documents from local ``.txt``, ``.jsonl`` and ``.parquet`` files (see the module docstring).

    ``separator``: split each ``.txt`` file on this string (default: one document per file).
    ``text_field``: the JSON key / parquet column holding the text. Whitespace-only documents are
    skipped. ``val`` holds the documents whose ``"<relative path>#<index in file>"`` hashes below
    ``val_fraction``.
    """

    def __init__(self, source: str | os.PathLike | list, split: str = "all", *,
                 separator: str | None = None, text_field: str = "text",
                 val_fraction: float = 0.05):
        self.source = source
        self.split, self.val_fraction = check_split_options("FileCorpus", split, val_fraction)
        if check_value("FileCorpus.separator", separator, str | None) == "":
            raise invalid("FileCorpus.separator", separator, "a non-empty string, or none")
        self.separator = separator
        self.text_field = check_value("FileCorpus.text_field", text_field, str)
        self.files = resolve_files(source, TEXT_EXTENSIONS, f"corpus {source!r}")
        self.name = f"{os.fspath(source) if not isinstance(source, (list, tuple)) else 'files'}/{split}"
        parquet = [p for _, p in self.files if p.suffix.lower() == ".parquet"]
        if parquet:
            _import_pyarrow(parquet[0])
        self._seen = self._kept = 0

    def _file_documents(self, path: Path) -> Iterator[str]:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            text = _read_text(path)
            yield from ([text] if self.separator is None else text.split(self.separator))
        elif suffix == ".jsonl":
            yield from self._jsonl(path)
        elif suffix == ".parquet":
            yield from self._parquet(path)

    def _jsonl(self, path: Path) -> Iterator[str]:
        """One JSON object per line; lines end at \\n only (JSON Lines): U+2028, U+2029 and U+0085, which
        ``str.splitlines`` also breaks at, may stand raw inside a JSON string."""
        for lineno, line in enumerate(_read_text(path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") \
                    from None
            if not isinstance(obj, dict) or self.text_field not in obj:
                keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
                raise CorpusError(f"{path}:{lineno}: no {self.text_field!r} field (found {keys}); "
                                  f"set text_field= to the key holding the text")
            text = obj[self.text_field]
            if not isinstance(text, str):
                raise CorpusError(f"{path}:{lineno}: field {self.text_field!r} is a "
                                  f"{type(text).__name__}, expected a string")
            yield text

    def _parquet(self, path: Path) -> Iterator[str]:
        _, pq = _import_pyarrow(path)
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:   # noqa: BLE001  (pyarrow raises ArrowInvalid & co.)
            raise CorpusError(f"parquet file {path} could not be read: {type(e).__name__}: {e}") \
                from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise CorpusError(f"parquet file {path} has no column {self.text_field!r} (columns: "
                              f"{names}); set text_field= to the column holding the text")
        for batch in pf.iter_batches(columns=[self.text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise CorpusError(f"parquet file {path}: column {self.text_field!r} holds "
                                      f"{type(text).__name__} values, expected strings")
                yield text or ""

    def documents(self) -> Iterator[str]:
        self._seen = self._kept = 0
        for key, path in self.files:
            docs = ((f"{key}#{i}", doc) for i, doc in enumerate(self._file_documents(path)))
            yield from self._split_documents(docs, lambda doc: not doc.strip())

    def fingerprint(self) -> str:
        parts = ["files", self.split, repr(self.val_fraction), repr(self.separator), self.text_field]
        return stat_fingerprint(parts, self.files)

    def describe(self) -> str:
        return (f"corpus {self.source!r}: {len(self.files)} files, {self._seen} non-empty documents, "
                f"{self._kept} of them in split {self.split!r}")


def _import_pyarrow(path: Path):
    needed_for, install = f"reading the parquet file {path}", "pyarrow (or pip install 'lengthgen[data]')"
    return require("pyarrow", needed_for, install), require("pyarrow.parquet", needed_for, install)


# --------------------------------------------------------------------------------------------------
# modded-nanogpt token shards


class BinCorpus(Corpus):
    """Documents from modded-nanogpt ``.bin`` shards (a file, directory or glob), split at ``bos_id``.

    modded-nanogpt's ``fineweb.py`` writes one token stream, a BOS before every document, cut into
    fixed-size shards, so a document may run on from one shard into the next. The shards (numbers in their
    names ordered by value, `natural_key`: ``train_2.bin`` before ``train_10.bin``) are read as that one
    stream, one shard at a time: each document is the tokens after one BOS up to the next, across shard
    boundaries, keyed for the split by the shard and index of its BOS
    (``<shard>#<i>``). Tokens before the first shard's first BOS form a document too (keyed
    ``<shard>#0``): the tail of a document begun in a shard not given, e.g. by a glob from
    ``fineweb_train_000005.bin`` on. ``bos_id=None``: each shard is one document. ``vocab_size``: if
    given, a shard holding a larger id raises an error naming the shard (wrong tokenizer)."""

    def __init__(self, source: str | os.PathLike | list, split: str = "all", *,
                 bos_id: int | None = None, vocab_size: int | None = None,
                 val_fraction: float = 0.05, tokenizer_name: str = ""):
        self.source = source
        self.split, self.val_fraction = check_split_options("BinCorpus", split, val_fraction)
        self.bos_id, self.vocab_size, self.tokenizer_name = bos_id, vocab_size, tokenizer_name
        self.files = sorted(resolve_files(source, (".bin",), f"bin corpus {source!r}"),
                            key=lambda kp: natural_key(kp[0]))
        self.name = f"bin:{os.fspath(source) if not isinstance(source, (list, tuple)) else 'files'}/{split}"
        self._tokens = self._seen = self._kept = 0

    def _read(self, path: Path) -> np.ndarray:
        tokens = read_bin_shard(path)
        self._tokens += tokens.size
        if self.vocab_size is not None and tokens.size and int(tokens.max()) >= self.vocab_size:
            raise CorpusError(f"token shard {path} holds token id {int(tokens.max())}, outside the "
                              f"vocabulary ({self.vocab_size} ids) of tokenizer "
                              f"{self.tokenizer_name!r}; was it written with another tokenizer?")
        return tokens

    def _keyed_documents(self) -> Iterator[tuple[str, np.ndarray]]:
        if self.bos_id is None:
            yield from ((f"{key}#0", self._read(path)) for key, path in self.files)
            return
        key, pieces = f"{self.files[0][0]}#0", []   # the document not yet ended by a BOS
        for shard, path in self.files:
            tokens = self._read(path)
            cuts = np.flatnonzero(tokens == self.bos_id)
            pieces.append(tokens[:cuts[0] if cuts.size else tokens.size])
            for i, (a, b) in enumerate(zip(cuts, list(cuts[1:]) + [tokens.size]), 1):
                yield key, np.concatenate(pieces)
                key, pieces = f"{shard}#{i}", [tokens[a + 1:b]]
        yield key, np.concatenate(pieces)

    def documents(self) -> Iterator[np.ndarray]:
        self._tokens = self._seen = self._kept = 0
        yield from self._split_documents(self._keyed_documents(), lambda doc: doc.size == 0)

    def fingerprint(self) -> str:
        # "stream": documents split over the shards' joined stream (older caches split each shard alone)
        parts = ["bin", "stream", self.split, repr(self.val_fraction), repr(self.bos_id)]
        return stat_fingerprint(parts, self.files)

    def describe(self) -> str:
        return (f"bin corpus {self.source!r}: {len(self.files)} shards, {self._tokens} tokens, "
                f"{self._seen} non-empty documents, {self._kept} of them in split {self.split!r}")
