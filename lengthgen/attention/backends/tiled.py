"""`tiled`: pure-PyTorch p-softmax attention in blocks, memory linear in length, any device.

Query blocks are independent; within one, the key blocks it can see (from `mods.first_visible`) are visited
with an online running max ``m`` and running sums ``S_1 = sum exp(l - m)`` and ``S_p = sum exp(p (l - m))``
(FlashAttention's recurrence, Dao et al. 2022, generalized to p-softmax, seed 001). Each block's logits are
`functional.logits`: the spec's score and mask mods on the block's index grids. At the end::

    out   = (sum_j exp(l_j - m) v_j) * S_p^(-1/p)       LSE_1 = m + log S_1       LSE_p = p m + log S_p

The backward recomputes each block's logits (no (L, L) tensor is stored) and keeps m and log S_p apart, so
that no large logit is multiplied by p. With ``w = exp((l - m) - log S_p / p)`` and
``pi = exp(p (l - m) - log S_p)`` (= softmax(p l)), the logit gradient is
``dl_ij = w_ij (dO_i . v_j) - pi_ij (dO_i . out_i)``; derived by differentiating
``w_j = exp(l_j) (sum_k exp(p l_k))^(-1/p)``: ``dw_j/dl_k = delta_jk w_j - w_j pi_k``. The gradient through
the block's logits to q' and k (``a_t`` of the score mod included) is autograd's, on the same mods.
"""

from __future__ import annotations

import torch

from lengthgen.attention import functional as fn
from lengthgen.attention import mods
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


def _blocks(first: torch.Tensor, lq: int, lk: int, q_block: int, k_block: int) -> list:
    """[(query rows, [key slices])]: the key blocks of [min first visible key, last query position] per query
    block (one host sync for all blocks)."""
    first = first.amin(0).tolist()
    off, blocks = lk - lq, []
    for qa in range(0, lq, q_block):
        qb = min(qa + q_block, lq)
        lo, hi = min(first[qa:qb]), off + qb
        blocks.append((slice(qa, qb), [slice(ka, min(ka + k_block, hi)) for ka in range(lo, hi, k_block)]))
    return blocks


def _index(sl: slice, device) -> torch.Tensor:
    return torch.arange(sl.start, sl.stop, device=device)


class _TiledPSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qs, k, v, p, score_mod, mask_mod, blocks):
        b, h, lq, _ = qs.shape
        out = qs.new_empty(b, h, lq, v.shape[-1])
        lse_1 = qs.new_empty(b, h, lq, 1)
        lse_p = qs.new_empty(b, h, lq, 1)
        row_max, log_sp = torch.empty_like(lse_p), torch.empty_like(lse_p)
        for qsl, key_slices in blocks:
            q_blk, rows = qs[:, :, qsl], _index(qsl, qs.device)
            m = qs.new_full((b, h, q_blk.shape[2], 1), float("-inf"))
            s1 = torch.zeros_like(m)
            sp = torch.zeros_like(m)
            acc = qs.new_zeros(b, h, q_blk.shape[2], v.shape[-1])
            for ksl in key_slices:
                logit = fn.logits(q_blk, k[:, :, ksl], score_mod, mask_mod, rows, _index(ksl, qs.device))
                m_new = torch.maximum(m, logit.amax(-1, keepdim=True))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                corr = torch.exp(m - m_safe)
                e = torch.exp(logit - m_safe)
                acc = acc * corr + e @ v[:, :, ksl]
                s1 = s1 * corr + e.sum(-1, keepdim=True)
                if p != 1:     # S_p = S_1 for softmax; exp(p x), not exp(x)^p, which underflows first for p < 1
                    sp = sp * torch.exp(p * (m - m_safe)) + torch.exp(p * (logit - m_safe)).sum(-1, keepdim=True)
                m = m_new
            if p == 1:
                sp = s1
            out[:, :, qsl] = acc * torch.where(sp > 0, sp, torch.ones_like(sp)).pow(-1.0 / p)  # 0 if nothing seen
            lse_1[:, :, qsl] = m + torch.log(s1)
            lse_p[:, :, qsl] = p * m + torch.log(sp)
            row_max[:, :, qsl], log_sp[:, :, qsl] = m, torch.log(sp)
        finite = torch.isfinite(row_max)                           # rows that see nothing: w = 0 in the backward
        row_max = torch.where(finite, row_max, torch.zeros_like(row_max))
        log_sp = torch.where(finite, log_sp, torch.zeros_like(log_sp))
        ctx.save_for_backward(qs, k, v, out, row_max, log_sp)
        ctx.p, ctx.mods, ctx.blocks = p, (score_mod, mask_mod), blocks
        ctx.mark_non_differentiable(lse_1, lse_p)
        return out, lse_1, lse_p

    @staticmethod
    def backward(ctx, d_out, _d_lse1, _d_lsep):
        qs, k, v, out, row_max, log_sp = ctx.saved_tensors
        p, (score_mod, mask_mod) = ctx.p, ctx.mods
        dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        delta = (d_out * out).sum(-1, keepdim=True)                 # dO_i . out_i
        for qsl, key_slices in ctx.blocks:
            rows, do = _index(qsl, qs.device), d_out[:, :, qsl]
            m, lsp, dl_blk = row_max[:, :, qsl], log_sp[:, :, qsl], delta[:, :, qsl]
            for ksl in key_slices:
                q_blk = qs[:, :, qsl].detach().requires_grad_()
                k_blk = k[:, :, ksl].detach().requires_grad_()
                with torch.enable_grad():
                    logit = fn.logits(q_blk, k_blk, score_mod, mask_mod, rows, _index(ksl, qs.device))
                y = logit.detach() - m                  # <= 0: p y and exp never see a large logit
                w = torch.exp(y - lsp / p)
                pi = w if p == 1 else torch.exp(p * y - lsp)
                dlogit = w * (do @ v[:, :, ksl].transpose(-1, -2)) - pi * dl_blk
                dq_blk, dk_blk = torch.autograd.grad(logit, (q_blk, k_blk), dlogit)
                dq[:, :, qsl] += dq_blk
                dk[:, :, ksl] += dk_blk
                dv[:, :, ksl] += w.transpose(-1, -2) @ do
        return dq, dk, dv, None, None, None, None


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    return None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
              q_block: int | None = None, k_block: int | None = None, return_lse: bool = False):
    """Blocked p-softmax attention for scaled queries ``qs`` (B, H, Lq, D) and keys/values (B, Hkv, Lk, D).

    ``mask``: an explicit (B, 1, Lq, Lk) visibility (a row that sees nothing outputs 0). ``q_block`` /
    ``k_block``: block sizes, default `default_blocks` (B * H). Half-precision inputs are computed in
    float32; ``out`` has v's dtype. Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (see `backends`).
    """
    auto_q, auto_k = default_blocks(qs.shape[0] * qs.shape[1])
    q_block, k_block = q_block or auto_q, k_block or auto_k
    dtype, compute = v.dtype, fn.compute_dtype(v.dtype)
    groups = qs.shape[1] // k.shape[1]
    k, v = fn.repeat_kv(k, groups).to(compute), fn.repeat_kv(v, groups).to(compute)
    lq, lk = qs.shape[-2], k.shape[-2]
    starts = mods.document_starts(spec, doc_ids)
    score_mod = mods.score_mod_for(spec, qs.shape[1], lq, lk, qs.device, compute)
    mask_mod = mods.mask_mod_for(spec, lq, lk, starts, mask)
    blocks = _blocks(mods.first_visible(spec, lq, lk, starts, qs.device), lq, lk, q_block, k_block)
    out, lse_1, lse_p = _TiledPSoftmax.apply(qs.to(compute), k, v, float(spec.softmax_p), score_mod, mask_mod,
                                             blocks)
    out = out.to(dtype)
    return (out, lse_1.squeeze(-1), lse_p.squeeze(-1)) if return_lse else out
