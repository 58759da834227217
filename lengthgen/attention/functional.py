"""The whole math of one attention layer, as small pure functions.

For query position i, visible keys j, distance t = i - j and n_i = number of keys visible to query i::

    s_ij     = (q_i . k_j) * base_scale
    logit_ij = g_i * a_t * s_ij + bias_t
    w_ij     = exp(logit_ij) / (sum_j exp(p * logit_ij))^(1/p)
    out_i    = sum_j w_ij v_j

``g_i`` depends on n_i only, so it is folded into the queries (`scale_queries`) before any backend runs;
backends then see ``logit_ij = a_t * (q'_i . k_j) + bias_t`` with the masks, and the p-softmax.

Queries are the *last* ``Lq`` positions of the ``Lk`` keys (``Lq == Lk`` in training; ``Lq < Lk`` when
decoding with a cache). Documents are contiguous runs of equal ``doc_ids``: packing produces them, and a
left-padded batch is two documents (padding, then text).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lengthgen.attention.spec import AttentionSpec

# ---------------------------------------------------------------------------------------------------
# positions, documents, masks


def segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run index and run start of each position for (B, L) ``doc_ids``: documents are contiguous runs."""
    length = doc_ids.shape[-1]
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    run = change.long().cumsum(-1) - 1
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)
    start = torch.where(change, index, torch.zeros_like(index)).cummax(-1).values
    return run, start


def visible_counts(lq: int, lk: int, spec: AttentionSpec, doc_ids: torch.Tensor | None = None,
                   device: torch.device | None = None) -> torch.Tensor:
    """n_i, the number of keys query i sees (causal, same document, inside the window): (B or 1, Lq) float."""
    pos = torch.arange(lk - lq, lk, device=device)
    if spec.doc_masking and doc_ids is not None:
        _, start = segments(doc_ids)
        n = pos - start[:, lk - lq:] + 1
    else:
        n = (pos + 1).unsqueeze(0)
    if spec.window is not None:
        n = n.clamp(max=spec.window)
    return n.float()


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: AttentionSpec,
               q_run: torch.Tensor | None = None, k_run: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask (..., Lq, Lk): causal, inside the window, same document (runs given as (B, L))."""
    t = q_pos[:, None] - k_pos[None, :]
    mask = t >= 0
    if spec.window is not None:
        mask = mask & (t < spec.window)
    if q_run is not None and k_run is not None:
        mask = mask & (q_run[:, :, None] == k_run[:, None, :])
        return mask[:, None]                      # (B, 1, Lq, Lk)
    return mask                                   # (Lq, Lk)


# ---------------------------------------------------------------------------------------------------
# query-length scaling g_i


def query_gain(n: torch.Tensor, spec: AttentionSpec, multiplier: torch.Tensor | float | None = None
               ) -> torch.Tensor | None:
    """g_i as a function of n_i, or None when it is 1.

    * ``log_n``: ``g = s log n`` (Scalable-Softmax, Nakanishi 2025, arXiv 2501.19399).
    * ``sqrt_log_n``: ``g = a + r sqrt(2 log(b n + c))`` (seed 004: the extreme-value scale of the maximum
      of n Gaussian logits, with the seed's tuned a=0, b=0.1, c=1.9).

    ``n``: (B, Lq); ``multiplier`` (s or r): a float, a scalar tensor or a (H,) tensor. Returns (B, H|1, Lq, 1).
    """
    if spec.query_scaling == "none":
        return None
    m = spec.scaling_init if multiplier is None else multiplier
    m = torch.as_tensor(m, dtype=n.dtype, device=n.device).reshape(1, -1, 1, 1)
    n = n[:, None, :, None]
    if spec.query_scaling == "log_n":
        return m * torch.log(n)
    return spec.scaling_a + m * torch.sqrt(2 * torch.log(spec.scaling_b * n + spec.scaling_c))


def scale_queries(q: torch.Tensor, spec: AttentionSpec, lk: int, doc_ids: torch.Tensor | None = None,
                  multiplier: torch.Tensor | float | None = None) -> torch.Tensor:
    """q' = q * g_i * base_scale: the part of the logit that depends on the query only."""
    base = spec.base_scale if spec.base_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    n = visible_counts(q.shape[-2], lk, spec, doc_ids, device=q.device)
    g = query_gain(n.to(q.dtype), spec, multiplier)
    return q * base if g is None else q * (g * base)


# ---------------------------------------------------------------------------------------------------
# distance terms a_t, bias_t


def alibi_slopes(heads: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """ALiBi slopes m_h = 2^(-8(h+1)/H) (Press, Smith, Lewis 2022)."""
    h = torch.arange(1, heads + 1, device=device, dtype=dtype)
    return torch.pow(2.0, -8.0 * h / heads)


def distance_scale(t: torch.Tensor, spec: AttentionSpec) -> torch.Tensor | None:
    """a_t, or None when it is 1. ``scale_invariant``: ``sqrt(1 + 2 log(1 + t/tau))`` (Anson, Wang, Aitchison
    2025, "Scale-invariant attention"). ``t`` must be >= 0 (clamp masked entries first)."""
    if spec.distance != "scale_invariant":
        return None
    return torch.sqrt(1 + 2 * torch.log1p(t / spec.tau))


def distance_bias(t: torch.Tensor, spec: AttentionSpec, heads: int) -> torch.Tensor | None:
    """bias_t with a leading head axis (H|1, *t.shape), or None when it is 0.

    * ``scale_invariant``: ``-2 log(1 + t/tau)`` (Anson et al. 2025)
    * ``alibi``: ``-m_h t`` (Press et al. 2022)
    * ``log_bias``: ``-lambda log(1 + t/tau)`` (seed 004)
    """
    if spec.distance == "scale_invariant":
        return (-2 * torch.log1p(t / spec.tau)).unsqueeze(0)
    if spec.distance == "log_bias":
        return (-spec.log_bias_lambda * torch.log1p(t / spec.tau)).unsqueeze(0)
    if spec.distance == "alibi":
        slopes = alibi_slopes(heads, device=t.device, dtype=t.dtype)
        return -slopes.view(-1, *([1] * t.dim())) * t.unsqueeze(0)
    return None


def logits(qs: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, spec: AttentionSpec,
           q_run: torch.Tensor | None = None, k_run: torch.Tensor | None = None) -> torch.Tensor:
    """Masked logits ``a_t (q'_i . k_j) + bias_t`` (-inf where not visible) for scaled queries q'.

    qs: (B, H, Lq, D); k: (B, H, Lk, D) (already expanded for GQA). Returns (B, H, Lq, Lk).
    """
    s = qs @ k.transpose(-1, -2)
    t = (q_pos[:, None] - k_pos[None, :]).clamp(min=0).to(s.dtype)
    a = distance_scale(t, spec)
    if a is not None:
        s = s * a
    bias = distance_bias(t, spec, qs.shape[1])
    if bias is not None:
        s = s + bias
    mask = visibility(q_pos, k_pos, spec, q_run, k_run)
    return s.masked_fill(~mask, float("-inf"))


# ---------------------------------------------------------------------------------------------------
# p-softmax


def p_softmax(x: torch.Tensor, p: float = 1.0, dim: int = -1) -> torch.Tensor:
    """``exp(x) / ||exp(x)||_p`` computed stably as ``exp(x - LSE(p x) / p)`` (seed 001). p=1 is softmax.

    -inf entries get weight 0. Weights sum to 1 for p=1; their squares sum to 1 for p=2.
    """
    return torch.exp(x - torch.logsumexp(p * x, dim=dim, keepdim=True) / p)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Expand (B, Hkv, L, D) keys/values to (B, Hkv*groups, L, D) for grouped-query attention."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def positions(lq: int, lk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute query positions (the last Lq of Lk) and key positions."""
    return torch.arange(lk - lq, lk, device=device), torch.arange(lk, device=device)


def runs(doc_ids: torch.Tensor | None, spec: AttentionSpec, lq: int) -> tuple[torch.Tensor | None, ...]:
    """(query runs, key runs) for document masking, or (None, None)."""
    if not spec.doc_masking or doc_ids is None:
        return None, None
    run, _ = segments(doc_ids)
    return run[:, run.shape[1] - lq:], run


def dense_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                    doc_ids: torch.Tensor | None = None, return_weights: bool = False):
    """The oracle: materializes the (Lq, Lk) weights. ``qs`` are queries already scaled by `scale_queries`."""
    groups = qs.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    q_pos, k_pos = positions(qs.shape[-2], k.shape[-2], qs.device)
    q_run, k_run = runs(doc_ids, spec, qs.shape[-2])
    w = p_softmax(logits(qs, k, q_pos, k_pos, spec, q_run, k_run), spec.softmax_p)
    out = w @ v
    return (out, w) if return_weights else out


# ---------------------------------------------------------------------------------------------------
# modules' pure parts: QK-norm, RoPE, out-norm


def head_norm(x: torch.Tensor, kind: str, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (``rms``) or LayerNorm without affine (``layer``) over the last axis, then an optional weight."""
    if kind == "rms":
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    elif kind == "layer":
        x = F.layer_norm(x, x.shape[-1:], eps=eps)
    return x if weight is None else x * weight


def rope_frequencies(head_dim: int, theta: float, fraction: float = 1.0, device=None) -> torch.Tensor:
    """Rotation frequencies of the head_dim/2 pairs. p-RoPE (Barbero et al. 2024, "Round and round we go")
    keeps only the highest-frequency ``fraction`` of the pairs; the rest get frequency 0 (no position)."""
    pairs = head_dim // 2
    freqs = theta ** (-torch.arange(pairs, device=device, dtype=torch.float32) / pairs)
    rotated = round(fraction * pairs)
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
