"""`cpu_flash`: SDPA's CPU flash kernel on query blocks, for softmax attention (p = 1) whose logits are
``q'_i . k_j + bias_t``: ALiBi, log-bias, windows, documents, explicit masks, memory linear in length.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel behind ``F.scaled_dot_product_attention``
on CPU) returns the softmax output and its LSE under an additive float mask, and its ``_backward`` takes them
back. Plain causal attention (no window, documents, explicit mask or distance term; Lq = Lk) is one call.
Otherwise each block of `QUERY_BLOCK` query rows attends to the keys it can see (`mods.first_visible`) under an
additive mask: ``bias_t`` (`mods.affine_terms`) where the mask mods show the key, -inf elsewhere. The part that
depends on ``t = i - j`` only (bias, causal, window) is one (H|1, Q, W) table whose slices are the blocks'
masks; documents and explicit masks are added per block. Keys and values are never copied per query head (the
kernel takes grouped-query attention); a value head_dim other than the queries' is zero-padded to the larger.

Not here: ``scale_invariant`` multiplies the logits by ``a_t``, which an additive mask cannot; ``p != 1`` through
``out_p = out_1 * exp(LSE_1 - LSE_p / p)`` with a second call for LSE_p costs 2x a softmax call (measured), no
less than `tiled`, and that factor, a difference of two LSEs of the logits' size, loses float32 precision at
large logits or p (the gradient at p = 100, and every output at logits of 1e7, failed the float64 oracle's
tolerance). Both run on `tiled`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.spec import AttentionSpec

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# Query rows per call: 128 was the fastest or within 7% of 64..1024 (ALiBi, documents, window L/4; L 1K-4K;
# head_dim 16 and 64; 1 thread); larger blocks compute more of the masked triangle, smaller ones call more often.
QUERY_BLOCK = 128


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    """Why this backend cannot run ``spec`` on ``q``, or None."""
    if q.device.type != "cpu":
        return f"runs on CPU only (SDPA's CPU flash kernel), not {q.device.type}"
    if spec.softmax_p != 1:
        return f"softmax_p={spec.softmax_p} (cpu_flash computes p=1 only; use tiled)"
    if spec.distance == "scale_invariant":
        return "distance='scale_invariant' multiplies the logits by a_t (the kernel only adds a mask; use tiled)"
    return None


class _Blocks:
    """The calls of one attention: query rows, key range and additive mask of each (one call without masks
    for plain causal attention)."""

    def __init__(self, spec: AttentionSpec, q: torch.Tensor, lk: int, starts, mask, q_block: int) -> None:
        b, heads, lq, _ = q.shape
        self.causal = lq == lk and spec.window is None and starts is None and mask is None and \
            not spec.has_distance_terms
        if self.causal:
            self.calls = [(slice(0, lq), slice(0, lk), False)]
            return
        q_block = min(q_block, lq)
        first = mods.first_visible(spec, lq, lk, starts, q.device)
        lo_rows, hi_rows, off = first.amin(0).tolist(), first.amax(0).tolist(), lk - lq
        self.calls = []
        for qa in range(0, lq, q_block):
            qb = min(qa + q_block, lq)
            lo = min(lo_rows[qa:qb])
            self.calls.append((slice(qa, qb), slice(lo, off + qb), mask is not None or max(hi_rows[qa:qb]) > lo))
        self.q_block, self.offset, self.batch = q_block, off, b
        self.width = max(off + rows.start + q_block - keys.start for rows, keys, _ in self.calls)
        self.mask_mod = mods.mask_mod_for(spec, lq, lk, starts, mask)
        self.table = self._table(spec, heads, lq, lk, q.dtype, q.device)

    def _table(self, spec, heads, lq, lk, dtype, device) -> torch.Tensor:
        """(1, H|1, Q, W): entry (r, c) holds distance ``t = r - c + W - Q``: bias_t where causal and window
        show the key, else -inf. Row r, key j of the block at rows qa.. is entry (r, j - (off + qa + Q - W))."""
        t = torch.arange(1 - self.q_block, self.width, device=device)         # every distance of the table
        rows, zero = t - (lk - lq), torch.zeros(1, dtype=torch.long, device=device)   # row t - off is position t
        grid = mods.grids(1, 1, rows, zero)
        visible = mods.mask_mod_for(spec, lq, lk)(*grid)
        score_mod = mods.score_mod_for(spec, heads, lq, lk, device, dtype)
        a, bias = (None, torch.zeros((), dtype=dtype, device=device)) if score_mod is None else \
            mods.affine_terms(score_mod, heads, rows, zero, dtype)
        if a is not None:           # a term `unsupported` does not know yet: never drop a_t silently
            raise ValueError(f"backend 'cpu_flash' cannot run distance={spec.distance!r}: its score mod multiplies "
                             "the score (a_t != 1), which an additive mask cannot; refuse it in "
                             "cpu_flash.unsupported, as scale_invariant, or use tiled")
        values = torch.where(visible, bias, torch.tensor(float("-inf"), dtype=dtype, device=device))
        return values[..., 0].unfold(-1, self.width, 1).flip(-1).contiguous()  # values[r - c + W - 1]

    def mask(self, i: int) -> torch.Tensor | None:
        """Call i's additive mask (B|1, H|1, rows, keys)."""
        if self.causal:
            return None
        rows, keys, per_block = self.calls[i]
        col = keys.start - (self.offset + rows.start + self.q_block - self.width)
        out = self.table[..., : rows.stop - rows.start, col: col + keys.stop - keys.start]
        if per_block:
            grid = mods.grids(self.batch, 1, torch.arange(rows.start, rows.stop, device=out.device),
                              torch.arange(keys.start, keys.stop, device=out.device))
            out = out + mods.additive(self.mask_mod(*grid), out.dtype)
        return out


class _FlashSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks):
        out, lse = q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty(q.shape[:-1])
        for i, (rows, keys, _) in enumerate(blocks.calls):
            out[:, :, rows], lse[:, :, rows] = FLASH(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                                     is_causal=blocks.causal, attn_mask=blocks.mask(i), scale=1.0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks = blocks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        blocks = ctx.blocks
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, (rows, keys, _) in enumerate(blocks.calls):
            dq[:, :, rows], dk_blk, dv_blk = FLASH_BACKWARD(
                d_out[:, :, rows].contiguous(), q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                lse[:, :, rows], 0.0, blocks.causal, attn_mask=blocks.mask(i), scale=1.0)
            dk[:, :, keys] += dk_blk
            dv[:, :, keys] += dv_blk
        return dq, dk, dv, None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
              q_block: int | None = None, return_lse: bool = False):
    """Softmax attention for scaled queries ``qs`` (B, H, Lq, D) and keys/values (B, Hkv, Lk, D) on SDPA's CPU
    flash kernel. ``mask``: an explicit (B, 1, Lq, Lk) visibility (a row that sees nothing outputs 0).
    ``q_block``: query rows per call (default `QUERY_BLOCK`). Half-precision inputs are computed in float32;
    ``out`` has v's dtype. Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (see `backends`)."""
    reason = unsupported(spec, qs, False)
    if reason:
        raise ValueError(f"backend 'cpu_flash' cannot run this spec: {reason}")
    dtype, (qs, k, v) = v.dtype, fn.kernel_inputs(qs, k, v)
    # the kernel reads each row's channels as contiguous: another last-dimension stride gave wrong outputs
    qs, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (qs, k, v))
    d, dv = qs.shape[-1], v.shape[-1]
    if d != dv:             # the kernel takes one head size: zero columns change no logit and add output columns
        qs, k, v = F.pad(qs, (0, max(d, dv) - d)), F.pad(k, (0, max(d, dv) - d)), F.pad(v, (0, max(d, dv) - dv))
    blocks = _Blocks(spec, qs, k.shape[-2], mods.document_starts(spec, doc_ids), mask, q_block or QUERY_BLOCK)
    out, lse = _FlashSoftmax.apply(qs, k, v, blocks)
    out = out[..., :dv]
    if not return_lse:
        return out.to(dtype)
    if mask is not None:        # the kernel gives LSE 0 to a row that sees nothing
        seen = mods.visible_counts(spec, qs.shape[-2], k.shape[-2], doc_ids, mask) > 0
        lse = torch.where(seen[:, None], lse, float("-inf"))
    return out.to(dtype), lse, lse
