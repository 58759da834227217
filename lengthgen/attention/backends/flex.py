"""`flex`: FlexAttention (``torch.nn.attention.flex_attention``) for every `AttentionSpec` option.

* Distance terms are a ``score_mod``: ``a_t * s + bias_t`` with ``t = i - j`` (scale_invariant, per-head ALiBi
  slopes, log_bias), exactly `functional.distance_scale` / `functional.distance_bias`.
* Causal, sliding-window and document masks are a ``block_mask``. It is built at block granularity from each
  query's visible key interval ``[max(start_i, i - W + 1), i]`` (documents are contiguous runs, so a query
  sees keys from its run start on) -- never an (Lq, Lk) tensor -- and cached in a small LRU keyed on the
  lengths, device, block size, the spec's mask fields and the document layout (see `_BlockMaskCache`).
* ``p != 1`` uses ``out_p = out_1 * exp(LSE_1 - LSE_p / p)`` with ``LSE_p = logsumexp_j(p * logit_ij)``: a
  second FlexAttention call with the logits multiplied by p returns LSE_p (its output is discarded, so it
  runs with a 16-wide zero value tensor). FlexAttention's returned LSE is in natural log in torch 2.13
  (the kernels work in base 2 and ``flex_attention`` converts back), and gradients flow through both LSEs.

On CUDA ``torch.compile(flex_attention)`` runs the fused Triton kernels (forward and backward). On CPU the
compiled path supports neither the LSE nor backward in torch 2.13, so the eager path (an unfused reference
that materializes scores) runs, inference only: `unsupported` refuses CPU training so `auto` never picks it.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict

import torch

from lengthgen.attention import functional as fn
from lengthgen.attention.spec import AttentionSpec

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    flex_attention = None

BLOCK_SIZE = 128          # FlexAttention's default sparse block size (query and key)
LSE_VALUE_DIM = 16        # value width of the LSE_p pass (its output is unused; 16 is the kernels' minimum)
CACHE_SIZE = 16           # block masks kept (one per shape x document layout x mask spec)
RECOMPILE_LIMIT = 64      # every (shape, score_mod) pair is a compiled variant of flex_attention


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool) -> str | None:
    """Why FlexAttention cannot run ``spec`` on ``q``, or None."""
    if flex_attention is None:
        return "torch.nn.attention.flex_attention is not available in this torch"
    device = q.device.type
    if device == "cpu":
        if training:
            return "FlexAttention has no CPU backward (CPU runs inference only; use tiled or dense to train)"
        return None
    if device != "cuda":
        return f"FlexAttention backend runs on cuda and cpu, not {device}"
    if q.shape[-1] < 16:
        return f"head_dim={q.shape[-1]} (FlexAttention's CUDA kernels need head_dim >= 16)"
    return None


# ---------------------------------------------------------------------------------------------------
# compiled entry point


@functools.cache
def _compiled():
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def _eager(*args, **kwargs):
    with warnings.catch_warnings():      # "called without torch.compile()": intended on CPU, see module doc
        warnings.simplefilter("ignore")
        return flex_attention(*args, **kwargs)


def _flex(device: torch.device):
    """``torch.compile(flex_attention)`` on CUDA; the eager (unfused, inference-only) path on CPU."""
    return _compiled() if device.type == "cuda" else _eager


# ---------------------------------------------------------------------------------------------------
# score_mod: distance terms (and the factor p of the LSE_p pass)


@functools.lru_cache(maxsize=64)
def _score_mod(distance: str, tau: float, lam: float, p: float, heads: int, offset: int, device: torch.device):
    """``p * (a_t * score + bias_t)``, t = (q_idx + offset) - kv_idx, or None when that is the identity.

    Cached so that repeated calls reuse one function object (torch.compile guards on it).
    """
    if distance == "none":
        if p == 1:
            return None

        def scale_only(score, b, h, q_idx, kv_idx):
            return score * p
        return scale_only
    slopes = fn.alibi_slopes(heads, device=device) if distance == "alibi" else None

    def score_mod(score, b, h, q_idx, kv_idx):
        # masked entries have t < 0; clamp so that no NaN reaches the (masked) gradient
        t = torch.clamp(q_idx + offset - kv_idx, min=0).to(torch.float32)
        if distance == "alibi":
            x = score - slopes[h] * t
        else:
            log_t = torch.log1p(t / tau)
            if distance == "scale_invariant":
                x = score * torch.sqrt(1 + 2 * log_t) - 2 * log_t
            else:  # log_bias
                x = score - lam * log_t
        return x if p == 1 else x * p
    return score_mod


def score_mod_for(spec: AttentionSpec, heads: int, offset: int, device: torch.device, p: float = 1.0):
    return _score_mod(spec.distance, float(spec.tau), float(spec.log_bias_lambda), float(p), heads, offset,
                      torch.device(device))


# ---------------------------------------------------------------------------------------------------
# block mask: causal / window / documents, built at block granularity


def doc_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(run start, run end) of each position's document for (B, L) ``doc_ids``; end is exclusive."""
    length = doc_ids.shape[-1]
    _, start = fn.segments(doc_ids)
    last = torch.ones_like(doc_ids, dtype=torch.bool)
    last[..., :-1] = doc_ids[..., 1:] != doc_ids[..., :-1]
    index = torch.arange(1, length + 1, device=doc_ids.device).expand_as(doc_ids)
    end = torch.where(last, index, torch.full_like(index, length)).flip(-1).cummin(-1).values.flip(-1)
    return start, end


def _mask_mod(offset: int, window: int | None, starts: torch.Tensor | None):
    def mask_mod(b, h, q_idx, kv_idx):
        i = q_idx + offset
        visible = kv_idx <= i
        if window is not None:
            visible = visible & (i - kv_idx < window)
        if starts is not None:
            visible = visible & (kv_idx >= starts[b, i])
        return visible
    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) of a (B, H, nQ, nK) 0/1 block table, listed blocks first in ascending order."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def build_block_mask(lq: int, lk: int, window: int | None, starts: torch.Tensor | None, device,
                     block_size: int = BLOCK_SIZE) -> "BlockMask":
    """The BlockMask of causal (+ window, + same-document) attention for the last ``lq`` of ``lk`` positions.

    Query i (absolute position) sees keys ``[lo_i, i]`` with ``lo_i = max(start_i, i - W + 1, 0)``. A block is
    listed when some valid query in it sees some valid key in it, and listed as *full* (no mask_mod needed)
    when every query row and key column is valid and every query sees the whole key range -- the same
    classification as ``create_block_mask`` (padding counts as masked), without an (Lq, Lk) tensor.
    """
    offset = lk - lq
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    pos = torch.arange(offset, offset + nq * block_size, device=device)
    valid = pos < lk
    lo = torch.zeros_like(pos).unsqueeze(0)
    if window is not None:
        lo = torch.clamp(pos - window + 1, min=0).unsqueeze(0)
    if starts is not None:
        padded = torch.nn.functional.pad(starts[:, offset:], (0, nq * block_size - lq), value=lk)
        lo = torch.maximum(lo, padded)
    hi = pos.unsqueeze(0).expand_as(lo)
    lo = torch.where(valid, lo, torch.full_like(lo, lk + 1))      # padding rows see nothing
    lo = lo.view(lo.shape[0], nq, block_size, 1)
    hi = hi.reshape(hi.shape[0], nq, block_size, 1)
    k0 = torch.arange(nk, device=device) * block_size
    k_last = torch.clamp(k0 + block_size, max=lk) - 1
    any_visible = ((lo <= k_last) & (hi >= k0)).any(2)
    full = ((lo <= k0) & (hi >= k0 + block_size - 1)).all(2)
    full = full & (k0 + block_size <= lk)                           # no padded key columns
    full_rows = (torch.arange(nq, device=device) + 1) * block_size <= lq
    full = full & full_rows[:, None]                                # no padded query rows
    partial = any_visible & ~full
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])
    if starts is not None:
        # compiled kernels may evaluate mask_mod on padded query rows (q_idx up to nq * block_size - 1)
        starts = torch.nn.functional.pad(starts, (0, block_size), value=lk)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=_mask_mod(offset, window, starts), seq_lengths=(lq, lk))


class _BlockMaskCache:
    """LRU of block masks. Key: (Lq, Lk, device, block size, window, doc_masking); with documents the entry
    also holds the layout: a hit needs the very same ``doc_ids`` tensor object at the same version (no
    device sync), or else run starts equal to the cached ones (``torch.equal``, one sync)."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, lq: int, lk: int, spec: AttentionSpec, doc_ids: torch.Tensor | None, device,
            block_size: int = BLOCK_SIZE) -> "BlockMask":
        docs = spec.doc_masking and doc_ids is not None
        key = (lq, lk, str(device), block_size, spec.window, docs)
        starts = None
        for k, (ref, version, cached_starts, mask) in reversed(self.entries.items()):
            if k[0] != key:
                continue
            if docs:
                if ref() is not doc_ids or version != doc_ids._version:
                    if starts is None:
                        starts = fn.segments(doc_ids)[1].to(device)
                    if cached_starts.shape != starts.shape or not torch.equal(cached_starts, starts):
                        continue
            self.entries.move_to_end(k)
            self.hits += 1
            return mask
        self.misses += 1
        if docs and starts is None:
            starts = fn.segments(doc_ids)[1].to(device)
        mask = build_block_mask(lq, lk, spec.window, starts, device, block_size)
        ref = weakref.ref(doc_ids) if docs else (lambda: None)
        version = doc_ids._version if docs else 0
        self.entries[(key, self.misses)] = (ref, version, starts, mask)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return mask

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


BLOCK_MASKS = _BlockMaskCache()


# ---------------------------------------------------------------------------------------------------
# attention


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, return_lse: bool = False):
    """FlexAttention p-softmax attention for scaled queries ``qs`` (B, H, Lq, D), keys/values (B, Hkv, Lk, D).

    Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (each (B, H, Lq), natural log).
    """
    if flex_attention is None:
        raise ValueError("backend 'flex' needs torch.nn.attention.flex_attention")
    b, h, lq, _ = qs.shape
    hkv, lk = k.shape[1], k.shape[2]
    p = float(spec.softmax_p)
    device = qs.device
    if device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (qs, k, v)):
            raise ValueError("backend 'flex' cannot train on CPU (FlexAttention has no CPU backward); "
                             "run under torch.no_grad() or use tiled / dense")
        # FlexAttention refuses CPU inputs that require grad even under no_grad
        qs, k, v = qs.detach(), k.detach(), v.detach()
    block_mask = BLOCK_MASKS.get(lq, lk, spec, doc_ids, device)
    flex = _flex(device)
    kw = dict(block_mask=block_mask, scale=1.0, enable_gqa=hkv != h)
    out, aux = flex(qs, k, v, score_mod=score_mod_for(spec, h, lk - lq, device), return_aux=AuxRequest(lse=True),
                    **kw)
    lse_1 = aux.lse
    if p == 1:
        return (out, lse_1, lse_1) if return_lse else out
    v_lse = v.new_zeros(k.shape[0], hkv, lk, LSE_VALUE_DIM)
    _, aux_p = flex(qs, k, v_lse, score_mod=score_mod_for(spec, h, lk - lq, device, p),
                    return_aux=AuxRequest(lse=True), **kw)
    lse_p = aux_p.lse
    factor = torch.exp(lse_1.float() - lse_p.float() / p).unsqueeze(-1)
    out = (out.float() * factor).to(qs.dtype)
    return (out, lse_1, lse_p) if return_lse else out


__all__ = ["attention", "unsupported", "build_block_mask", "doc_bounds", "BLOCK_MASKS", "score_mod_for"]
