"""The default corpus: the running Python's standard-library source, no download needed."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from lengthgen.config import check_value
from lengthgen.data.text.corpus import Corpus, check_split_options, stat_fingerprint

STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


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


def split_key(rel: str) -> str:
    """The key by which a file's split is drawn: its family, so that near-copies fall on one side. The generated
    codec tables of ``encodings/`` are one family (cp862.py shared 65% of its text with train files when each file
    was drawn apart); elsewhere, paths that differ only in digits are one family."""
    return "encodings/" if rel.startswith("encodings/") else re.sub(r"\d+", "#", rel)


class StdlibCorpus(Corpus):
    """The running Python's standard-library source, one document per ``*.py`` file (empty files
    skipped), in sorted path order; ``val`` is the ~``val_fraction`` of files whose family (`split_key` of the
    relative path) has a sha1 below it. Files are decoded as UTF-8 with ``errors="replace"``."""

    def __init__(self, split: str = "train", *, val_fraction: float = 0.05,
                 include_tests: bool = False, root: str | os.PathLike | None = None):
        self.split, self.val_fraction = check_split_options("StdlibCorpus", split, val_fraction)
        self.include_tests = check_value("StdlibCorpus.include_tests", include_tests, bool)
        self.root = Path(root) if root is not None else stdlib_root()
        self.name = f"stdlib{'+tests' if include_tests else ''}/{split}"

    def files(self) -> list[tuple[str, Path]]:
        """The files of this split."""
        return [(rel, p) for rel, p in stdlib_files(self.root, include_tests=self.include_tests)
                if self._keep(split_key(rel))]

    def documents(self) -> Iterator[str]:
        for _, path in self.files():
            text = path.read_bytes().decode("utf-8", errors="replace")
            if text.strip():
                yield text

    def fingerprint(self) -> str:
        parts = ["stdlib", sys.version, str(self.root), self.split, repr(self.val_fraction),
                 str(self.include_tests), "split by family"]
        return stat_fingerprint(parts, self.files())

    def describe(self) -> str:
        return (f"stdlib corpus at {self.root} (split {self.split!r}, include_tests="
                f"{self.include_tests}): {len(self.files())} *.py files in the split")
