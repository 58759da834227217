"""Corpora: deterministic iterators over documents (strings, or token arrays for ``.bin`` shards).

* ``StdlibCorpus``: the running Python's standard-library ``*.py`` files, one document per file. It
  ships with every Python, so it is the default corpus and needs no download.
* ``FileCorpus``: local ``.txt`` (one document per file, or split on ``separator``), ``.jsonl`` (one
  JSON object per line, text in ``text_field``) and ``.parquet`` (column ``text_field``, needs
  pyarrow) files, given as a file, a directory (searched recursively) or a glob.
* ``BinCorpus``: modded-nanogpt ``.bin`` token shards, read in order as one stream and split into
  documents at the BOS token (a document may cross a shard boundary).
* ``HFCorpus``: a Hugging Face ``datasets`` dataset, streamed (optional dependency; needs network
  unless the dataset is in the local HF cache).

Every corpus takes ``split`` in ``train | val | all``. Local corpora split by a stable hash of a
document key (the relative path, plus the document's index inside its file where a file holds
several), so the split never depends on the machine, the file order or the random seed.
"""

from __future__ import annotations

import os

from lengthgen.config import ConfigError
from lengthgen.data.text.corpus import Corpus, CorpusError, Split, split_of
from lengthgen.data.text.files import (_GLOB_CHARS, TEXT_EXTENSIONS, BinCorpus, FileCorpus,
                                       resolve_files)
from lengthgen.data.text.hf import HFCorpus
from lengthgen.data.text.stdlib import StdlibCorpus, stdlib_files, stdlib_root

__all__ = ["TEXT_EXTENSIONS", "BinCorpus", "Corpus", "CorpusError", "FileCorpus", "HFCorpus", "Split",
           "StdlibCorpus", "make_corpus", "resolve_files",
           "split_of", "stdlib_files", "stdlib_root"]

CORPUS_FORMS = ("stdlib", "a .txt/.jsonl/.parquet file, directory or glob", "bin:<file, dir or glob>",
                "hf:<dataset>[:config]")

_OPTIONS = {
    "stdlib": {"val_fraction", "include_tests", "root"},
    "files": {"val_fraction", "separator", "text_field"},
    "bin": {"val_fraction"},
    "hf": {"text_field", "hf_split", "streaming", "val_fraction"},
}


def _check_options(kind: str, spec: str, options: dict, keys: tuple[str, ...]) -> None:
    bad = sorted(set(options) - _OPTIONS[kind])
    if bad:
        listed = f"{', '.join(keys)} and, for a {kind} corpus, " if keys else ""
        raise ConfigError(f"corpus.{bad[0]} is not a valid key (corpus {spec!r}); valid keys: {listed}"
                          f"{', '.join(sorted(_OPTIONS[kind]))}", f"corpus.{bad[0]}")


def _looks_like_path(spec: str) -> bool:
    return (os.path.exists(os.path.expanduser(spec)) or any(c in spec for c in _GLOB_CHARS)
            or "/" in spec or os.sep in spec or spec.startswith(("~", "."))
            or spec.lower().endswith(TEXT_EXTENSIONS))


def make_corpus(spec: str | os.PathLike | Corpus, split: str = "train", *, tokenizer=None,
                keys: tuple[str, ...] = (), **options) -> Corpus:
    """A corpus from its spec: ``"stdlib"``, a file/directory/glob path, ``"bin:<glob>"`` or
    ``"hf:<dataset>[:config]"``. ``tokenizer`` gives ``bin:`` corpora their BOS id and vocabulary
    size. A ``Corpus`` is returned as is (``split`` and ``options`` are then ignored). An unknown option is a
    `ConfigError` listing the corpus's options after the caller's own ``keys``."""
    if isinstance(spec, Corpus):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"corpus must be a non-empty string or a Corpus, got {spec!r}; valid forms: "
                         f"{'; '.join(CORPUS_FORMS)}")
    if spec == "stdlib":
        _check_options("stdlib", spec, options, keys)
        return StdlibCorpus(split, **options)
    if spec.startswith("bin:"):
        _check_options("bin", spec, options, keys)
        if not spec[4:]:
            raise ValueError("corpus 'bin:' needs a file, directory or glob, e.g. 'bin:data/*.bin'")
        return BinCorpus(spec[4:], split, bos_id=getattr(tokenizer, "bos_id", None),
                         vocab_size=getattr(tokenizer, "vocab_size", None),
                         tokenizer_name=getattr(tokenizer, "name", ""), **options)
    if spec.startswith("hf:"):
        _check_options("hf", spec, options, keys)
        name, _, config = spec[3:].partition(":")
        if not name:
            raise ValueError("corpus 'hf:' needs a dataset name: 'hf:<dataset>[:config]'")
        return HFCorpus(name, config or None, split, **options)
    if _looks_like_path(spec):
        _check_options("files", spec, options, keys)
        return FileCorpus(spec, split, **options)
    raise ValueError(f"unknown corpus {spec!r}: not 'stdlib', not an existing path and no known prefix; "
                     f"valid forms: {'; '.join(CORPUS_FORMS)}")
