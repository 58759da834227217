"""Attention diagnostics by query position (seed 000, seed 003, seed 004), computed blockwise.

For each query the attention *distribution* is ``pi_ij = softmax(logit_i)_j`` (it sums to 1); the layer's
p-softmax weights are its per-query rescaling ``w_ij = pi_ij / ||pi_i||_p`` (seed 001), so for p != 1 the first three
measure the distribution's shape, not the weights the layer uses (which do not sum to 1):

* ``inv_wmax``  ``1 / max_j pi_ij``: the effective number of attended tokens (seed 004).
* ``entropy``   ``-sum_j pi_ij log pi_ij`` (nats): dispersion (seed 003).
* ``participation`` ``sum_j pi_ij^2``: for p = 1 the output variance factor for uncorrelated unit-variance values
  (seed 001); the layer's is ``sum_j w_ij^2 = participation / ||pi_i||_p^2``, exactly 1 for p = 2.
* ``rms_pre`` / ``rms_post``: RMS of each head's attention output (of the weights w) before / after out-norm and its
  affine (seed 000), over head_dim.

Queries are processed in blocks against all their visible keys, so memory is linear in length; the
(L, L) matrix is never built.
"""

from __future__ import annotations

import torch

from lengthgen.attention import Attention
from lengthgen.attention import functional as fn
from lengthgen.attention import mods

STATS = ("inv_wmax", "entropy", "participation", "rms_pre", "rms_post")


def _query_block(batch: int, heads: int, length: int, budget: int = 1 << 24) -> int:
    return max(1, min(length, budget // max(1, batch * heads * length)))


@torch.no_grad()
def attention_stats(q, k, v, spec, *, multiplier=None, doc_ids=None, y=None, y_norm=None) -> dict[str, torch.Tensor]:
    """Per-head, per-position diagnostics (each (H, Lq), averaged over the batch) for one layer's q, k, v
    (after QK-norm and RoPE, before query scaling: what `Attention.capture` stores)."""
    b, h, lq, _ = q.shape
    lk = k.shape[-2]
    qs = fn.scale_queries(q.double(), spec, lk, doc_ids, None if multiplier is None else multiplier.double())
    k = fn.repeat_kv(k, h // k.shape[1]).double()
    score = mods.score_mod_for(spec, h, lq, lk, q.device, torch.float64)
    visible = mods.mask_mod_for(spec, lq, lk, mods.document_starts(spec, doc_ids))
    rows, keys = torch.arange(lq, device=q.device), torch.arange(lk, device=q.device)
    out = {name: torch.empty(h, lq, dtype=torch.float64) for name in ("inv_wmax", "entropy", "participation")}
    step = _query_block(b, h, lk)
    for qa in range(0, lq, step):
        qb = min(qa + step, lq)
        hi = lk - lq + qb
        lo = 0 if spec.window is None else max(0, lk - lq + qa - spec.window + 1)
        logit = fn.logits(qs[:, :, qa:qb], k[:, :, lo:hi], score, visible, rows[qa:qb], keys[lo:hi])
        w = torch.softmax(logit, dim=-1)
        out["inv_wmax"][:, qa:qb] = (1.0 / w.amax(-1)).mean(0)
        out["entropy"][:, qa:qb] = torch.special.entr(w).sum(-1).mean(0)
        out["participation"][:, qa:qb] = w.pow(2).sum(-1).mean(0)
    for name, t in (("rms_pre", y), ("rms_post", y_norm)):
        if t is not None:
            out[name] = t.double().pow(2).mean(-1).sqrt().mean(0)
    return {name: t.float() for name, t in out.items()}


@torch.no_grad()
def model_diagnostics(model: torch.nn.Module, run_forward) -> list[dict[str, torch.Tensor]]:
    """Diagnostics for every `Attention` layer of ``model`` during ``run_forward()`` (one forward pass).

    Each layer's statistics are taken as soon as its forward returns, and what it captured released: the pass
    holds one layer's q, k, v and outputs at a time, not every layer's. Returns one dict per layer (in module
    order) of (H, L) tensors, see `STATS`."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    stats: dict[int, dict[str, torch.Tensor]] = {}

    def take(index: int, layer: Attention):
        def hook(module, args, output):
            r, layer.capture = layer.capture, {}
            stats[index] = attention_stats(r["q"], r["k"], r["v"], layer.spec, multiplier=layer.scaling.multiplier,
                                           doc_ids=r["doc_ids"], y=r["y"], y_norm=r["y_norm"])
        return hook

    hooks = [layer.register_forward_hook(take(i, layer)) for i, layer in enumerate(layers)]
    for layer in layers:
        layer.capture = {}
    try:
        run_forward()
        return [stats[i] for i in range(len(layers))]
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            layer.capture = None
