"""The whole math of one attention layer, as small pure functions.

For query position i, visible keys j, distance t = i - j and n_i = number of keys visible to query i::

    s_ij     = (q_i . k_j) * base_scale
    logit_ij = g_i * a_t * s_ij + bias_t
    w_ij     = exp(logit_ij) / (sum_j exp(p * logit_ij))^(1/p)
    out_i    = sum_j w_ij v_j

``g_i`` depends on n_i only, so it is folded into the queries (`scale_queries`) before any backend runs;
backends then see ``logit_ij = a_t * c * (q'_i . k_j) + bias_t``, where ``c`` is 1 (``base_scale`` folded into
q') or, for the fused kernels that scale their dot products in float32 themselves (SDPA, FlexAttention, Triton:
`backends.KERNEL_SCALE`), ``base_scale`` (q' = q * g_i; without query scaling no pass over the queries at all).
The Triton kernel also takes g_i as a per-row factor of its dot products (`row_gains`, `backends.ROW_GAIN`): its
queries take no pass with query scaling either.
The distance terms (a_t, bias_t) and the visibility rules (causal, sliding window, documents) are the score and
mask mods of `lengthgen.attention.mods`.

Queries are the *last* ``Lq`` positions of the ``Lk`` keys (``Lq == Lk`` in training; ``Lq < Lk`` when
decoding with a cache).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from lengthgen.attention import mods
from lengthgen.attention.spec import ABC_SCALINGS, AttentionSpec

# ---------------------------------------------------------------------------------------------------
# query-length scaling g_i


def gain_feature(n: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The n-dependent factor f(n) of the gain ``g = a + m f(n)``:

    * ``log_n``: ``f = log n`` (``a = 0``; Scalable-Softmax, Nakanishi 2025, arXiv 2501.19399).
    * ``log_bn``: ``f = log(b n + c)`` (seed 004's log n baseline: "a similar kind of a, b, c formulation for
      log n as well (which is what I compared against)").
    * ``sqrt_log_n``: ``f = sqrt(2 log(b n + c))`` (seed 004: the extreme-value scale of the maximum of n
      Gaussian logits, with the seed's tuned a=0, b=0.1, c=1.9).
    """
    if spec.query_scaling == "log_n":
        return torch.log(n)
    log_bn = torch.log(spec.scaling_b * n + spec.scaling_c)
    return log_bn if spec.query_scaling == "log_bn" else torch.sqrt(2 * log_bn)


def query_gain(n: torch.Tensor, spec: AttentionSpec, multiplier: torch.Tensor | float | None = None
               ) -> torch.Tensor | None:
    """g_i = a + m f(n_i) (`gain_feature`), or None when it is 1.

    ``n``: (B, Lq); ``multiplier`` m (s or r): a float, a scalar tensor or a (H,) tensor, default
    ``spec.scaling_init``. Returns (B, H|1, Lq, 1)."""
    if spec.query_scaling == "none":
        return None
    return _combine(gain_feature(n[:, None, :, None], spec), spec, multiplier, 1.0)


def _combine(f: torch.Tensor, spec: AttentionSpec, multiplier: torch.Tensor | float | None, base: float
             ) -> torch.Tensor:
    """``(a + m f) * base`` with a float m as Python arithmetic (no host-to-device copy) and a tensor m as
    (1, H|1, 1, 1)."""
    m = spec.scaling_init if multiplier is None else multiplier
    if isinstance(m, torch.Tensor):
        m = m.reshape(1, -1, 1, 1)
    a = spec.scaling_a if spec.query_scaling in ABC_SCALINGS else 0.0
    g = f * (m * base)
    return g + a * base if a else g


@functools.lru_cache(maxsize=256)
def _position_feature(spec: AttentionSpec, lq: int, lk: int, device: torch.device, dtype: torch.dtype
                      ) -> torch.Tensor:
    """`gain_feature` of the closed-form counts (no documents, no explicit mask): a (1, 1, Lq, 1) constant,
    cached so that an eager step does not rebuild it from a dozen tiny kernels. Made outside inference mode:
    autograd saves it for the queries' gradient."""
    with torch.inference_mode(False):
        n = mods.visible_counts(spec, lq, lk, device=device).to(dtype)
        return gain_feature(n[:, None, :, None], spec)


def base_scale(spec: AttentionSpec, head_dim: int) -> float:
    """The logits' constant factor: ``spec.base_scale``, by default 1 / sqrt(head_dim) (Vaswani et al. 2017)."""
    return float(spec.base_scale) if spec.base_scale is not None else 1.0 / math.sqrt(head_dim)


def row_gains(q: torch.Tensor, spec: AttentionSpec, lk: int, doc_ids: torch.Tensor | None = None,
              multiplier: torch.Tensor | float | None = None, mask: torch.Tensor | None = None, base: float = 1.0
              ) -> torch.Tensor | None:
    """g_i * base of each query row of ``q`` (`query_gain`, n_i from `mods.visible_counts` with the explicit
    ``mask`` if given), (B|1, H|1, Lq, 1) in q's compute dtype, or None without query scaling. A fused kernel that
    multiplies each row's dot products by it (`backends.ROW_GAIN`) takes it in place of `scale_queries`."""
    if spec.query_scaling == "none":
        return None
    compute, lq = compute_dtype(q.dtype), q.shape[-2]
    if mask is None and not (spec.doc_masking and doc_ids is not None) and not torch.compiler.is_compiling():
        f = _position_feature(spec, lq, lk, q.device, compute)
    else:
        n = mods.visible_counts(spec, lq, lk, doc_ids, mask, device=q.device)
        f = gain_feature(n.clamp(min=1).to(compute)[:, None, :, None], spec)  # a row that sees nothing outputs 0
    return _combine(f, spec, multiplier, base)


def scale_queries(q: torch.Tensor, spec: AttentionSpec, lk: int, doc_ids: torch.Tensor | None = None,
                  multiplier: torch.Tensor | float | None = None, mask: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None, base: float | None = None) -> torch.Tensor:
    """q' = q * g_i * base: the part of the logit that depends on the query only (`row_gains`). Computed in
    float32 for half-precision q: rounding q' to bfloat16 would change logits of size 1e4 by about 20. ``dtype``:
    q''s dtype (default that compute dtype); a fused kernel that rounds q' to the keys' half precision anyway takes
    it so (`scale_rows`). ``base``: default `base_scale`; 1 for a kernel that multiplies its dot products by it
    (`backends.KERNEL_SCALE`), which without query scaling gets q itself (in ``dtype``)."""
    base = base_scale(spec, q.shape[-1]) if base is None else float(base)
    dtype = dtype or compute_dtype(q.dtype)
    gains = row_gains(q, spec, lk, doc_ids, multiplier, mask, base)
    if gains is None:
        return q.to(dtype) if base == 1.0 else scale_rows(q, base, dtype)
    return scale_rows(q, gains, dtype)


def scale_rows(q: torch.Tensor, factor: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``(q.to(c) * factor).to(dtype)`` for q's compute dtype c: the product in float32 for half-precision q,
    rounded once to ``dtype``. Eager, a half-precision ``dtype`` takes one pass over q in the forward and one in
    the backward (`_RowScale`), where the three ops above take three (each an upcast copy or float32 product of
    all of q); in a compiled graph Inductor fuses the ops themselves."""
    compute = compute_dtype(q.dtype)
    if dtype == compute or torch.compiler.is_compiling():
        return (q.to(compute) * factor).to(dtype)
    return _RowScale.apply(q, factor, dtype)


class _RowScale(torch.autograd.Function):
    """`scale_rows` in one op each way: ``torch.mul`` with an ``out`` of the narrower dtype computes in the inputs'
    common dtype (float32) and rounds on the store; the gradients are the same ops' (dq = grad * factor rounded to
    q's dtype, dfactor = sum of grad * q over the dimensions ``factor`` broadcasts)."""

    @staticmethod
    def forward(ctx, q, factor, dtype):
        tensor = isinstance(factor, torch.Tensor)
        ctx.save_for_backward(q if tensor and factor.requires_grad else None, factor if tensor else None)
        ctx.number, ctx.q_dtype = (None if tensor else factor), q.dtype
        return torch.mul(q, factor, out=torch.empty_like(q, dtype=dtype))      # q's layout, as .to() keeps it

    @staticmethod
    def backward(ctx, grad):
        q, factor = ctx.saved_tensors
        factor = ctx.number if factor is None else factor
        dq = dfactor = None
        if ctx.needs_input_grad[0]:
            dq = torch.mul(grad, factor, out=torch.empty_like(grad, dtype=ctx.q_dtype))
        if ctx.needs_input_grad[1]:
            dfactor = (grad.to(factor.dtype) * q.to(factor.dtype)).sum_to_size(factor.shape)
        return dq, dfactor, None


# ---------------------------------------------------------------------------------------------------
# logits, p-softmax, the dense oracle


def logits(qs: torch.Tensor, k: torch.Tensor, score_mod: mods.ScoreMod | None, mask_mod: mods.MaskMod,
           q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Masked logits ``score_mod(q'_i . k_j)`` (-inf where ``mask_mod`` hides the key) of query rows ``q_idx``
    against keys ``kv_idx`` (1-D, row convention), the mods evaluated on broadcast `mods.grids`.

    qs: (B, H, lq, D) scaled queries; k: (B, H, lk, D) (expanded for GQA). Returns (B, H, lq, lk).
    """
    s = qs @ k.transpose(-1, -2)
    b, h, q_grid, kv_grid = mods.grids(s.shape[0], s.shape[1], q_idx, kv_idx)
    if score_mod is not None:
        s = score_mod(s, b, h, q_grid, kv_grid)
    return s.masked_fill(~mask_mod(b, h, q_grid, kv_grid), float("-inf"))


def p_softmax(x: torch.Tensor, p: float = 1.0, dim: int = -1) -> torch.Tensor:
    """``exp(x) / ||exp(x)||_p`` (seed 001; p=1 is softmax), in log space: ``w = exp(y - LSE(p y) / p)`` with
    ``y = x - max x``, so that no large logit is ever multiplied by p or exponentiated.

    -inf entries get weight 0, and a row of only -inf gets all zeros. Weights sum to 1 for p=1; their squares
    sum to 1 for p=2."""
    return _p_softmax(x, p, dim)[0]


def _p_softmax(x: torch.Tensor, p: float, dim: int = -1, lse: bool = False):
    """`p_softmax`'s weights and, with ``lse``, the natural-log logsumexps LSE_1 of x and LSE_p of p x."""
    m = x.detach().amax(dim, keepdim=True)                      # a stabilizer: w does not depend on it
    empty = m == float("-inf")                                   # rows that see nothing
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    y = x - m
    # logsumexp of an all -inf row has a NaN gradient (0 * exp(-inf + inf)), even where its value is unused:
    # such rows take it of zeros (their weights exp(-inf - c) stay 0, their gradient 0)
    y_lse = y.masked_fill(empty, 0.0)
    lse_p = torch.logsumexp(p * y_lse, dim, keepdim=True)
    w = torch.exp(y - torch.where(torch.isfinite(lse_p), lse_p, torch.zeros_like(lse_p)) / p)
    if not lse:
        return w, None, None
    lse_1 = lse_p if p == 1 else torch.logsumexp(y_lse, dim, keepdim=True)
    return w, (m + lse_1).masked_fill(empty, float("-inf")), (p * m + lse_p).masked_fill(empty, float("-inf"))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Expand (B, Hkv, L, D) keys/values to (B, Hkv*groups, L, D) for grouped-query attention."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def kernel_inputs(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q', k, v) in one dtype for a fused kernel (sdpa, flex): on CUDA the keys' dtype (q' rounded to it; the
    kernels accumulate in float32), elsewhere the compute dtype (k, v upcast)."""
    if qs.is_cuda:
        return qs.to(k.dtype), k, v
    return qs, k.to(qs.dtype), v.to(qs.dtype)


def dense_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                    doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                    return_lse: bool = False, return_weights: bool = False):
    """The oracle: materializes the (Lq, Lk) logits of queries ``qs`` already scaled by `scale_queries`.

    Half-precision inputs are computed in float32; ``out`` has v's dtype. Returns ``out`` (B, H, Lq, Dv); with
    ``return_lse`` ``(out, LSE_1, LSE_p)`` (see `lengthgen.attention.backends`); with ``return_weights``
    ``(out, weights)``.
    """
    dtype, compute = v.dtype, compute_dtype(v.dtype)
    groups = qs.shape[1] // k.shape[1]
    qs, k, v = qs.to(compute), repeat_kv(k, groups).to(compute), repeat_kv(v, groups).to(compute)
    lq, lk = qs.shape[-2], k.shape[-2]
    score = mods.score_mod_for(spec, qs.shape[1], lq, lk, qs.device, compute)
    visible = mods.mask_mod_for(spec, lq, lk, mods.document_starts(spec, doc_ids), mask)
    x = logits(qs, k, score, visible, torch.arange(lq, device=qs.device), torch.arange(lk, device=qs.device))
    w, lse_1, lse_p = _p_softmax(x, spec.softmax_p, lse=return_lse)
    out = (w @ v).to(dtype)
    if return_weights:
        return out, w
    return (out, lse_1.squeeze(-1).detach(), lse_p.squeeze(-1).detach()) if return_lse else out


# ---------------------------------------------------------------------------------------------------
# modules' pure parts: QK-norm, RoPE, out-norm


def head_norm(x: torch.Tensor, kind: str, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (``rms``, x / sqrt(mean(x^2) + eps)) or LayerNorm without affine (``layer``) over the last axis,
    then an optional weight.

    As QK-norm (Dehghani et al. 2023): rms-normed q and k have norm sqrt(D), so q.k = D cos(q, k) and the
    default scale 1/sqrt(D) gives sqrt(D) cos (modded-nanogpt, seed 004). Seed 002's QKNorm (Henry et al. 2020) is
    cos / tau with a learnable scalar tau (init 1): ``rms`` with ``base_scale = 1/D``, where only the per-channel
    QK-norm weights learn a temperature. A finite eps keeps some norm information (seed 004: |x_hat|^2 =
    |x|^2 / (|x|^2/D + eps))."""
    if kind == "rms":
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    elif kind == "layer":
        x = F.layer_norm(x, x.shape[-1:], eps=eps)
    return x if weight is None else x * weight


def rope_frequencies(head_dim: int, theta: float, fraction: float = 1.0, device=None,
                     min_freq: float | None = None) -> torch.Tensor:
    """RoPE's (Su et al. 2021) rotation frequencies of the head_dim/2 pairs: ``theta^(-i / pairs)``, or with
    ``min_freq`` the rotated pairs' frequencies log-spaced from 1 down to ``min_freq``, both included
    (modded-nanogpt's half-truncated RoPE in seed 000: 32 of 64 pairs from 1 to 1/1024). p-RoPE (Barbero et al.
    2024, "Round and round we go") keeps only the highest-frequency ``fraction`` of the pairs,
    ``int(fraction * head_dim // 2)`` of them as in Gemma's ``apply_rope(rope_proportion=...)``; the rest get
    frequency 0 (no position)."""
    pairs = head_dim // 2
    rotated = int(fraction * head_dim // 2)
    freqs = theta ** (-torch.arange(pairs, device=device, dtype=torch.float32) / pairs)
    if min_freq is not None:
        freqs[:rotated] = min_freq ** torch.linspace(0, 1, rotated, device=device)
    freqs[rotated:] = 0.0
    return freqs


def apply_rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of (B, H, L, D) by angle pos * freq (half-split layout)."""
    angle = pos.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def out_norm(y: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """AVNorm (seed 000) on the attention output y of shape (B, H, L, D), before the heads are merged.

    ``head_layer`` equals ``GroupNorm(num_groups=H, affine=False)`` on (tokens, H*D); ``head_rms`` is per-head
    RMSNorm; ``global_*`` normalize over all heads together.
    """
    if kind == "none":
        return y
    norm = "layer" if kind.endswith("layer") else "rms"
    if kind.startswith("head"):
        return head_norm(y, norm, eps)
    b, h, length, d = y.shape
    flat = y.transpose(1, 2).reshape(b, length, h * d)
    return head_norm(flat, norm, eps).reshape(b, length, h, d).transpose(1, 2)
