"""Score and mask mods: each distance term and each visibility rule as one small function (attention-gym style).

A *score mod* ``(score, b, h, q_idx, kv_idx) -> logit`` turns the scaled dot product ``s_ij = q'_i . k_j`` into
the logit ``a_t s_ij + bias_t``; a *mask mod* ``(b, h, q_idx, kv_idx) -> bool`` says whether query i sees
key j. These are FlexAttention's signatures: `flex` passes the mods through, `dense` and `tiled` call them
on broadcast index grids (`grids`), and the Triton kernel (which cannot call Python) is tested against them.

Index convention: the mechanism mods take *absolute positions* ``q_idx = i``, ``kv_idx = j`` (distance
``t = i - j``). The builders `score_mod_for` and `mask_mod_for` return them in FlexAttention's row convention,
where ``q_idx`` indexes the Lq query rows and queries are the last Lq of the Lk positions: they add the
offset ``Lk - Lq`` (nonzero when decoding with a cache), and nothing else does.

Documents are contiguous runs of equal ``doc_ids`` (packing makes them; a left-padded row is two documents:
padding, then text), given to the masks as each position's run start.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention import flex_attention as _flex

from lengthgen.attention.spec import AttentionSpec

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _named(mod, name: str):
    mod.__name__ = mod.__qualname__ = name
    return mod


# ---------------------------------------------------------------------------------------------------
# mask mods: which keys a query sees


def causal(b, h, q_idx, kv_idx):
    """Key j is visible to query i iff j <= i."""
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskMod:
    """``i - j < W``: the W most recent keys (with `causal`): local attention (Beltagy et al. 2020), seed 004's
    local layers."""
    def mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window
    return _named(mod, f"sliding_window({window})")


def document(starts: torch.Tensor) -> MaskMod:
    """``j >= start_i``, the first position of query i's document; with `causal`: the same contiguous run
    (document masking of packed sequences, seed 004).

    ``starts``: (B, Lk) run start of each position (`document_bounds`)."""
    def mod(b, h, q_idx, kv_idx):
        return kv_idx >= starts[b, q_idx]
    return _named(mod, "document")


def explicit(mask: torch.Tensor) -> MaskMod:
    """A given boolean (B, 1, Lq, Lk) visibility (True = visible) whose rows are the last Lq positions."""
    offset = mask.shape[-1] - mask.shape[-2]

    def mod(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx - offset, kv_idx]
    return _named(mod, "explicit")


def and_masks(*mods: MaskMod) -> MaskMod:
    """Visible where every mod is (FlexAttention's ``and_masks``), named ``"a & b & c"`` for logs."""
    return _named(_flex.and_masks(*mods), " & ".join(m.__name__ for m in mods))


# ---------------------------------------------------------------------------------------------------
# score mods: distance terms a_t, bias_t


def _distance(q_idx: torch.Tensor, kv_idx: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """t = i - j in the score's dtype, clamped at 0 so that masked pairs (t < 0) stay finite (no NaN can
    reach their zero gradient)."""
    return torch.clamp(q_idx - kv_idx, min=0).to(score.dtype)


def scale_invariant(tau: float) -> ScoreMod:
    """Scale-invariant attention (Anson, Wang, Aitchison 2025): ``a_t s + bias_t`` with
    ``a_t = sqrt(1 + 2 log(1 + t/tau))`` and ``bias_t = -2 log(1 + t/tau)``."""
    def mod(score, b, h, q_idx, kv_idx):
        log_t = torch.log1p(_distance(q_idx, kv_idx, score) / tau)
        return score * torch.sqrt(1 + 2 * log_t) - 2 * log_t
    return _named(mod, f"scale_invariant(tau={tau:g})")


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi (Press, Smith, Lewis 2022): ``s - m_h t`` with one slope m_h per head (`alibi_slopes`)."""
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * _distance(q_idx, kv_idx, score)
    return _named(mod, "alibi")


def log_bias(lam: float, tau: float) -> ScoreMod:
    """Seed 004's log-distance bias: ``s - lam log(1 + t/tau)``."""
    def mod(score, b, h, q_idx, kv_idx):
        return score - lam * torch.log1p(_distance(q_idx, kv_idx, score) / tau)
    return _named(mod, f"log_bias(lam={lam:g}, tau={tau:g})")


def alibi_slopes(heads: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """ALiBi slopes (Press et al. 2022, their reference ``get_slopes``): for H a power of two
    ``m_h = 2^(-8(h+1)/H)``; otherwise the slopes for n, the largest power of two below H, followed by
    the first H - n of every other slope for 2n (``2^(-8(2k+1)/(2n))``, k = 0, 1, ...)."""
    n = 1 << (heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    slopes += [2.0 ** (-8.0 * (2 * k + 1) / (2 * n)) for k in range(heads - n)]
    return torch.tensor(slopes, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# documents, visible ranges, counts


def document_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of each position's document (contiguous run of equal ids) for (B, L) ``doc_ids``; end is
    exclusive. Both (B, L) long."""
    length = doc_ids.shape[-1]
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    last = torch.ones_like(first)
    last[..., :-1] = first[..., 1:]
    start = torch.where(first, index, torch.zeros_like(index)).cummax(-1).values
    end = torch.where(last, index + 1, torch.full_like(index, length)).flip(-1).cummin(-1).values.flip(-1)
    return start, end


def document_starts(spec: AttentionSpec, doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Run starts for `document` when the spec masks documents and ids are given, else None."""
    if not spec.doc_masking or doc_ids is None:
        return None
    return document_bounds(doc_ids)[0]


def first_visible(spec: AttentionSpec, lq: int, lk: int, starts: torch.Tensor | None = None,
                  device=None) -> torch.Tensor:
    """(B|1, Lq) first key each query row sees under ``causal & window & document``: row r (position
    ``i = Lk - Lq + r``) sees exactly the keys ``first_i .. i``. Backends bound their key blocks with it."""
    i = torch.arange(lk - lq, lk, device=device)
    lo = torch.zeros_like(i) if spec.window is None else torch.clamp(i - spec.window + 1, min=0)
    lo = lo.unsqueeze(0)
    return lo if starts is None else torch.maximum(lo, starts[:, lk - lq:].to(lo.device))


def visible_counts(spec: AttentionSpec, lq: int, lk: int, doc_ids: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """n_i, the number of keys query row i sees: the row sums of `mask_mod_for` (closed form from
    `first_visible`, or the explicit ``mask``'s rows combined with the spec's masks). (B|1, Lq) float."""
    starts = document_starts(spec, doc_ids)
    if mask is not None:
        visible = dense_mask(mask_mod_for(spec, lq, lk, starts, mask), mask.shape[0], lq, lk, mask.device)
        return visible.sum(-1).squeeze(1).float()
    lo = first_visible(spec, lq, lk, starts, device)
    return (torch.arange(lk - lq, lk, device=lo.device) - lo + 1).float()


# ---------------------------------------------------------------------------------------------------
# builders and evaluation


def eager_cache(maxsize: int):
    """``functools.lru_cache`` for eager calls, so that they pass the same mod object to a compiled FlexAttention
    (which guards on it); inside a ``torch.compile`` trace the function itself runs (Dynamo ignores the cache, with a
    warning, and the graph keeps what it returned)."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)
        return call
    return wrap


@eager_cache(maxsize=64)
def _score_mod(distance: str, tau: float, lam: float, heads: int, offset: int, device, dtype):
    if distance == "scale_invariant":
        mod = scale_invariant(tau)
    elif distance == "alibi":
        mod = alibi(alibi_slopes(heads, device, dtype))
    elif distance == "log_bias":
        mod = log_bias(lam, tau)
    else:
        return None
    if offset == 0:
        return mod

    def rows(score, b, h, q_idx, kv_idx):
        return mod(score, b, h, q_idx + offset, kv_idx)
    return _named(rows, mod.__name__)


def score_mod_for(spec: AttentionSpec, heads: int, lq: int, lk: int, device=None,
                  dtype: torch.dtype = torch.float32) -> ScoreMod | None:
    """The spec's distance term in row convention (see the module doc), or None when it has none.

    ``dtype``: of the ALiBi slopes (the backend's compute dtype). Cached: the same arguments return the
    same function object, which ``torch.compile`` guards on (`eager_cache`)."""
    return _score_mod(spec.distance, float(spec.tau), float(spec.log_bias_lambda), heads, lk - lq,
                      torch.device(device if device is not None else "cpu"), dtype)


def mask_mod_for(spec: AttentionSpec, lq: int, lk: int, starts: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> MaskMod:
    """``causal & sliding_window & document & explicit`` (the parts that apply) in row convention.

    ``starts``: run starts (`document_starts`) or None; ``mask``: an explicit (B, 1, Lq, Lk) visibility."""
    parts = [causal]
    if spec.window is not None:
        parts.append(sliding_window(spec.window))
    if starts is not None:
        parts.append(document(starts))
    if mask is not None:
        parts.append(explicit(mask))
    mod = parts[0] if len(parts) == 1 else and_masks(*parts)
    offset = lk - lq
    if offset == 0:
        return mod

    def rows(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + offset, kv_idx)
    return _named(rows, mod.__name__)


def grids(batch: int, heads: int, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlexAttention's (b, h, q_idx, kv_idx) as broadcast grids (B,1,1,1), (1,H,1,1), (1,1,Lq,1), (1,1,1,Lk)
    for 1-D query rows ``q_idx`` and keys ``kv_idx``."""
    device = q_idx.device
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1, 1),
            q_idx.view(1, 1, -1, 1), kv_idx.view(1, 1, 1, -1))


def affine_terms(score_mod: ScoreMod, heads: int, q_idx: torch.Tensor, kv_idx: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A score mod as ``(a_t, bias_t)`` on the grid of query rows ``q_idx`` x keys ``kv_idx`` (1-D, row
    convention): every distance term is affine in the score (``a_t s + bias_t``), so ``bias_t = mod(0)`` and
    ``a_t = mod(1) - mod(0)``, evaluated in float64 and rounded to ``dtype``. ``a_t`` is None where it is 1 on
    the whole grid (ALiBi, log-bias). Shapes (1, H|1, Lq, Lk)."""
    b, h, q_grid, kv_grid = grids(1, heads, q_idx, kv_idx)
    zero = torch.zeros((), dtype=torch.float64, device=q_idx.device)
    bias = score_mod(zero, b, h, q_grid, kv_grid)
    a = (score_mod(zero + 1, b, h, q_grid, kv_grid) - bias).to(dtype)
    return (None if bool((a == 1).all()) else a), bias.to(dtype)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean (or 0 / 1) visibility as an additive mask: 0 where visible, -inf where hidden. Arithmetic
    (1 / x - 1, negated), not ``where`` / ``masked_fill``, which were 10-20x slower on CPU."""
    return visible.to(dtype).reciprocal().sub_(1).neg_()


def dense_mask(mask_mod: MaskMod, batch: int, lq: int, lk: int, device=None) -> torch.Tensor:
    """A (row-convention) mask mod evaluated on every (query row, key): bool (B|1, 1, Lq, Lk)."""
    b, h, q_idx, kv_idx = grids(batch, 1, torch.arange(lq, device=device), torch.arange(lk, device=device))
    return mask_mod(b, h, q_idx, kv_idx).expand(-1, 1, lq, lk)


__all__ = ["additive", "affine_terms", "alibi", "alibi_slopes", "and_masks", "causal", "dense_mask", "document",
           "document_bounds", "document_starts", "eager_cache", "explicit", "first_visible", "grids", "log_bias",
           "mask_mod_for", "scale_invariant", "score_mod_for", "sliding_window", "visible_counts"]
