"""Command-line pieces shared by the benchmark scripts: bad input is one line, ``PROG: error: ...``, exit status 2,
before anything runs."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
