"""`flex`: FlexAttention (``torch.nn.attention.flex_attention``) for every `AttentionSpec` option.

* Distance terms: the spec's score mod (`mods.score_mod_for`) is FlexAttention's ``score_mod``.
* Causal, sliding-window and document masks: the spec's mask mod (`mods.mask_mod_for`) in a ``block_mask``
  whose block table comes from each query's visible key interval ``[first_i, i]`` (`mods.first_visible`) --
  never an (Lq, Lk) tensor -- cached in a small LRU keyed on the lengths, device, block size, the spec's mask
  fields and the document layout (see `_BlockMaskCache`). Explicit masks are not taken (use dense, tiled, sdpa,
  cpu_flash).
* ``p != 1`` uses ``out_p = out_1 * exp(LSE_1 - LSE_p / p)`` with ``LSE_p = logsumexp_j(p * logit_ij)``: a
  second FlexAttention call with the logits multiplied by p returns LSE_p (it runs with a 16-wide zero value
  tensor; its output, exactly 0, is added to keep it in the graph). FlexAttention's returned LSE is in natural
  log in torch 2.11 and 2.13 (the kernels work in base 2 and ``flex_attention`` converts back), and gradients
  flow through both LSEs.
* Grouped queries with fewer than 128 rows force the main kernel (``FORCE_USE_FLEX_ATTENTION``) where torch's
  decoding kernel has no configuration (``Lq x heads per kv head > 128``).

Inputs: `functional.kernel_inputs` (float32 for half-precision inputs on CPU, the input dtype on CUDA).
On CUDA ``torch.compile(flex_attention)`` runs the fused Triton kernels (forward and backward); in a compiled
model the backend is traced into the model's graph (`backends.TRACED`), block mask included. On CPU the
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
from lengthgen.attention import mods
from lengthgen.attention.spec import AttentionSpec

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    flex_attention = None

BLOCK_SIZE = 128          # FlexAttention's default sparse block size (query and key)
LSE_VALUE_DIM = 16        # value width of the LSE_p pass (its output is unused; 16 is the kernels' minimum)
CACHE_SIZE = 16           # block masks kept (one per shape x document layout x mask spec)
RECOMPILE_LIMIT = 64      # every (shape, score_mod) pair is a compiled variant of flex_attention


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    """Why FlexAttention cannot run ``spec`` on ``q``, or None."""
    if flex_attention is None:
        return "torch.nn.attention.flex_attention is not available in this torch"
    if masked:
        return "an explicit mask (the flex backend builds its block mask from causal, window and documents)"
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
    """``torch.compile(flex_attention)`` on CUDA; the eager (unfused, inference-only) path on CPU; inside a
    ``torch.compile`` of the caller (a compiled model), ``flex_attention`` itself, compiled with the caller."""
    if torch.compiler.is_compiling():
        return flex_attention
    return _compiled() if device.type == "cuda" else _eager


# ---------------------------------------------------------------------------------------------------
# the LSE_p pass: p times the logits


@mods.eager_cache(maxsize=64)
def _times(score_mod, p: float):
    """``p * score_mod(score)`` (``p * score`` without a score mod). Cached: one function object per
    (mod, p), which torch.compile guards on."""
    def times_p(score, b, h, q_idx, kv_idx):
        return p * (score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx))
    return times_p


# ---------------------------------------------------------------------------------------------------
# block mask: causal / window / documents, built at block granularity


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) of a (B, H, nQ, nK) 0/1 block table, listed blocks first in ascending order."""
    num = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def build_block_mask(spec: AttentionSpec, lq: int, lk: int, starts: torch.Tensor | None, device,
                     block_size: int = BLOCK_SIZE) -> "BlockMask":
    """The BlockMask of ``mods.mask_mod_for(spec, lq, lk, starts)`` for the last ``lq`` of ``lk`` positions.

    Query i (absolute position) sees keys ``[first_i, i]`` (`mods.first_visible`). A block is listed when
    some valid query in it sees some valid key in it, and listed as *full* (no mask_mod needed) when every
    query row and key column is valid and every query sees the whole key range -- the same classification
    as ``create_block_mask`` (padding counts as masked), without an (Lq, Lk) tensor.
    """
    offset = lk - lq
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    pad = nq * block_size - lq
    lo = mods.first_visible(spec, lq, lk, starts, device)
    lo = torch.nn.functional.pad(lo, (0, pad), value=lk + 1)               # padding rows see nothing
    hi = torch.arange(offset, offset + nq * block_size, device=device).expand_as(lo)
    lo = lo.reshape(lo.shape[0], nq, block_size, 1)
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
                                    mask_mod=mods.mask_mod_for(spec, lq, lk, starts), seq_lengths=(lq, lk))


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
                        starts = mods.document_bounds(doc_ids)[0].to(device)
                    if cached_starts.shape != starts.shape or not torch.equal(cached_starts, starts):
                        continue
            self.entries.move_to_end(k)
            self.hits += 1
            return mask
        self.misses += 1
        if docs and starts is None:
            starts = mods.document_bounds(doc_ids)[0].to(device)
        mask = build_block_mask(spec, lq, lk, starts, device, block_size)
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
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None, return_lse: bool = False,
              scale: float = 1.0):
    """FlexAttention p-softmax attention for scaled queries ``qs`` (B, H, Lq, D), keys/values (B, Hkv, Lk, D);
    ``scale``: FlexAttention's own, the dot products' factor before the score mod.

    Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (see `backends`).
    """
    if flex_attention is None:
        raise ValueError("backend 'flex' needs torch.nn.attention.flex_attention")
    if mask is not None:
        raise ValueError(f"backend 'flex' cannot take {unsupported(spec, qs, False, True)}")
    dtype, (qs, k, v) = v.dtype, fn.kernel_inputs(qs, k, v)
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
    flex = _flex(device)
    if torch.compiler.is_compiling():   # built in the caller's graph (the cache's lookups are host-side)
        block_mask = build_block_mask(spec, lq, lk, mods.document_starts(spec, doc_ids), device)
    else:
        block_mask = BLOCK_MASKS.get(lq, lk, spec, doc_ids, device)
    kw = dict(block_mask=block_mask, scale=float(scale), enable_gqa=hkv != h, return_aux=AuxRequest(lse=True))
    if lq < BLOCK_SIZE < lq * (h // hkv):
        # torch's decoding kernel (picked for Lq < 128) puts the G query heads of a kv head in one block of
        # next_pow2(Lq * G) rows and has no config beyond the 128-row sparse block (NoValidChoicesError)
        kw["kernel_options"] = {"FORCE_USE_FLEX_ATTENTION": True}
    compute = fn.compute_dtype(qs.dtype)    # float64 inputs stay float64 (slopes, the p-norm factor)
    score_mod = mods.score_mod_for(spec, h, lq, lk, device, compute)
    out, aux = flex(qs, k, v, score_mod=score_mod, **kw)
    lse_1 = lse_p = aux.lse
    if p != 1:
        v_lse = v.new_zeros(k.shape[0], hkv, lk, LSE_VALUE_DIM)
        zeros, aux_p = flex(qs, k, v_lse, score_mod=_times(score_mod, p), **kw)
        lse_p = aux_p.lse
        # + the pass's output, exactly 0 (zero values; its gradients are exactly 0 too): in a compiled model's
        # backward an unused output has no gradient, and Inductor (torch 2.11) fails to lower that
        factor = torch.exp(lse_1.to(compute) - lse_p.to(compute) / p).unsqueeze(-1) + zeros[..., :1]
        out = fn.scale_rows(out, factor, dtype)      # in float32, rounded once (one pass each way when eager)
    else:
        out = out.to(dtype)
    return (out, lse_1.detach(), lse_p.detach()) if return_lse else out


__all__ = ["attention", "unsupported", "build_block_mask", "BLOCK_MASKS"]
