"""`tiled`: pure-PyTorch p-softmax attention in blocks, memory linear in length, any device.

Query blocks are independent; within one, key blocks are visited with an online running max ``m`` and
running sums ``S_1 = sum exp(l - m)`` and ``S_p = sum exp(p (l - m))`` (FlashAttention's recurrence, Dao et
al. 2022, generalized to p-softmax, seed 001). At the end::

    out   = (sum_j exp(l_j - m) v_j) * S_p^(-1/p)       LSE_1 = m + log S_1       LSE_p = p m + log S_p

The backward recomputes each block's logits from LSE_p (no (L, L) tensor is stored). With
``w = exp(l - LSE_p/p)`` and ``pi = exp(p l - LSE_p)`` (= softmax(p l)), the logit gradient is
``dl_ij = w_ij (dO_i . v_j) - pi_ij (dO_i . out_i)``; derived by differentiating
``w_j = exp(l_j) (sum_k exp(p l_k))^(-1/p)``: ``dw_j/dl_k = delta_jk w_j - w_j pi_k``.
"""

from __future__ import annotations

import torch

from lengthgen.attention import functional as fn
from lengthgen.attention.spec import AttentionSpec

QUERY_BLOCK = 256
KEY_BLOCK = 512
# Default blocks grow from QUERY_BLOCK x KEY_BLOCK up to about this many logits per block (batch * heads *
# q_block * k_block; 16 MiB in float32) and at most MAX_BLOCK a side. Few, large kernels matter on CPU:
# each op is a parallel region whose thread sync dominates when cores are shared (at L=4K, B*H=4, 2 threads
# on a busy 2-core machine: 256 x 512 blocks took ~9 s per step, 1024 x 1024 ~1.4 s; equal on 1 thread).
BLOCK_ELEMENTS = 1 << 22
MAX_BLOCK = 1024


def default_blocks(batch_heads: int) -> tuple[int, int]:
    """(q_block, k_block) for ``batch_heads`` = batch * heads: doubled (query side first) from the minimum
    QUERY_BLOCK x KEY_BLOCK while a block stays within BLOCK_ELEMENTS logits and MAX_BLOCK a side."""
    qb, kb = QUERY_BLOCK, KEY_BLOCK
    while batch_heads * qb * kb * 2 <= BLOCK_ELEMENTS and min(qb, kb) < MAX_BLOCK:
        if qb < kb:
            qb *= 2
        else:
            kb *= 2
    return qb, kb


def _key_range(q0: int, q1: int, spec: AttentionSpec, starts: torch.Tensor | None) -> tuple[int, int]:
    """Keys [lo, hi) any query in absolute positions [q0, q1) can see."""
    lo = 0 if spec.window is None else max(0, q0 - spec.window + 1)
    if starts is not None:
        lo = max(lo, int(starts[:, q0].min()))
    return lo, q1


def _blocks(lq: int, lk: int, spec: AttentionSpec, starts, q_block: int, k_block: int):
    """Yield (query slice, [(key slice), ...]) in absolute positions; queries are the last lq of lk."""
    off = lk - lq
    for qa in range(0, lq, q_block):
        qb = min(qa + q_block, lq)
        lo, hi = _key_range(off + qa, off + qb, spec, starts)
        yield slice(qa, qb), [slice(ka, min(ka + k_block, hi)) for ka in range(lo, hi, k_block)]


class _TiledPSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qs, k, v, spec, q_run, k_run, starts, q_block, k_block):
        p = spec.softmax_p
        b, h, lq, _ = qs.shape
        lk = k.shape[-2]
        q_pos_all, k_pos_all = fn.positions(lq, lk, qs.device)
        out = qs.new_empty(b, h, lq, v.shape[-1])
        lse_1 = qs.new_empty(b, h, lq, 1)
        lse_p = qs.new_empty(b, h, lq, 1)
        for qsl, key_slices in _blocks(lq, lk, spec, starts, q_block, k_block):
            q_blk, q_pos = qs[:, :, qsl], q_pos_all[qsl]
            qr = None if q_run is None else q_run[:, qsl]
            m = qs.new_full((b, h, q_blk.shape[2], 1), float("-inf"))
            s1 = torch.zeros_like(m)
            sp = torch.zeros_like(m)
            acc = qs.new_zeros(b, h, q_blk.shape[2], v.shape[-1])
            for ksl in key_slices:
                kr = None if k_run is None else k_run[:, ksl]
                logit = fn.logits(q_blk, k[:, :, ksl], q_pos, k_pos_all[ksl], spec, qr, kr)
                m_new = torch.maximum(m, logit.amax(-1, keepdim=True))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                corr = torch.exp(m - m_safe)
                e = torch.exp(logit - m_safe)
                acc = acc * corr + e @ v[:, :, ksl]
                s1 = s1 * corr + e.sum(-1, keepdim=True)
                if p != 1:                                           # S_p = S_1 for softmax
                    sp = sp * corr.pow(p) + e.pow(p).sum(-1, keepdim=True)
                m = m_new
            if p == 1:
                sp = s1
            out[:, :, qsl] = acc * sp.pow(-1.0 / p)
            lse_1[:, :, qsl] = m + torch.log(s1)
            lse_p[:, :, qsl] = p * m + torch.log(sp)
        ctx.save_for_backward(qs, k, v, out, lse_p, q_run, k_run, starts)
        ctx.spec, ctx.blocks = spec, (q_block, k_block)
        ctx.mark_non_differentiable(lse_1, lse_p)
        return out, lse_1, lse_p

    @staticmethod
    def backward(ctx, d_out, _d_lse1, _d_lsep):
        qs, k, v, out, lse_p, q_run, k_run, starts = ctx.saved_tensors
        spec, p = ctx.spec, ctx.spec.softmax_p
        lq, lk = qs.shape[-2], k.shape[-2]
        q_pos_all, k_pos_all = fn.positions(lq, lk, qs.device)
        dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        delta = (d_out * out).sum(-1, keepdim=True)                 # dO_i . out_i
        for qsl, key_slices in _blocks(lq, lk, spec, starts, *ctx.blocks):
            q_blk, q_pos, do = qs[:, :, qsl], q_pos_all[qsl], d_out[:, :, qsl]
            qr = None if q_run is None else q_run[:, qsl]
            lp, dl_blk = lse_p[:, :, qsl], delta[:, :, qsl]
            for ksl in key_slices:
                kr = None if k_run is None else k_run[:, ksl]
                k_pos = k_pos_all[ksl]
                logit = fn.logits(q_blk, k[:, :, ksl], q_pos, k_pos, spec, qr, kr)
                w = torch.exp(logit - lp / p)
                pi = w if p == 1 else torch.exp(p * logit - lp)
                dlogit = w * (do @ v[:, :, ksl].transpose(-1, -2)) - pi * dl_blk
                t = (q_pos[:, None] - k_pos[None, :]).clamp(min=0).to(logit.dtype)
                a = fn.distance_scale(t, spec)
                ds = dlogit if a is None else dlogit * a
                dq[:, :, qsl] += ds @ k[:, :, ksl]
                dk[:, :, ksl] += ds.transpose(-1, -2) @ q_blk
                dv[:, :, ksl] += w.transpose(-1, -2) @ do
        return dq, dk, dv, None, None, None, None, None, None


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool) -> str | None:
    return None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                    doc_ids: torch.Tensor | None = None, *, q_block: int | None = None,
                    k_block: int | None = None, return_lse: bool = False):
    """Blocked p-softmax attention for scaled queries ``qs`` (B, H, Lq, D) and keys/values (B, Hkv, Lk, D).

    ``q_block`` / ``k_block``: block sizes, default `default_blocks` (B * H).

    Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (each LSE (B, H, Lq, 1)).
    """
    auto_q, auto_k = default_blocks(qs.shape[0] * qs.shape[1])
    q_block, k_block = q_block or auto_q, k_block or auto_k
    compute = torch.float32 if qs.dtype in (torch.float16, torch.bfloat16) else qs.dtype
    groups = qs.shape[1] // k.shape[1]
    k, v = fn.repeat_kv(k, groups).to(compute), fn.repeat_kv(v, groups).to(compute)
    q_run, k_run = fn.runs(doc_ids, spec, qs.shape[-2])
    starts = fn.segments(doc_ids)[1] if q_run is not None else None
    out, lse_1, lse_p = _TiledPSoftmax.apply(qs.to(compute), k, v, spec, q_run, k_run, starts, q_block, k_block)
    out = out.to(qs.dtype)
    return (out, lse_1, lse_p) if return_lse else out
