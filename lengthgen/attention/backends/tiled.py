"""`tiled`: pure-PyTorch p-softmax attention in blocks, memory linear in length, any device.

Query blocks of Q rows meet key blocks of K keys laid out in *bands* counted back from each query block: band n
holds keys ``[e - nK, e - (n-1)K)``, ``e`` = the block's first position + Q. Every block of a band has the same
distances ``t = i - j``, so the spec's distance term is evaluated once per band (`mods.affine_terms`:
``logit = a_t s + bias_t``) and added with one fused op per block; the mask mods run only on blocks that a
causal, window, document or explicit boundary crosses. Bands are visited in turn with running statistics for
every query row (FlashAttention's online recurrence, Dao et al. 2022, generalized to p-softmax, seed 001): row
max ``m``, ``S_1 = sum exp(l - m)`` and ``S_p = sum exp(p (l - m))``::

    out   = (sum_j exp(l_j - m) v_j) * S_p^(-1/p)       LSE_1 = m + log S_1       LSE_p = p m + log S_p

The backward recomputes each block's logits (no (L, L) tensor is kept), with ``e = exp(l - m)`` and
``pi = exp(p (l - m))`` (no large logit is multiplied by p), from the weights ``w = e S_p^(-1/p)`` and their
Jacobian ``dw_j/dl_k = delta_jk w_j - w_j pi_k / S_p`` (differentiate ``w_j = exp(l_j) (sum_k exp(p l_k))^(-1/p)``)::

    dl_ij = w_ij (dO_i . v_j) - pi_ij (dO_i . out_i) / S_p      ds_ij = a_t dl_ij
    dq'_i = sum_j ds_ij k_j      dk_j = sum_i ds_ij q'_i      dv_j = sum_i w_ij dO_i

Speed on CPU: the G query heads of a key/value head (grouped-query attention) are stacked as rows of one
(B * Hkv) batch of matrix products (keys and values are never copied per head); block logits live in
scratch buffers reused by every block; masks are added as 0 / -inf for the row maxima and multiply the
exponentials as 0 / 1; ``exp`` sees nothing below the log of the dtype's smallest normal number (x86's
subnormal and -inf paths are 1.7-12x slower; such a weight, < 1e-38 in float32, vanishes next to the row
maximum's 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.spec import AttentionSpec

# Block sides: at L = 4K (1 thread; batch 1, 4 heads, head_dim 64) 64..256 rows x 256..1024 keys ran within
# 10% of each other (the noise of a shared machine) and 1024 x 1024 2x slower; 128 x 512 sits in the middle, its
# logits for 4 heads (1 MiB of float32) in a core's L2 cache.
QUERY_BLOCK = 128
KEY_BLOCK = 512


@dataclass(frozen=True)
class _Block:
    rows: slice          # query rows
    keys: slice          # key positions
    grid: tuple          # (rows, columns) of the band's term grid under this block
    masked: bool         # a mask boundary crosses the block


def _plan(first: torch.Tensor, lq: int, lk: int, q_block: int, k_block: int, explicit: bool) -> list:
    """[(band n, [blocks])]: the key blocks each query block can see (``first``: (B|1, Lq) first visible key of
    each row, `mods.first_visible`; ``explicit``: an explicit mask, every block masked), one host sync."""
    lo_rows, hi_rows = first.amin(0).tolist(), first.amax(0).tolist()
    off, bands = lk - lq, {}
    for qa in range(0, lq, q_block):
        qb = min(qa + q_block, lq)
        lo, hi_first, end = min(lo_rows[qa:qb]), max(hi_rows[qa:qb]), off + qa + q_block
        n = 1
        while end - (n - 1) * k_block > lo:
            ka, kb = max(end - n * k_block, lo), min(end - (n - 1) * k_block, off + qb)
            if ka < kb:
                col = ka - (end - n * k_block)
                masked = explicit or ka < hi_first or kb - 1 > off + qa
                bands.setdefault(n, []).append(
                    _Block(slice(qa, qb), slice(ka, kb), (slice(0, qb - qa), slice(col, col + kb - ka)), masked))
            n += 1
    return sorted(bands.items())


class _Work:
    """One call's shapes, scratch buffers and band terms. Layout: q (B, Hkv, G, Lq, D); k, v (B*Hkv, Lk, D);
    a block's logits (B*Hkv, G*q, k) for the matrix products, viewed (B, Hkv, G, q, k) for the rest."""

    def __init__(self, q, k, p: float, score_mod, mask_mod, blocks: tuple[int, int]) -> None:
        self.b, self.hkv, self.groups, self.lq = q.shape[:4]
        self.offset, self.score_mod, self.mask_mod, self.blocks = k.shape[1] - self.lq, score_mod, mask_mod, blocks
        self.p = p
        # exp(floor) is a normal number; for p = 2, exp(y)^2 too
        self.floor = (math.log(torch.finfo(q.dtype).tiny) + 1.0) / (2.0 if p == 2 else 1.0)
        block = min(blocks[0], self.lq) * min(blocks[1], k.shape[1])   # the largest block's logits per head
        self.scratch = [q.new_empty(self.b * self.hkv * self.groups * block) for _ in range(3)]

    def rows(self, x: torch.Tensor, blk: _Block) -> torch.Tensor:
        """Rows of a (B, Hkv, G, L, d) tensor as (B*Hkv, G*q, d) (a copy only when G > 1)."""
        return x[..., blk.rows, :].reshape(self.b * self.hkv, -1, x.shape[-1])

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """(B*Hkv, G*q, k) -> (B, Hkv, G, q, k)."""
        return x.view(self.b, self.hkv, self.groups, -1, x.shape[-1])

    def buffer(self, i: int, rows: int, cols: int) -> torch.Tensor:
        return self.scratch[i][: self.b * self.hkv * rows * cols].view(self.b * self.hkv, rows, cols)

    def terms(self, n: int):
        """Band n's (a, bias) grids, (1, Hkv|1, G|1, Q, K): its Q + K - 1 distances ``t = r - c - Q + nK``
        (row r, column c) evaluated once and spread over the grid; (None, None) without a distance term."""
        if self.score_mod is None:
            return None, None
        q_block, k_block = self.blocks
        device = self.scratch[0].device
        t = torch.arange(n * k_block - q_block - k_block + 1, n * k_block, device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        a, bias = mods.affine_terms(self.score_mod, self.hkv * self.groups, t - self.offset, zero,
                                    self.scratch[0].dtype)          # row t - offset is position t
        return self._grid(a), self._grid(bias)

    def _grid(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        x = x[..., 0].unfold(-1, self.blocks[1], 1).flip(-1).contiguous()   # (1, H|1, Q, K): x[r - c + K - 1]
        if x.shape[1] == 1:
            return x.unsqueeze(2)
        return x.reshape(1, self.hkv, self.groups, *x.shape[2:])     # head h = kv head * G + g

    def logits(self, q_rows, k, blk: _Block, a, bias) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's logits ``a_t s + bias_t`` (-inf where the mask mods hide the key) in scratch 0, (B, Hkv,
        G, q, k), and the masked block's 0 / 1 visibility (None when no boundary crosses it)."""
        keys = k[:, blk.keys]
        s = self.split(torch.bmm(q_rows, keys.transpose(1, 2), out=self.buffer(0, q_rows.shape[1], keys.shape[1])))
        r, c = blk.grid
        if a is not None:
            torch.addcmul(bias[..., r, c], s, a[..., r, c], out=s)
        elif bias is not None:
            s += bias[..., r, c]
        if blk.masked:
            device = s.device
            grid = mods.grids(self.b, 1, torch.arange(blk.rows.start, blk.rows.stop, device=device),
                              torch.arange(blk.keys.start, blk.keys.stop, device=device))
            visible = self.mask_mod(*grid).unsqueeze(2).to(s.dtype)
            s += mods.additive(visible, s.dtype)
            return s, visible
        return s, None

    def exp_(self, y: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """``exp(y)`` in place, 0 where hidden."""
        y = y.clamp_(min=self.floor).exp_()
        return y if visible is None else y.mul_(visible)

    def exp_p(self, y: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """``exp(p y)`` in scratch 1 (exp(p y), not exp(y)^p, which underflows first for p < 1)."""
        return self.exp_(torch.mul(y, self.p, out=self.scratch[1][: y.numel()].view(y.shape)), visible)

    def forward_sums(self, y: torch.Tensor, visible: torch.Tensor | None):
        """``e = exp(y)`` in place and the block's row sums of e and of ``exp(p y)`` (the same tensor for p = 1)."""
        if self.p not in (1, 2):
            sum_p = self.exp_p(y, visible).sum(-1, keepdim=True)
        e = self.exp_(y, visible)
        sum_1 = e.sum(-1, keepdim=True)
        if self.p in (1, 2):
            sum_p = sum_1 if self.p == 1 else e.square().sum(-1, keepdim=True)
        return e, sum_1, sum_p

    def logit_grad(self, y: torch.Tensor, visible: torch.Tensor | None, dl: torch.Tensor, delta: torch.Tensor):
        """``e = exp(y)`` in place and, in place of ``dl = dO'_i . v_j``, ``e_ij dl_ij - exp(p y_ij) delta'_i``."""
        pi = self.exp_p(y, visible) if self.p not in (1, 2) else None
        e = self.exp_(y, visible)
        if self.p == 1:
            dl.sub_(delta).mul_(e)
        elif self.p == 2:
            dl.addcmul_(e, delta, value=-1.0).mul_(e)
        else:
            dl.mul_(e).addcmul_(pi, delta, value=-1.0)
        return e, dl


class _TiledPSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p, score_mod, mask_mod, plan, blocks):
        work = _Work(q, k, p, score_mod, mask_mod, blocks)
        stats = q.new_zeros((3,) + q.shape[:-1] + (1,))              # row max, S_1, S_p: (B, Hkv, G, Lq, 1)
        m, s1, sp = stats.unbind(0)
        m.fill_(float("-inf"))
        acc = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        for n, band in plan:
            a, bias = work.terms(n)
            for blk in band:
                q_rows = work.rows(q, blk)
                y, visible = work.logits(q_rows, k, blk, a, bias)
                m_blk = m[..., blk.rows, :]
                m_new = torch.maximum(m_blk, y.amax(-1, keepdim=True))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # rows that saw nothing
                corr = torch.exp(m_blk - m_safe)
                y -= m_safe
                e, sum_1, sum_p = work.forward_sums(y, visible)
                s1[..., blk.rows, :].mul_(corr).add_(sum_1)
                if p != 1:
                    sp[..., blk.rows, :].mul_(corr.pow(p)).add_(sum_p)
                pv = torch.bmm(e.view(q_rows.shape[0], -1, e.shape[-1]), v[:, blk.keys])
                acc[..., blk.rows, :].mul_(corr).add_(work.split(pv))
                m[..., blk.rows, :] = m_new
        if p == 1:
            sp = s1
        seen = sp > 0                                                # rows that see some key
        scale = torch.where(seen, sp, torch.ones_like(sp)).pow(-1.0 / p) * seen          # S_p^(-1/p); 0 if none
        out = acc * scale
        lse_1, lse_p = m + torch.log(s1), p * m + torch.log(sp)
        ctx.save_for_backward(q, k, v, out, torch.where(seen, m, torch.zeros_like(m)), scale)
        ctx.p, ctx.mods, ctx.plan, ctx.blocks = p, (score_mod, mask_mod), plan, blocks
        ctx.mark_non_differentiable(lse_1, lse_p)
        return out, lse_1, lse_p

    @staticmethod
    def backward(ctx, d_out, _d_lse1, _d_lsep):
        q, k, v, out, m, scale = ctx.saved_tensors
        p, work = ctx.p, _Work(q, k, ctx.p, *ctx.mods, ctx.blocks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (d_out * out).sum(-1, keepdim=True) * scale.pow(p)   # (dO_i . out_i) / S_p
        d_scaled = d_out * scale                                     # dO_i S_p^(-1/p): w = e S_p^(-1/p)
        for n, band in ctx.plan:
            a, bias = work.terms(n)
            for blk in band:
                q_rows, do = work.rows(q, blk), work.rows(d_scaled, blk)
                y, visible = work.logits(q_rows, k, blk, a, bias)
                y -= m[..., blk.rows, :]                                                     # <= 0
                shape = (q_rows.shape[1], y.shape[-1])
                dl = work.split(torch.bmm(do, v[:, blk.keys].transpose(1, 2), out=work.buffer(2, *shape)))
                e, dl = work.logit_grad(y, visible, dl, delta[..., blk.rows, :])
                e3 = e.view(q_rows.shape[0], *shape)
                dv[:, blk.keys].baddbmm_(e3.transpose(1, 2), do)
                if a is not None:
                    dl.mul_(a[..., blk.grid[0], blk.grid[1]])
                dl3 = dl.view(q_rows.shape[0], *shape)
                dk[:, blk.keys].baddbmm_(dl3.transpose(1, 2), q_rows)
                dq[..., blk.rows, :] += work.split(torch.bmm(dl3, k[:, blk.keys]))
        return dq, dk, dv, None, None, None, None, None


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    return None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
              q_block: int | None = None, k_block: int | None = None, return_lse: bool = False):
    """Blocked p-softmax attention for scaled queries ``qs`` (B, H, Lq, D) and keys/values (B, Hkv, Lk, D).

    ``mask``: an explicit (B, 1, Lq, Lk) visibility (a row that sees nothing outputs 0). ``q_block`` /
    ``k_block``: block sides, default `QUERY_BLOCK` x `KEY_BLOCK`. Half-precision inputs are computed in
    float32; ``out`` has v's dtype. Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (see `backends`).
    """
    q_block, k_block = q_block or QUERY_BLOCK, k_block or KEY_BLOCK
    dtype, compute = v.dtype, fn.compute_dtype(v.dtype)
    b, h, lq, d = qs.shape
    hkv, lk = k.shape[1], k.shape[2]
    starts = mods.document_starts(spec, doc_ids)
    score_mod = mods.score_mod_for(spec, h, lq, lk, qs.device, compute)
    mask_mod = mods.mask_mod_for(spec, lq, lk, starts, mask)
    plan = _plan(mods.first_visible(spec, lq, lk, starts, qs.device), lq, lk, q_block, k_block, mask is not None)
    q5 = qs.to(compute).reshape(b, hkv, h // hkv, lq, d)
    k3, v3 = (t.to(compute).reshape(b * hkv, lk, t.shape[-1]) for t in (k, v))
    out, lse_1, lse_p = _TiledPSoftmax.apply(q5, k3, v3, float(spec.softmax_p), score_mod, mask_mod, plan,
                                             (q_block, k_block))
    out = out.reshape(b, h, lq, v.shape[-1]).to(dtype)
    if not return_lse:
        return out
    return out, lse_1.reshape(b, h, lq), lse_p.reshape(b, h, lq)
