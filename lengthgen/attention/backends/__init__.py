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

# CPU crossovers of `choose`, measured with benchmarks/attention_crossover.py (1 thread, float32, forward +
# backward, L = 16..2048; batch x heads = 4 at head_dim 64, and the demo model's 2048 tokens: batch x heads =
# 4 * 2048 / L at head_dim 16; results in benchmarks/results/):
#: dense below this many logits (batch x heads x Lq x Lk): its few large ops beat the blocked engines' per-block
#: cost (tiled overtook it between 2^16 and 2^18 logits, cpu_flash between 2^12 and 2^18).
DENSE_MAX_LOGITS = 1 << 17
#: with fewer query rows than this (decoding), dense up to this many logits (64 MiB of float32): a blocked
#: engine would pay its per-block cost for a row or two
DECODE_ROWS, DECODE_MAX_LOGITS = 16, 1 << 24
#: sdpa with an (Lq, Lk) boolean mask (windows, documents, explicit masks) up to this many pairs per head: at
#: 256 x 256 it was 1.1-1.5x faster than cpu_flash's query blocks, at 512 x 512 1.2-1.3x slower.
SDPA_MASK_MAX_PAIRS = 1 << 16


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
    FlexAttention until its GPU tests and benchmark have run (select it with ``backend="triton"``).

    On CPU (measured: see `DENSE_MAX_LOGITS`, `SDPA_MASK_MAX_PAIRS`): `sdpa` for softmax without distance
    terms when causal only or short; else `dense` for few logits; else `cpu_flash` for softmax whose distance
    term only adds (ALiBi, log-bias) or with masks; else `tiled` (p != 1, scale-invariant)."""
    if q.is_cuda:
        return next(n for n in ("sdpa", "flex", "triton", "tiled")
                    if unsupported(n, spec, q, training, masked) is None)
    pairs = q.shape[-2] * lk
    logits = q.shape[0] * q.shape[1] * pairs
    plain_causal = spec.window is None and not spec.doc_masking and not masked
    if unsupported("sdpa", spec, q, training, masked) is None and (plain_causal or pairs <= SDPA_MASK_MAX_PAIRS):
        return "sdpa"
    if logits <= DENSE_MAX_LOGITS or (q.shape[-2] < DECODE_ROWS and logits <= DECODE_MAX_LOGITS):
        return "dense"
    return "cpu_flash" if unsupported("cpu_flash", spec, q, training, masked) is None else "tiled"
