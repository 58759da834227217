"""transformers attention masks -> what `lengthgen.attend` takes: documents, or an explicit boolean mask.

transformers hands the attention function a boolean (B, 1, Lq, Lk) mask (the ``"lengthgen"`` mask is its SDPA
mask) or an additive float mask. A mask that is "causal (+ sliding window) within contiguous runs" on the real
query rows (left or right padding, packed sequences, KV-cache decoding) becomes ``doc_ids``, which every
`attend` backend runs and with which n_i counts only the real tokens of the query's own run. Any other causal
mask stays an explicit mask (dense, tiled, sdpa or cpu_flash backends; n_i = the keys the row sees). Masks that let a
query see later keys raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lengthgen.attention import mods
from lengthgen.attention.spec import BASE


def bool_mask(mask: Any) -> torch.Tensor | None:
    """transformers' mask as a boolean (B, 1, Lq, Lk) tensor (True = visible), or None for plain causal."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"lengthgen attention got a {type(mask).__name__} attention mask; it needs a boolean or "
                        "additive float tensor (use attn_implementation='lengthgen', not a flex BlockMask)")
    if mask.dim() == 2:      # a raw (B, Lk) padding mask (1 = token), e.g. from a model that forwards it untouched
        raise ValueError("lengthgen attention got a 2D padding mask: the model did not build a 4D mask for the "
                         "'lengthgen' implementation (is lengthgen.hf.register() called before the forward?)")
    if mask.dim() != 4:
        raise ValueError("lengthgen attention expects a 4D (batch, 1, queries, keys) mask, "
                         f"got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if (mask[allowed] != 0).any():
        raise ValueError("lengthgen attention got an additive float mask with biases other than 0 / -inf; "
                         "only visibility masks are supported")
    return allowed


@dataclass(frozen=True)
class MaskPlan:
    """How to run one mask: the first ``lk`` keys, with ``doc_ids`` (B, lk) (None: one document per row), or,
    when ``explicit``, with the mask itself."""
    lk: int
    doc_ids: torch.Tensor | None = None
    explicit: bool = False


def _expected(lq: int, lk: int, doc_ids: torch.Tensor | None, window: int | None, device) -> torch.Tensor:
    spec = BASE.replace(window=window, doc_masking=doc_ids is not None)
    visible = mods.mask_mod_for(spec, lq, lk, mods.document_starts(spec, doc_ids))
    return mods.dense_mask(visible, 1 if doc_ids is None else doc_ids.shape[0], lq, lk, device)


def plan_mask(allowed: torch.Tensor, lq: int, lk: int, window: int | None) -> MaskPlan:
    """Turn a boolean (B, 1, Lq, Lk) mask into documents for `attend`, or keep it as an explicit mask.

    Queries are the last Lq of the kept keys: key columns after them (an unfilled static cache) are dropped,
    the last query sitting at the largest (last visible key - row) over the rows (a real row's last visible key
    is its own; right-padding rows, which see only earlier keys, do not move it). A query row is *real* if it
    sees its own key; padding rows (which see nothing, or only earlier keys) are not constrained and their
    outputs are unspecified (finite). On real rows the mask must be "causal, inside ``window``, same contiguous
    run": each real row's first visible key starts a run unless the window cut it.
    """
    if allowed.shape[-1] < lk:
        raise ValueError(f"lengthgen attention: mask covers {allowed.shape[-1]} keys but there are {lk}")
    allowed = allowed[..., :lk]
    if allowed.shape[1] != 1:
        raise ValueError("lengthgen attention supports masks shared by all heads (B, 1, Lq, Lk), "
                         f"got {tuple(allowed.shape)}")
    b = allowed.shape[0]
    seen = allowed[:, 0]                                           # (B, Lq, Lk)
    last = lk - 1 - seen.flip(-1).to(torch.uint8).argmax(-1)       # (B, Lq) last visible key; 1 byte per entry
    last = torch.where(seen.any(-1), last, -1)
    offset = (last - torch.arange(lq, device=allowed.device))[last >= 0]
    lk = lq + min(max(int(offset.max()) if len(offset) else 0, 0), lk - lq)
    a = allowed[:, 0, :, :lk]                                      # (B, Lq, Lk)
    rows = torch.arange(lq, device=a.device)
    q_pos = rows + (lk - lq)
    future = torch.arange(lk, device=a.device)[None, :] > q_pos[:, None]
    if (a & future).any():
        raise ValueError("lengthgen attention is causal: the attention mask lets queries see later keys "
                         "(bidirectional or prefix-LM masks are not supported)")
    real = a[:, rows, q_pos]                                       # (B, Lq): the query sees itself
    first = a.to(torch.uint8).argmax(-1)                           # first visible key of each row
    starts = real if window is None else real & (q_pos[None, :] - first + 1 < window)
    boundary = torch.zeros(b, lk, dtype=torch.bool, device=a.device)
    boundary[:, 0] = True
    boundary.scatter_(1, torch.where(starts, first, torch.zeros_like(first)), True)
    doc_ids = boundary.long().cumsum(-1) - 1
    if not bool(boundary[:, 1:].any()):
        doc_ids = None
    want = _expected(lq, lk, doc_ids, window, a.device)[:, 0].expand_as(a)
    if bool(((want != a) & real[:, :, None]).any()):
        return MaskPlan(lk, explicit=True)
    return MaskPlan(lk, doc_ids=doc_ids)


def plan_for(mask: torch.Tensor, lq: int, lk: int, window: int | None) -> MaskPlan:
    """`plan_mask` of ``mask`` (as `bool_mask` reads it), planned once per mask: every layer of a forward gets
    the same mask object, which keeps its plans (by sizes, window and the mask's version) as an attribute."""
    plans = mask.__dict__.setdefault("_lengthgen_plans", {})
    key = (lq, lk, window, mask._version)
    if key not in plans:
        plans[key] = plan_mask(bool_mask(mask), lq, lk, window)
    return plans[key]


__all__ = ["MaskPlan", "bool_mask", "plan_for", "plan_mask"]
