"""`sdpa`: ``F.scaled_dot_product_attention`` for p = 1 and no distance terms.

Query-length scaling is already folded into the queries; ``scale`` (`attend` gives ``base_scale``) is SDPA's own
(in float32 for half-precision inputs on CPU, in the input dtype on CUDA: `functional.kernel_inputs`).
Causal attention without window, documents or explicit mask uses ``is_causal`` (flash / efficient kernels);
otherwise the mask mods are evaluated into a boolean mask (memory quadratic in length: `auto` prefers
`tiled` for long masked CPU inputs). A row that sees nothing outputs 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.spec import AttentionSpec


def unsupported(spec: AttentionSpec, q: torch.Tensor | None = None, training: bool = False,
                masked: bool = False) -> str | None:
    """Why this backend cannot run ``spec``, or None."""
    if spec.softmax_p != 1:
        return f"softmax_p={spec.softmax_p} (sdpa computes p=1 only)"
    if spec.distance != "none":
        return f"distance={spec.distance!r} (sdpa has no score modifier)"
    return None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None, scale: float = 1.0
              ) -> torch.Tensor:
    reason = unsupported(spec)
    if reason:
        raise ValueError(f"backend 'sdpa' cannot run this spec: {reason}")
    dtype, (qs, k, v) = v.dtype, fn.kernel_inputs(qs, k, v)
    lq, lk = qs.shape[-2], k.shape[-2]
    gqa = qs.shape[1] != k.shape[1]
    starts = mods.document_starts(spec, doc_ids)
    if lq == lk and spec.window is None and starts is None and mask is None:
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa).to(dtype)
    visible = mods.dense_mask(mods.mask_mod_for(spec, lq, lk, starts, mask), qs.shape[0], lq, lk, qs.device)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa).to(dtype)
