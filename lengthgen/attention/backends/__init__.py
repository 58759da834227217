"""Attention backends: one math, several engines.

Each backend module has ``unsupported(spec, q, training) -> reason | None`` and
``attention(qs, k, v, spec, doc_ids)``, taking queries already scaled by `functional.scale_queries`.
`dense` is the oracle every other backend is tested against.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from lengthgen.attention.spec import AttentionSpec

MODULES = {"dense": "dense", "tiled": "tiled", "sdpa": "sdpa", "flex": "flex", "triton": "triton_psoftmax"}
BACKENDS = ("auto", *MODULES)

# Below this many (query x key) pairs per head the dense oracle is a fast CPU engine with small memory.
DENSE_MAX_PAIRS = 1024 * 1024


def module(name: str) -> ModuleType:
    if name not in MODULES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"lengthgen.attention.backends.{MODULES[name]}")


def unsupported(name: str, spec: AttentionSpec, q: torch.Tensor, training: bool) -> str | None:
    """Why backend ``name`` cannot run ``spec`` on these inputs, or None if it can."""
    try:
        return module(name).unsupported(spec, q, training)
    except ImportError as err:
        return f"not installed ({err})"


def choose(spec: AttentionSpec, q: torch.Tensor, lk: int, training: bool) -> str:
    """`auto`: the fastest backend that supports ``spec`` on ``q``'s device.

    On CUDA: SDPA (flash) when the spec is plain softmax, else FlexAttention, else the Triton kernel, else
    `tiled`. The Triton kernel is verified only under the Triton interpreter so far; it stays behind
    FlexAttention until its GPU tests and benchmark have run (select it with ``backend="triton"``)."""
    if q.is_cuda:
        return next(n for n in ("sdpa", "flex", "triton", "tiled") if unsupported(n, spec, q, training) is None)
    small = q.shape[-2] * lk <= DENSE_MAX_PAIRS
    plain_causal = spec.window is None and not spec.doc_masking
    if unsupported("sdpa", spec, q, training) is None and (plain_causal or small):
        return "sdpa"
    return "dense" if small else "tiled"
