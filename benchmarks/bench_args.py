"""Command-line pieces shared by the benchmark scripts: bad input is one line, ``PROG: error: ...``, exit status 2,
before anything runs."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(text: str, kind: Callable[[str], float], valid: Callable[[float], bool], give: str) -> float:
    """``kind(text)`` when it parses and is ``valid``, else argparse's error ``'TEXT' is not valid; give GIVE``."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give {give}")
    return value


def positive_int(text: str) -> int:
    return number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0 (a timeout in seconds, a p-softmax power)."""
    return number(text, float, lambda v: 0 < v < math.inf, "a finite number > 0")


def ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers."""
    try:
        values = tuple(positive_int(x.strip()) for x in text.split(",") if x.strip())
    except argparse.ArgumentTypeError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give positive integers, e.g. 256,1024")
    return values


def names(valid, empty: bool = False):
    """A comma list whose every name is one of ``valid`` (none at all only if ``empty``)."""
    valid = tuple(valid)

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        unknown = [x for x in chosen if x not in valid]
        if unknown or not (chosen or empty):
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)} is not valid; choose from "
                                             f"{', '.join(valid)}")
        return chosen
    return parse


def fresh(ap: argparse.ArgumentParser, paths, overwrite: bool) -> None:
    """Refuse, before anything is measured, output ``paths`` that are folders, or exist and ``overwrite`` is not
    given, or whose folder cannot be made, or that lengthgen's commands refuse in the folders they wrote
    (`lengthgen.cli.common.refuse_out`: a run's own files, its checkpoints): a benchmark that has run must be able
    to write, and replaces no results unasked."""
    from lengthgen.cli.common import CommandError, refuse_out

    for path in map(Path, paths):
        if path.is_dir():
            ap.error(f"argument --out: {path} is a folder; choose another --out")
        if path.exists() and not overwrite:
            ap.error(f"argument --out: {path} exists; pass --overwrite to replace it, or choose another --out")
        try:
            refuse_out(path)
        except CommandError as err:
            ap.error(f"argument {err}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            ap.error(f"argument --out: cannot make the folder {path.parent} ({err.strerror})")
