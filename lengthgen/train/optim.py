"""Optimizers (AdamW or seed 001's `PaLMAdamW`; Muon or NorMuon for 2-D hidden weights + AdamW for the rest) and
QK-clip.

Muon (`torch.optim.Muon`, its orthogonalization batched by shape: `lengthgen.train.muon`) orthogonalizes the update
of 2-D weight matrices; it is meant for hidden layers only. `muon_param_names` picks the 2-D parameters inside the
transformer blocks (attention and MLP projections, gates); embeddings, the head, norms, biases and scalars (e.g.
learnable query-scaling multipliers) go to AdamW. ``train.muon_lr_mul`` and ``train.adam_lr_mul`` scale the
learning rate of the parameters whose names match a pattern (modded-nanogpt's per-parameter ``lr_mul``),
``train.adam_betas`` sets AdamW's betas by pattern (its per-group betas). AdamW decays 2-D weights only, or every
parameter (``weight_decay_on="all"``, as seed 001's optimizer does), each at ``weight_decay`` times its
``train.weight_decay_mul`` multiplier (modded-nanogpt's ``wd_mul``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention import Attention
from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.config import ConfigError, check_value, pattern_matches
from lengthgen.train.config import MUON_OPTIMIZERS, MUON_PATTERNS
from lengthgen.train.muon import Muon
from lengthgen.train.normuon import CautiousAdamW, NorMuon
from lengthgen.train.palm_adamw import PaLMAdamW


def muon_param_names(model: nn.Module) -> list[str]:
    """Names of the 2-D hidden weights (inside ``model.blocks``) that Muon optimizes."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and name.startswith("blocks.")]


def by_pattern(key: str, names: list[str], patterns: dict[str, Any], default: Any, what: str) -> dict[str, Any]:
    """Each of ``names``' value: ``default``, or the value of the last pattern of the config table ``key``
    (fnmatch) that matches it. A pattern that matches none of ``names`` is a `ConfigError`."""
    values = dict.fromkeys(names, default)
    for matched, value in pattern_matches(key, patterns, names, what):
        values.update(dict.fromkeys(matched, value))
    return values


def build_optimizers(model: nn.Module, train_cfg) -> list[torch.optim.Optimizer]:
    """[AdamW], [PaLMAdamW] or [Muon or NorMuon, AdamW] per ``train_cfg.optimizer``: Muon takes
    `muon_param_names` but those ``muon_exclude`` matches, AdamW the rest. Muon has one group per ``muon_lr_mul``
    multiplier (lr ``muon_lr * multiplier``), AdamW one per weight decay, ``adam_lr_mul`` multiplier and
    ``adam_betas`` (decayed groups first). With ``cautious_weight_decay``, `CautiousAdamW` and NorMuon decay
    cautiously (`lengthgen.train.normuon`). Each group records its peak lr in ``initial_lr``."""
    tc = train_cfg
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    muon_names = muon_param_names(model) if tc.optimizer in MUON_OPTIMIZERS else []
    if tc.optimizer in MUON_OPTIMIZERS and not muon_names:       # else every parameter would go to AdamW, silently
        raise ConfigError(f"train.optimizer={tc.optimizer!r} found no hidden matrices in {type(model).__name__} for "
                          "Muon: it takes the trainable 2-D weights under model.blocks (muon_param_names), as a "
                          "lengthgen GPT holds them; use adamw for this model", "train.optimizer")
    for key in MUON_PATTERNS:
        if getattr(tc, key) and not muon_names:
            raise ConfigError(f"train.{key} applies only with train.optimizer=muon or normuon", f"train.{key}")
    excluded = pattern_matches("train.muon_exclude", dict.fromkeys(tc.muon_exclude), muon_names, "Muon parameter")
    muon_names = [name for name in muon_names if not any(name in matched for matched, _ in excluded)]
    muon_mul = by_pattern("train.muon_lr_mul", muon_names, tc.muon_lr_mul, 1.0, "Muon parameter")
    adam_names = [name for name in params if name not in muon_mul]
    adam_mul = by_pattern("train.adam_lr_mul", adam_names, tc.adam_lr_mul, 1.0, "AdamW parameter")
    adam_betas = by_pattern("train.adam_betas", adam_names, tc.adam_betas, tuple(tc.betas), "AdamW parameter")
    decay_mul = by_pattern("train.weight_decay_mul", adam_names, tc.weight_decay_mul, 1.0, "AdamW parameter")
    decayed = {name: p.ndim >= 2 or tc.weight_decay_on == "all" for name, p in params.items()}
    for pattern, (matched, _) in zip(tc.weight_decay_mul, pattern_matches(
            "train.weight_decay_mul", tc.weight_decay_mul, adam_names, "AdamW parameter")):
        if not any(decayed[name] for name in matched):
            raise ConfigError(f"train.weight_decay_mul: pattern {pattern!r} matches only parameters that are not "
                              "2-D (norms, biases, scalars), which AdamW does not decay with "
                              "train.weight_decay_on='matrices': no effect; remove it or set "
                              "train.weight_decay_on='all'", "train.weight_decay_mul")
    muon_groups: dict[float, list[nn.Parameter]] = {}
    adam_groups: dict[tuple, list[nn.Parameter]] = {}
    for name, p in params.items():
        if name in muon_mul:
            muon_groups.setdefault(muon_mul[name], []).append(p)
        else:
            decay = tc.weight_decay * decay_mul[name] if decayed[name] else 0.0
            adam_groups.setdefault((decayed[name], decay, adam_mul[name], tuple(adam_betas[name])), []).append(p)
    optimizers: list[torch.optim.Optimizer] = []
    if muon_groups:
        groups = [{"params": ps, "lr": tc.muon_lr * mul, "lr_mul": mul} for mul, ps in muon_groups.items()]
        kwargs = dict(lr=tc.muon_lr, weight_decay=tc.muon_weight_decay, momentum=tc.muon_momentum,
                      adjust_lr_fn=tc.muon_adjust_lr)
        optimizers.append(NorMuon(groups, beta2=tc.muon_beta2, cautious=tc.cautious_weight_decay, **kwargs)
                          if tc.optimizer == "normuon" else Muon(groups, nesterov=True, **kwargs))
    if adam_groups:
        ordered = sorted(adam_groups.items(), key=lambda group: not group[0][0])     # decayed groups first
        groups = [{"params": ps, "weight_decay": decay, "lr": tc.lr * mul, "betas": betas}
                  for (_, decay, mul, betas), ps in ordered]
        if tc.cautious_weight_decay:
            for group in groups:
                group["cautious_decay"], group["weight_decay"] = group["weight_decay"], 0.0
        if tc.optimizer == "adamw_palm":
            optimizers.append(PaLMAdamW(groups, lr=tc.lr, betas=tuple(tc.betas), eps=tc.eps))
        else:
            fused = all(p.is_cuda for g in groups for p in g["params"]) or None
            adamw = CautiousAdamW if tc.cautious_weight_decay else torch.optim.AdamW
            optimizers.append(adamw(groups, lr=tc.lr, betas=tuple(tc.betas), eps=tc.eps, fused=fused))
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier


def set_muon_momentum(optimizers: list[torch.optim.Optimizer], momentum: float) -> None:
    """Every Muon (and NorMuon) group's momentum; AdamW keeps its betas."""
    for opt in optimizers:
        if isinstance(opt, torch.optim.Muon):
            for group in opt.param_groups:
                group["momentum"] = momentum


# ---------------------------------------------------------------------------------------------------
# QK-clip (Kimi K2, "MuonClip"): keep the largest attention logit of every head below tau


@torch.no_grad()
def attention_max_logits(attn: Attention, chunk: int = 256) -> torch.Tensor:
    """(H,) largest pre-softmax logit of each head in the forward captured in ``attn.capture``.

    The logit is ``g_i (q_i . k_j) * base_scale`` over visible pairs (causal, window, documents), i.e. with
    query-length scaling but without the distance terms. Needs ``attn.capture`` filled by a forward.
    """
    cap = attn.capture
    if not cap or "q" not in cap:
        raise ValueError("attention_max_logits needs attn.capture filled: set attn.capture = {} and run a forward")
    spec = attn.spec
    q, k, doc_ids = cap["q"].detach().float(), cap["k"].detach().float(), cap.get("doc_ids")
    multiplier = attn.scaling.multiplier
    multiplier = multiplier.detach().float() if multiplier is not None else None
    qs = fn.scale_queries(q, spec, k.shape[-2], doc_ids, multiplier)
    k = fn.repeat_kv(k, qs.shape[1] // k.shape[1])
    lq, lk = qs.shape[-2], k.shape[-2]
    visible = mods.mask_mod_for(spec, lq, lk, mods.document_starts(spec, doc_ids))
    keys = torch.arange(lk, device=qs.device)
    best = torch.full((qs.shape[1],), float("-inf"), device=qs.device)
    for start in range(0, lq, chunk):
        stop = min(lq, start + chunk)
        rows = torch.arange(start, stop, device=qs.device)
        s = fn.logits(qs[:, :, start:stop], k, None, visible, rows, keys)        # (B, H, c, Lk)
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


@torch.no_grad()
def qk_clip_(attn: Attention, max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Rescale ``attn``'s query/key weights so that heads whose max logit exceeds ``tau`` come back to tau.

    gamma_h = tau / max_h for heads above tau, else 1. Without QK-norm every head's logits scale by exactly
    gamma_h, the heads below tau untouched: head h's rows of W_q and W_k are scaled by sqrt(gamma_h) each (Kimi
    K2); under GQA a key head is shared by several query heads, so, as Kimi K2 does for its shared rotary key,
    W_k is left alone and head h's rows of W_q are scaled by gamma_h. With QK-norm the projections cannot change
    the logits; the (shared over heads) affine weights of the Q and K norms are scaled by sqrt(min_h gamma_h)
    instead, and non-affine QK-norm is left alone (warning). Returns gamma (H,). A ``tau`` that is not a finite
    number > 0 (a negative one made NaN weights) or ``max_logits`` not (H,) is a `ConfigError` naming it.
    """
    tau = check_value("tau", tau, float, gt=0)
    if not isinstance(max_logits, torch.Tensor) or tuple(max_logits.shape) != (attn.heads,):
        got = tuple(max_logits.shape) if isinstance(max_logits, torch.Tensor) else type(max_logits).__name__
        raise ConfigError(f"qk_clip_: max_logits must be one per query head, ({attn.heads},) (attention_max_logits), "
                          f"got {got}", "max_logits")
    gamma = torch.where(max_logits > tau, tau / max_logits.clamp(min=1e-30), torch.ones_like(max_logits))
    if bool((gamma >= 1).all()):
        return gamma
    hd, heads, kv_heads = attn.head_dim, attn.heads, attn.kv_heads
    if attn.spec.qk_norm != "none":
        if attn.q_norm_weight is None:
            warnings.warn(f"QK-clip: layer {attn.layer_index} has non-affine QK-norm; nothing to rescale",
                          stacklevel=2)
            return gamma
        factor = math.sqrt(float(gamma.min()))
        attn.q_norm_weight.mul_(factor)
        attn.k_norm_weight.mul_(factor)
        return gamma
    # a shared key head (GQA) is left alone: its query heads take all of gamma_h
    scales = [(attn.q_proj, gamma)] if kv_heads < heads else [(attn.q_proj, gamma.sqrt()), (attn.k_proj, gamma.sqrt())]
    for proj, factor in scales:
        scale = factor.to(proj.weight.dtype).repeat_interleave(hd)       # (heads*hd,)
        proj.weight.mul_(scale[:, None])
        if proj.bias is not None:
            proj.bias.mul_(scale)
    return gamma


def capture_logits(attentions: list[Attention]) -> None:
    """Make every layer keep its q and k in the next forward, for `captured_max_logits`."""
    for attn in attentions:
        attn.capture = {}


def captured_max_logits(attentions: list[Attention], before: list[torch.Tensor] | None = None
                        ) -> list[torch.Tensor]:
    """Each layer's (H,) max logits from the q and k it captured, the elementwise maximum with ``before`` (the
    earlier micro-batches' of the step), then stop capturing."""
    maxima = []
    for i, attn in enumerate(attentions):
        m = attention_max_logits(attn)
        attn.capture = None
        maxima.append(m if before is None else torch.maximum(before[i], m))
    return maxima


def clip_logits(attentions: list[Attention], maxima: list[torch.Tensor], tau: float, reduce=lambda m: m) -> float:
    """QK-clip every layer from its max logits over the step's batch (``reduce``: their maximum over DDP
    ranks). Returns the largest max logit before clipping."""
    largest = []
    for attn, m in zip(attentions, maxima, strict=True):
        m = reduce(m)
        qk_clip_(attn, m, tau)
        largest.append(float(m.max()))
    return max(largest)
