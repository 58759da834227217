"""lengthgen: length generalization of attention.

One composable attention layer (`AttentionSpec`, `attend`, `Attention`), a GPT-style model, tasks, a
trainer and an evaluation harness that measures behaviour far beyond the training length.

The public API is imported when first used (PEP 562): ``import lengthgen`` does not import torch, so the command
line (`lengthgen.__main__`) catches Ctrl-C before its seconds of imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lengthgen.version import __version__

if TYPE_CHECKING:
    from lengthgen.attention import Attention, AttentionSpec, attend
    from lengthgen.model import GPT, GPTConfig

#: public name -> the module that defines it
_DEFINED_IN = {"Attention": "lengthgen.attention", "AttentionSpec": "lengthgen.attention",
               "attend": "lengthgen.attention", "GPT": "lengthgen.model", "GPTConfig": "lengthgen.model"}


def __getattr__(name: str):
    if name not in _DEFINED_IN:
        raise AttributeError(f"module 'lengthgen' has no attribute {name!r}")
    return getattr(importlib.import_module(_DEFINED_IN[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_DEFINED_IN})


__all__ = ["Attention", "AttentionSpec", "GPT", "GPTConfig", "__version__", "attend"]
