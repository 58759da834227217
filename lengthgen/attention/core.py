"""`attend()`: the parameter-free attention core (masks, query scaling, distance terms, p-softmax)."""

from __future__ import annotations

from typing import Any

import torch

from lengthgen.attention import backends
from lengthgen.attention.functional import base_scale, dense_attention, row_gains, scale_queries
from lengthgen.attention.spec import AttentionSpec, resolve_spec


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                  doc_ids: torch.Tensor | None, mask: torch.Tensor | None, multipliers: Any) -> None:
    for name, t, optional in (("q", q, False), ("k", k, False), ("v", v, False), ("doc_ids", doc_ids, True),
                              ("mask", mask, True)):
        if not (isinstance(t, torch.Tensor) or (optional and t is None)):
            raise ValueError(f"attend: {name} must be a tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attend expects (batch, heads, length, head_dim) tensors, got q{tuple(q.shape)}, "
                         f"k{tuple(k.shape)}, v{tuple(v.shape)}")
    if not all(t.is_floating_point() for t in (q, k, v)):
        raise ValueError(f"attend expects floating-point q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] == 0:
        raise ValueError(f"attend: q and k have no channels (head_dim 0), got q{tuple(q.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attend: incompatible shapes q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}")
    if q.shape[1] % k.shape[1] if k.shape[1] else q.shape[1]:     # no key/value heads: no query heads either
        raise ValueError(f"attend: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"attend: {q.shape[2]} queries but only {k.shape[2]} keys (queries are the last positions)")
    if doc_ids is not None and tuple(doc_ids.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"attend: doc_ids must be (batch, key length) = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(doc_ids.shape)}")
    if doc_ids is not None and (doc_ids.is_floating_point() or doc_ids.is_complex()):
        raise ValueError(f"attend: doc_ids must be integer document ids (a long tensor), got {doc_ids.dtype}")
    want = (q.shape[0], 1, q.shape[2], k.shape[2])
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != want):
        raise ValueError(f"attend: mask must be a boolean (batch, 1, queries, keys) = {want} tensor, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if multipliers is not None:
        if spec.query_scaling == "none":
            raise ValueError("attend: multipliers scale log_n, log_bn or sqrt_log_n query scaling, but the spec's "
                             "query_scaling is 'none'")
        shape = tuple(multipliers.shape) if isinstance(multipliers, torch.Tensor) else ()
        if not isinstance(multipliers, (torch.Tensor, int, float)) or shape not in ((), (1,), (q.shape[1],)):
            got = f"shape {shape}" if isinstance(multipliers, torch.Tensor) else type(multipliers).__name__
            raise ValueError(f"attend: multipliers must be a number, a scalar tensor or one per query head "
                             f"({q.shape[1]},), got {got}")
    for name, t in (("k", k), ("v", v), ("doc_ids", doc_ids), ("mask", mask), ("multipliers", multipliers)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"attend: {name} is on {t.device} but q on {q.device}; give every tensor on q's device")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec | str | dict[str, Any] | None = None,
           *, doc_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None,
           multipliers: torch.Tensor | float | None = None, backend: str = "auto", return_weights: bool = False):
    """Causal p-softmax attention with every `AttentionSpec` mechanism (see `lengthgen.attention.functional`).

    q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D) with H a multiple of Hkv and Lq <= Lk (queries are the last Lq
    positions). ``doc_ids`` (B, Lk): document ids, used when ``spec.doc_masking`` (None: one document).
    ``mask``: an explicit boolean (B, 1, Lq, Lk) visibility (True = visible), combined with the causal mask, the
    spec's window and documents; n_i is then each row's visible count, and a row that sees nothing outputs 0.
    ``multipliers``: the query-scaling multiplier (s for log_n / log_bn, r for sqrt_log_n), scalar or (H,); default
    ``spec.scaling_init``. ``backend``: auto | dense | tiled | sdpa | cpu_flash | flex | triton.
    ``return_weights`` uses the dense oracle and returns ``(out, weights)``. Returns (B, H, Lq, Dv).
    """
    spec = resolve_spec(spec)
    _check_inputs(q, k, v, spec, doc_ids, mask, multipliers)
    if backend != "auto":
        backends.module(backend)                     # an unknown name fails here, also for an empty input
    if 0 in q.shape[:3] or v.shape[-1] == 0:     # nothing to compute (the fused kernels need rows): empty output
        keep = (q.sum() + k.sum() + v.sum()).to(v.dtype) * 0     # empty sums: zero gradients to the inputs
        out = v.new_zeros((*q.shape[:3], v.shape[-1])) + keep
        return (out, v.new_zeros((*q.shape[:3], k.shape[2])) + keep) if return_weights else out
    if return_weights:
        qs = scale_queries(q, spec, k.shape[-2], doc_ids, multipliers, mask)
        return dense_attention(qs, k, v, spec, doc_ids, mask=mask, return_weights=True)
    training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in (q, k, v, multipliers))
    masked = mask is not None
    name = backends.choose(spec, q, k.shape[-2], training, masked) if backend == "auto" else backend
    reason = backends.unsupported(name, spec, q, training, masked)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run this spec here: {reason}")
    run, dtype = backends.attention(name, q.device), backends.query_dtype(name, q, k)
    if name in backends.ROW_GAIN:                # the kernel multiplies each row's dot products by g_i base_scale
        return run(q, k, v, spec, doc_ids, mask=mask, scale=base_scale(spec, q.shape[-1]),
                   gain=row_gains(q, spec, k.shape[-2], doc_ids, multipliers, mask))
    if name in backends.KERNEL_SCALE:            # the kernel multiplies its dot products by base_scale (float32)
        qs = scale_queries(q, spec, k.shape[-2], doc_ids, multipliers, mask, dtype=dtype, base=1.0)
        return run(qs, k, v, spec, doc_ids, mask=mask, scale=base_scale(spec, q.shape[-1]))
    return run(scale_queries(q, spec, k.shape[-2], doc_ids, multipliers, mask, dtype=dtype), k, v, spec, doc_ids,
               mask=mask)
