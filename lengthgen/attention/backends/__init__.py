"""Attention backends: one math, several engines, each tested against the dense oracle.

Each backend module has ``unsupported(spec, q, training, masked=False) -> reason | None`` and
``attention(qs, k, v, spec, doc_ids=None, *, mask=None, ...)``, taking queries already scaled by
`functional.scale_queries`; ``mask`` is an explicit (B, 1, Lq, Lk) visibility (``masked``: one is given). Those of
`KERNEL_SCALE` also take ``scale``, a factor of the dot products applied in the kernel, in float32.

Backends that offer ``return_lse=True`` (dense, tiled, cpu_flash, flex, triton) return ``(out, LSE_1, LSE_p)``:
``LSE_1 = logsumexp_j(logit_ij)`` and ``LSE_p = logsumexp_j(p * logit_ij)`` over the visible keys, natural log,
shape (B, H, Lq), float32 (float64 for float64 inputs), -inf for a row that sees nothing, no gradient
(``out`` keeps its own). They give ``out_p = out_1 * exp(LSE_1 - LSE_p / p)`` (seed 001).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

import torch

from lengthgen.attention.backends import cpu_flash, dense, flex, sdpa, tiled
from lengthgen.attention.spec import AttentionSpec

MODULES = {"dense": "dense", "tiled": "tiled", "sdpa": "sdpa", "cpu_flash": "cpu_flash", "flex": "flex",
           "triton": "triton_psoftmax"}
BACKENDS = ("auto", *MODULES)
#: backend -> the devices where ``torch.compile`` of a model traces it into the model's graph (no graph break: the
#: query scaling and casts around it fuse with the projections); elsewhere a backend runs eager inside the compiled
#: model (`attention`): Python loops over key blocks (tiled, cpu_flash), Triton launches, data-dependent checks
#: (dense), FlexAttention on CPU (its compiled CPU path has no LSE and no backward)
TRACED = {"sdpa": ("cpu", "cuda"), "flex": ("cuda",)}
#: the fused kernels: they multiply the dot products by a ``scale`` in float32 (SDPA's and FlexAttention's own
#: ``scale``; the Triton kernel's) and on CUDA round q' to the keys' dtype (`query_dtype`). `attend` hands them
#: ``base_scale`` there, not in the queries, which then take no pass of their own without query scaling (the eager
#: q * base_scale pass, one each way: est. 0.09 ms at 16K tokens x 16 heads x 128 on an H100, ~15% of SDPA flash's
#: forward + backward at L = 1K; benchmarks/README.md)
KERNEL_SCALE = ("sdpa", "flex", "triton")
#: the fused kernels that also take the query gains g_i (`functional.row_gains`) as a ``gain`` argument, a factor of
#: each query row's dot products in float32, and then the raw queries: no scaling pass over q with query scaling
#: (sqrt_log_n, ssmax) either (SDPA and FlexAttention take one factor for all rows)
ROW_GAIN = ("triton",)
#: imported up front (a lookup that traces) but the Triton kernel's, which imports triton when first asked for
_LOADED: dict[str, ModuleType] = {"dense": dense, "tiled": tiled, "sdpa": sdpa, "cpu_flash": cpu_flash, "flex": flex}
#: backend -> its ``attention`` under ``torch.compiler.disable`` (made here, as making one in a trace is a break too)
_EAGER: dict[str, Callable] = {name: torch.compiler.disable(m.attention) for name, m in _LOADED.items()}

# CPU crossovers of `choose`, measured with benchmarks/attention_crossover.py (1 thread, float32, forward +
# backward, L = 16..2048, batch x heads = 4 at head_dim 64 and the demo model's 2048 tokens per step, batch x
# heads = 4 * 2048 / L at head_dim 16; benchmarks/results/*-crossover.md). Against the fastest backend of each
# measured case, the pick was at worst 1.33x slower (documents at 256 x 256, where cpu_flash skips what the
# documents hide), 1.15-1.18x for p = 2 with documents at 4 x 128 x 128 and 32 x 64 x 64, else within 1.11x.
# Softmax with masks or an additive distance term stays on cpu_flash at every length: at 2K-16K `tiled` was 0.82-0.98x
# its time for windows, ALiBi and log-bias only from 8K at head_dim 64, and 1.13-1.93x at the demo's head_dim 16
# (cpu2-epyc-2026-11-24-crossover-long.md).
#: sdpa with an (Lq, Lk) boolean mask (windows, documents, explicit masks) up to this many pairs per head: it
#: was the fastest up to 128 x 128 and tied at 256 x 256; from 512 x 512 cpu_flash was 1.6-2x faster.
SDPA_MASK_MAX_PAIRS = 1 << 16
#: dense rather than cpu_flash up to this many logits (batch x heads x Lq x Lk): faster by 15-20% up to 4 x 64
#: x 64 logits, slower by 12% at 4 x 128 x 128 and by 10-120% at every demo length.
FLASH_DENSE_MAX_LOGITS = 1 << 15
#: dense rather than tiled up to this many logits and pairs per head: dense was faster by 4-49% at 4 x 128 x 128
#: and at the demo's 256 x 32 x 32 and 128 x 64 x 64 logits, tiled from 4 x 256 x 256 (1.7x) and 64 x 128 x 128.
TILED_DENSE_MAX_LOGITS, TILED_DENSE_MAX_PAIRS = 1 << 19, 1 << 14
#: with fewer query rows than this (decoding), dense up to this many logits (64 MiB of float32): a blocked
#: engine would pay its per-block cost for a row or two
DECODE_ROWS, DECODE_MAX_LOGITS = 16, 1 << 24


def triton_before_flex(spec: AttentionSpec) -> bool:
    """`auto` on CUDA: the fused Triton kernel before FlexAttention for ``p != 1`` and scale-invariant attention.

    Measured on an H100 (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22-1715.md, L = 4096, head_dim 128,
    bf16, forward + backward, time over SDPA flash): p = 2 1.25x (Triton) against 1.82x (Flex), p = 2 with
    documents 0.83x against 1.06x, scale-invariant 1.71x against 2.22x; Flex was the faster for p = 1 with ALiBi
    (1.14x against 1.30x) and log-bias (1.41x against 1.59x). For p != 1 the Triton kernel is also the more
    precise in bf16: Flex's ``out_1 * exp(LSE_1 - LSE_p / p)`` takes its gradient through two passes whose terms
    cancel on rows that see few keys (4.3% of the largest gradient entry at p = 0.5 on an H100, against at most
    1.6% for the same math in plain bf16; tests/test_flex.py)."""
    return spec.softmax_p != 1 or spec.distance == "scale_invariant"


def module(name: str) -> ModuleType:
    if not isinstance(name, str) or name not in MODULES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(f"lengthgen.attention.backends.{MODULES[name]}")
    return _LOADED[name]


def attention(name: str, device: torch.device) -> Callable:
    """Backend ``name``'s ``attention`` for inputs on ``device``: run eager under ``torch.compile`` (one graph break)
    unless `TRACED` there."""
    if device.type in TRACED.get(name, ()):
        return module(name).attention
    if name not in _EAGER:
        _EAGER[name] = torch.compiler.disable(module(name).attention)
    return _EAGER[name]


def query_dtype(name: str, q: torch.Tensor, k: torch.Tensor) -> torch.dtype | None:
    """The dtype backend ``name`` takes the scaled queries q' in: the keys' dtype for the fused CUDA kernels (SDPA,
    FlexAttention and Triton round q' to it: `functional.kernel_inputs`), so that q' is rounded once as it is
    made; None (the compute dtype, `functional.scale_queries`) for the others."""
    return k.dtype if q.is_cuda and name in KERNEL_SCALE else None


def unsupported(name: str, spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    """Why backend ``name`` cannot run ``spec`` on these inputs (with an explicit mask if ``masked``), or None."""
    try:
        return module(name).unsupported(spec, q, training, masked)
    except ImportError as err:
        return f"not installed ({err})"


def choose(spec: AttentionSpec, q: torch.Tensor, lk: int, training: bool, masked: bool = False) -> str:
    """`auto`: the fastest backend that supports ``spec`` (and an explicit mask if ``masked``) on ``q``'s device.

    On CUDA: SDPA (flash) for causal softmax without distance terms, windows or documents; else FlexAttention or
    the fused Triton kernel (Triton first for p != 1 and scale-invariant attention, `triton_before_flex`), which
    skip the key blocks that windows and documents hide (SDPA would take them as an (Lq, Lk) mask: quadratic
    memory and no block skipped); then SDPA with a mask (an explicit mask, which neither of them takes), then
    `tiled`. Decoding (fewer than `DECODE_ROWS` query rows against a cache): SDPA, else `dense`, while the logits
    are few (FlexAttention would compile anew for every cache length).

    On CPU (measured: see `SDPA_MASK_MAX_PAIRS` and the other thresholds): `sdpa` for softmax without distance
    terms when causal only or short; else `cpu_flash` (softmax with masks or a distance term that only adds:
    ALiBi, log-bias) or `tiled` (p != 1, scale-invariant), unless the logits are few enough for `dense`."""
    pairs = q.shape[-2] * lk
    logits = q.shape[0] * q.shape[1] * pairs
    plain_causal = spec.window is None and not spec.doc_masking and not masked
    if q.is_cuda:
        fused = ("triton", "flex") if triton_before_flex(spec) else ("flex", "triton")
        if q.shape[-2] < DECODE_ROWS and logits <= DECODE_MAX_LOGITS:
            order = ("sdpa", "dense")
        else:
            order = ("sdpa", *fused, "tiled") if plain_causal else (*fused, "sdpa", "tiled")
        return next(n for n in order if unsupported(n, spec, q, training, masked) is None)
    if unsupported("sdpa", spec, q, training, masked) is None and (plain_causal or pairs <= SDPA_MASK_MAX_PAIRS):
        return "sdpa"
    if q.shape[-2] < DECODE_ROWS and logits <= DECODE_MAX_LOGITS:
        return "dense"
    if unsupported("cpu_flash", spec, q, training, masked) is None:
        return "dense" if logits <= FLASH_DENSE_MAX_LOGITS else "cpu_flash"
    return "dense" if logits <= TILED_DENSE_MAX_LOGITS and pairs <= TILED_DENSE_MAX_PAIRS else "tiled"
