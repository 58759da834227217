"""`sdpa`: ``F.scaled_dot_product_attention`` for p = 1 and no distance terms.

Query-length scaling and ``base_scale`` are already folded into the queries, so SDPA runs with scale 1.
Causal attention without window or documents uses ``is_causal`` (flash / efficient kernels); otherwise a
boolean mask is passed (memory quadratic in length: `auto` prefers `tiled` for long masked CPU inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lengthgen.attention import functional as fn
from lengthgen.attention.spec import AttentionSpec


def unsupported(spec: AttentionSpec, q: torch.Tensor | None = None, training: bool = False) -> str | None:
    """Why this backend cannot run ``spec``, or None."""
    if spec.softmax_p != 1:
        return f"softmax_p={spec.softmax_p} (sdpa computes p=1 only)"
    if spec.distance != "none":
        return f"distance={spec.distance!r} (sdpa has no score modifier)"
    return None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    reason = unsupported(spec)
    if reason:
        raise ValueError(f"backend 'sdpa' cannot run this spec: {reason}")
    lq, lk = qs.shape[-2], k.shape[-2]
    gqa = qs.shape[1] != k.shape[1]
    q_run, k_run = fn.runs(doc_ids, spec, lq)
    if lq == lk and spec.window is None and q_run is None:
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=1.0, enable_gqa=gqa)
    q_pos, k_pos = fn.positions(lq, lk, qs.device)
    mask = fn.visibility(q_pos, k_pos, spec, q_run, k_run)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=1.0, enable_gqa=gqa)
