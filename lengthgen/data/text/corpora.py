"""Corpora: deterministic iterators over documents (strings, or token arrays for ``.bin`` shards).

* ``StdlibCorpus``: the running Python's standard-library ``*.py`` files, one document per file. It
  ships with every Python, so it is the default corpus and needs no download.
* ``FileCorpus``: local ``.txt`` (one document per file, or split on ``separator``), ``.jsonl`` (one
  JSON object per line, text in ``text_field``) and ``.parquet`` (column ``text_field``, needs
  pyarrow) files, given as a file, a directory (searched recursively) or a glob.
* ``BinCorpus``: modded-nanogpt ``.bin`` token shards, split into documents at the BOS token.
* ``HFCorpus``: a Hugging Face ``datasets`` dataset, streamed (optional dependency; needs network
  unless the dataset is in the local HF cache).

Every corpus takes ``split`` in ``train | val | all``. Local corpora split by a stable hash of a
document key (the relative path, plus the document's index inside its file where a file holds
several), so the split never depends on the machine, the file order or the random seed.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np

from lengthgen.data.text.shards import read_bin_shard

SPLITS = ("train", "val", "all")
TEXT_EXTENSIONS = (".txt", ".jsonl", ".parquet")
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class CorpusError(ValueError):
    """A corpus is empty, or one of its files is malformed (the message names the file)."""


def check_split(split: str, where: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split


def check_val_fraction(val_fraction: float, where: str) -> float:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or \
            not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"{where}: val_fraction must be a number in [0, 1], got {val_fraction!r}")
    return float(val_fraction)


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

    def __iter__(self):
        return self.documents()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, split={self.split!r})"


def _stat_fingerprint(parts: list[str], files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha1("\0".join(parts).encode())
    for rel, path in files:
        st = path.stat()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# The Python standard library


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None, *, include_tests: bool = False
                 ) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every ``*.py`` under the standard library, sorted by the
    relative path; ``site-packages``/``__pycache__`` are skipped, and test directories (``test``,
    ``tests``, ``idle_test``) unless ``include_tests``."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib corpus: the standard-library directory {root} does not exist")
    skip = STDLIB_EXCLUDED_DIRS if include_tests else STDLIB_EXCLUDED_DIRS | STDLIB_TEST_DIRS
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        for f in files:
            if f.endswith(".py"):
                p = Path(d) / f
                out.append((p.relative_to(root).as_posix(), p))
    out.sort()
    return out


class StdlibCorpus(Corpus):
    """The running Python's standard-library source, one document per ``*.py`` file (empty files
    skipped), in sorted path order; ``val`` is the ~``val_fraction`` of files whose relative-path
    sha1 falls below it. Files are decoded as UTF-8 with ``errors="replace"``."""

    def __init__(self, split: str = "train", *, val_fraction: float = 0.05,
                 include_tests: bool = False, root: str | os.PathLike | None = None):
        self.split = check_split(split, "stdlib corpus")
        self.val_fraction = check_val_fraction(val_fraction, "stdlib corpus")
        self.include_tests = bool(include_tests)
        self.root = Path(root) if root is not None else stdlib_root()
        self.name = f"stdlib{'+tests' if include_tests else ''}/{split}"

    def files(self) -> list[tuple[str, Path]]:
        """The files of this split."""
        return [(rel, p) for rel, p in stdlib_files(self.root, include_tests=self.include_tests)
                if self._keep(rel)]

    def documents(self) -> Iterator[str]:
        for _, path in self.files():
            text = path.read_bytes().decode("utf-8", errors="replace")
            if text.strip():
                yield text

    def fingerprint(self) -> str:
        parts = ["stdlib", sys.version, str(self.root), self.split, repr(self.val_fraction),
                 str(self.include_tests)]
        return _stat_fingerprint(parts, self.files())

    def describe(self) -> str:
        return (f"stdlib corpus at {self.root} (split {self.split!r}, include_tests="
                f"{self.include_tests}): {len(self.files())} *.py files in the split")


# --------------------------------------------------------------------------------------------------
# Local files

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
    """Files named by ``source`` (a file, a directory searched recursively, a glob, or a list of
    these) with one of ``extensions``, as ``(key, path)`` sorted by key, where key is the path
    relative to the directory or the glob's fixed prefix. Raises a clear error for missing paths,
    globs matching nothing and directories without a usable file."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise CorpusError(f"{what}: empty list of files")
        out = []
        for s in source:
            out.extend(resolve_files(s, extensions, what))
        return sorted(set(out))
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
        for d, dirs, files in os.walk(path):
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


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
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
        self.split = check_split(split, f"corpus {source!r}")
        self.val_fraction = check_val_fraction(val_fraction, f"corpus {source!r}")
        if separator is not None and (not isinstance(separator, str) or not separator):
            raise ValueError(f"corpus {source!r}: separator must be a non-empty string or None, got "
                             f"{separator!r}")
        self.separator = separator
        self.text_field = text_field
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
        for lineno, line in enumerate(_read_text(path).splitlines(), 1):
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
            for i, doc in enumerate(self._file_documents(path)):
                if not doc.strip():
                    continue
                self._seen += 1
                if self._keep(f"{key}#{i}"):
                    self._kept += 1
                    yield doc

    def fingerprint(self) -> str:
        parts = ["files", self.split, repr(self.val_fraction), repr(self.separator), self.text_field]
        return _stat_fingerprint(parts, self.files)

    def describe(self) -> str:
        return (f"corpus {self.source!r}: {len(self.files)} files, {self._seen} non-empty documents, "
                f"{self._kept} of them in split {self.split!r}")


def _import_pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading the parquet file {path} needs the 'pyarrow' package, which is not "
                          f"installed: pip install pyarrow (or pip install 'lengthgen[data]')") from e
    return pyarrow, pq


# --------------------------------------------------------------------------------------------------
# modded-nanogpt token shards


class BinCorpus(Corpus):
    """Documents from modded-nanogpt ``.bin`` shards (a file, directory or glob), split at
    ``bos_id`` (each document is the tokens after one BOS up to the next; tokens before the first
    BOS form a document too). ``bos_id=None``: each shard is one document. ``vocab_size``: if given,
    a shard holding a larger id raises an error naming the shard (wrong tokenizer)."""

    def __init__(self, source: str | os.PathLike | list, split: str = "all", *,
                 bos_id: int | None = None, vocab_size: int | None = None,
                 val_fraction: float = 0.05, tokenizer_name: str = ""):
        self.source = source
        self.split = check_split(split, f"bin corpus {source!r}")
        self.val_fraction = check_val_fraction(val_fraction, f"bin corpus {source!r}")
        self.bos_id, self.vocab_size, self.tokenizer_name = bos_id, vocab_size, tokenizer_name
        self.files = resolve_files(source, (".bin",), f"bin corpus {source!r}")
        self.name = f"bin:{os.fspath(source) if not isinstance(source, (list, tuple)) else 'files'}/{split}"
        self._tokens = self._seen = self._kept = 0

    def documents(self) -> Iterator[np.ndarray]:
        self._tokens = self._seen = self._kept = 0
        for key, path in self.files:
            tokens = read_bin_shard(path)
            self._tokens += tokens.size
            if self.vocab_size is not None and tokens.size and int(tokens.max()) >= self.vocab_size:
                raise CorpusError(f"token shard {path} holds token id {int(tokens.max())}, outside the "
                                  f"vocabulary ({self.vocab_size} ids) of tokenizer "
                                  f"{self.tokenizer_name!r}; was it written with another tokenizer?")
            if self.bos_id is None:
                docs = [tokens]
            else:
                cuts = np.flatnonzero(tokens == self.bos_id)
                docs = [tokens[:cuts[0]] if cuts.size else tokens]
                docs += [tokens[a + 1:b] for a, b in zip(cuts, list(cuts[1:]) + [tokens.size])]
            for i, doc in enumerate(docs):
                if doc.size == 0:
                    continue
                self._seen += 1
                if self._keep(f"{key}#{i}"):
                    self._kept += 1
                    yield doc

    def fingerprint(self) -> str:
        parts = ["bin", self.split, repr(self.val_fraction), repr(self.bos_id)]
        return _stat_fingerprint(parts, self.files)

    def describe(self) -> str:
        return (f"bin corpus {self.source!r}: {len(self.files)} shards, {self._tokens} tokens, "
                f"{self._seen} non-empty documents, {self._kept} of them in split {self.split!r}")


# --------------------------------------------------------------------------------------------------
# Hugging Face datasets (optional)


class HFCorpus(Corpus):
    """A Hugging Face ``datasets`` dataset read with ``load_dataset(dataset, config, split=hf_split,
    streaming=streaming)``; documents are ``example[text_field]``. ``hf_split`` defaults to
    ``train`` for split ``train``/``all`` and ``validation`` for ``val``. Streams are long: bound
    them with ``max_documents`` / ``max_tokens`` when tokenizing. Contacts the Hub unless the
    dataset is in the local HF cache (``HF_DATASETS_OFFLINE=1`` to forbid)."""

    def __init__(self, dataset: str, config: str | None = None, split: str = "train", *,
                 text_field: str = "text", hf_split: str | None = None, streaming: bool = True):
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise ImportError(f"corpus 'hf:{dataset}' needs the Hugging Face 'datasets' package, which "
                              f"is not installed: pip install datasets (or pip install "
                              f"'lengthgen[data]')") from e
        if not dataset:
            raise ValueError("hf corpus: empty dataset name; use 'hf:<dataset>[:config]'")
        self.dataset, self.config = dataset, config
        self.split = check_split(split, f"corpus 'hf:{dataset}'")
        self.hf_split = hf_split or {"train": "train", "val": "validation", "all": "train"}[split]
        self.text_field, self.streaming = text_field, streaming
        self.name = f"hf:{dataset}{':' + config if config else ''}/{self.hf_split}"
        self._seen = 0

    def documents(self) -> Iterator[str]:
        import datasets
        ds = datasets.load_dataset(self.dataset, self.config, split=self.hf_split,
                                   streaming=self.streaming)
        self._seen = 0
        for i, example in enumerate(ds):
            if self.text_field not in example:
                raise CorpusError(f"{self.name}: example {i} has no {self.text_field!r} field "
                                  f"(found {sorted(example)[:10]}); set text_field=")
            text = example[self.text_field]
            if isinstance(text, str) and text.strip():
                self._seen += 1
                yield text

    def describe(self) -> str:
        return f"corpus {self.name}: {self._seen} non-empty documents"


# --------------------------------------------------------------------------------------------------

CORPUS_FORMS = ("stdlib", "a .txt/.jsonl/.parquet file, directory or glob", "bin:<file, dir or glob>",
                "hf:<dataset>[:config]")

_OPTIONS = {
    "stdlib": {"val_fraction", "include_tests", "root"},
    "files": {"val_fraction", "separator", "text_field"},
    "bin": {"val_fraction"},
    "hf": {"text_field", "hf_split", "streaming"},
}


def _check_options(kind: str, spec: str, options: dict) -> None:
    bad = sorted(set(options) - _OPTIONS[kind])
    if bad:
        raise ValueError(f"corpus {spec!r}: unknown option(s) {bad}; a {kind} corpus takes "
                         f"{sorted(_OPTIONS[kind])}")


def _looks_like_path(spec: str) -> bool:
    return (os.path.exists(os.path.expanduser(spec)) or any(c in spec for c in _GLOB_CHARS)
            or "/" in spec or os.sep in spec or spec.startswith(("~", "."))
            or spec.lower().endswith(TEXT_EXTENSIONS))


def make_corpus(spec: str | os.PathLike | Corpus, split: str = "train", *, tokenizer=None,
                **options) -> Corpus:
    """A corpus from its spec: ``"stdlib"``, a file/directory/glob path, ``"bin:<glob>"`` or
    ``"hf:<dataset>[:config]"``. ``tokenizer`` gives ``bin:`` corpora their BOS id and vocabulary
    size. A ``Corpus`` is returned as is (``split`` and ``options`` are then ignored)."""
    if isinstance(spec, Corpus):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"corpus must be a non-empty string or a Corpus, got {spec!r}; valid forms: "
                         f"{'; '.join(CORPUS_FORMS)}")
    if spec == "stdlib":
        _check_options("stdlib", spec, options)
        return StdlibCorpus(split, **options)
    if spec.startswith("bin:"):
        _check_options("bin", spec, options)
        if not spec[4:]:
            raise ValueError("corpus 'bin:' needs a file, directory or glob, e.g. 'bin:data/*.bin'")
        return BinCorpus(spec[4:], split, bos_id=getattr(tokenizer, "bos_id", None),
                         vocab_size=getattr(tokenizer, "vocab_size", None),
                         tokenizer_name=getattr(tokenizer, "name", ""), **options)
    if spec.startswith("hf:"):
        _check_options("hf", spec, options)
        name, _, config = spec[3:].partition(":")
        if not name:
            raise ValueError("corpus 'hf:' needs a dataset name: 'hf:<dataset>[:config]'")
        return HFCorpus(name, config or None, split, **options)
    if _looks_like_path(spec):
        _check_options("files", spec, options)
        return FileCorpus(spec, split, **options)
    raise ValueError(f"unknown corpus {spec!r}: not 'stdlib', not an existing path and no known prefix; "
                     f"valid forms: {'; '.join(CORPUS_FORMS)}")
