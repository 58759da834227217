"""Optional packages: `require` imports one, or raises `MissingPackageError` saying in one line what needs it and
how to install it (the command line prints that line and exits with status 2)."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingPackageError(ImportError):
    """An optional package is not installed; the message names what needs it and the ``pip install`` line."""


def require(module: str, needed_for: str, install: str) -> ModuleType:
    """``import module``, or `MissingPackageError`: ``<needed_for> needs the '<package>' package, which is not
    installed: pip install <install>``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingPackageError(f"{needed_for} needs the {module.split('.')[0]!r} package, which is not "
                                  f"installed: pip install {install}") from err


__all__ = ["MissingPackageError", "require"]
