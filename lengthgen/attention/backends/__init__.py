"""Attention backends: one math, several engines, each tested against the dense oracle.

Each backend module has ``unsupported(spec, q, training, masked=False) -> reason | None`` and
``attention(qs, k, v, spec, doc_ids=None, *, mask=None, ...)``, taking queries already scaled by
`functional.scale_queries`; ``mask`` is an explicit (B, 1, Lq, Lk) visibility (``masked``: one is given).

Backends that offer ``return_lse=True`` (dense, tiled, flex, triton) return ``(out, LSE_1, LSE_p)``:
``LSE_1 = logsumexp_j(logit_ij)`` and ``LSE_p = logsumexp_j(p * logit_ij)`` over the visible keys, natural log,
shape (B, H, Lq), float32 (float64 for float64 inputs), -inf for a row that sees nothing, no gradient
(``out`` keeps its own). They give ``out_p = out_1 * exp(LSE_1 - LSE_p / p)`` (seed 001).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from lengthgen.attention.spec import AttentionSpec

MODULES = {"dense": "dense", "tiled": "tiled", "sdpa": "sdpa", "cpu_flash": "cpu_flash", "flex": "flex",
           "triton": "triton_psoftmax"}
BACKENDS = ("auto", *MODULES)

# Below this many (query x key) pairs per head the dense oracle is a fast CPU engine with small memory.
DENSE_MAX_PAIRS = 1024 * 1024


def module(name: str) -> ModuleType:
    if name not in MODULES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"lengthgen.attention.backends.{MODULES[name]}")


def unsupported(name: str, spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    """Why backend ``name`` cannot run ``spec`` on these inputs (with an explicit mask if ``masked``), or None."""
    try:
        return module(name).unsupported(spec, q, training, masked)
    except ImportError as err:
        return f"not installed ({err})"


def choose(spec: AttentionSpec, q: torch.Tensor, lk: int, training: bool, masked: bool = False) -> str:
    """`auto`: the fastest backend that supports ``spec`` (and an explicit mask if ``masked``) on ``q``'s device.

    On CUDA: SDPA (flash) when the spec is plain softmax, else FlexAttention, else the Triton kernel, else
    `tiled`. The Triton kernel is verified only under the Triton interpreter so far; it stays behind
    FlexAttention until its GPU tests and benchmark have run (select it with ``backend="triton"``)."""
    if q.is_cuda:
        return next(n for n in ("sdpa", "flex", "triton", "tiled")
                    if unsupported(n, spec, q, training, masked) is None)
    small = q.shape[-2] * lk <= DENSE_MAX_PAIRS
    plain_causal = spec.window is None and not spec.doc_masking and not masked
    if unsupported("sdpa", spec, q, training, masked) is None and (plain_causal or small):
        return "sdpa"
    return "dense" if small else "tiled"
