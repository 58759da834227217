"""The transformers attention function ``"lengthgen"`` and the parameters a spec adds to an HF attention module.

Per attention layer, on the model's own projected (and RoPE-rotated) q, k, v: `lengthgen.attend` (p-softmax,
query-length scaling, distance terms, sliding windows; documents or an explicit mask from `lengthgen.hf.masks`),
then out-norm (+ affine) and the output gate on the per-head output, before ``o_proj``: the same extras
modules (`QueryScaling`, `OutNorm`, `OutputGate`) as lengthgen's `Attention`. The logit scale is the model's own
``scaling`` unless the spec sets ``base_scale``.

Where the spec comes from: ``module.lengthgen_spec`` on each attention module (set by `retrofit`), else
``baseline``. A module whose config holds a ``lengthgen_spec`` but which `retrofit` did not set up (a saved retrofit
loaded by transformers' own ``from_pretrained``, which drops its parameters and hooks) raises instead of running.

Limits: causal decoder self-attention only (no encoder / cross attention, softcapping, attention sinks,
attention dropout, per-head masks, ``output_attentions`` weights); ``torch.compile`` is untested (planning a
mask reads its values).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention import functional as fn
from lengthgen.attention.core import attend
from lengthgen.attention.extras import OutNorm, OutputGate, QueryScaling
from lengthgen.attention.spec import AttentionSpec, resolve_spec
from lengthgen.hf.masks import bool_mask, plan_for


class LengthgenState(nn.Module):
    """What `retrofit` adds to one HF attention module (as ``module.lengthgen``): the spec's extras ``scaling``
    (`QueryScaling`), ``out_norm`` (`OutNorm`) and ``gate`` (`OutputGate`), as in lengthgen's `Attention`.

    A ``learnable_scaling="global"`` multiplier is owned by the first attention module's state (``owner``); the
    others hold that state by reference (not registered, so the multiplier is saved once) and read its current
    parameter at each forward, so that replacing it (``load_state_dict(..., assign=True)``) reaches every layer.
    ``x`` holds the attention input during a forward (captured by a pre-hook) for the gate.
    """

    def __init__(self, spec: AttentionSpec, hidden_size: int, heads: int, head_dim: int, *,
                 owner: LengthgenState | None = None, device=None, dtype=None) -> None:
        super().__init__()
        f = dict(device=device, dtype=dtype)
        shared = spec.learnable_scaling == "global" and owner is not None
        self._owner = [owner] if shared else []       # a plain list: not registered here
        self.scaling = None if shared else QueryScaling(spec, heads, **f)
        self.out_norm = OutNorm(spec, heads, head_dim, **f)
        self.gate = OutputGate(spec, hidden_size, heads, head_dim, **f)
        self.x: torch.Tensor | None = None

    @property
    def multiplier(self) -> torch.Tensor | None:
        """The query-scaling multiplier this module runs with (its own or the shared global one)."""
        return self._owner[0].scaling.multiplier if self._owner else self.scaling.multiplier

    def post(self, y: torch.Tensor) -> torch.Tensor:
        """Out-norm (+ affine) and gate on the per-head output y: (B, H, Lq, D) -> (B, H, Lq, D)."""
        y = self.out_norm(y)
        if self.gate.weight is None:
            return y
        x = self.x
        if x is None or tuple(x.shape[:2]) != (y.shape[0], y.shape[2]):
            raise RuntimeError("lengthgen gate: the attention input was not captured for this forward "
                               "(call lengthgen.hf.retrofit(model, spec) to install the hook)")
        return self.gate(y, x)


def capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: keep the attention input on ``module.lengthgen`` for the gate."""
    state = getattr(module, "lengthgen", None)
    if state is not None:
        state.x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)


def release_input(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook: drop the captured input."""
    state = getattr(module, "lengthgen", None)
    if state is not None:
        state.x = None


def module_spec(module: nn.Module) -> AttentionSpec:
    """The spec an HF attention module runs: ``module.lengthgen_spec`` (set by `retrofit`), else baseline.
    RuntimeError for a module of a saved retrofit (``config.lengthgen_spec``) that was loaded without
    `lengthgen.hf.from_pretrained`."""
    spec = getattr(module, "lengthgen_spec", None)
    if spec is not None:
        return spec
    if getattr(getattr(module, "config", None), "lengthgen_spec", None) is not None:
        raise RuntimeError(f"{type(module).__name__}: this model was saved after lengthgen.hf.retrofit (its config has "
                           "lengthgen_spec) but loaded without it, so its retrofit parameters and hooks are missing: "
                           "load the folder with lengthgen.hf.from_pretrained(DIR)")
    return resolve_spec(None)


def needs_state(spec: AttentionSpec) -> bool:
    """Whether ``spec`` adds parameters to an attention module (out-norm affine, gate, learnable scaling)."""
    return (spec.out_norm != "none" and spec.out_norm_affine) or spec.gate != "none" or spec.learnable_scaling != "none"


def _check_call(module: nn.Module, spec: AttentionSpec, dropout: float, softcap: float | None,
                kwargs: dict[str, Any]) -> None:
    if dropout:
        raise ValueError(f"lengthgen attention has no attention dropout (got {dropout}); set the model config's "
                         "attention_dropout to 0")
    if softcap is not None or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("lengthgen attention does not support logit softcapping, position biases or attention sinks")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError("lengthgen attention is causal; this module asks for bidirectional attention")
    if needs_state(spec) and getattr(module, "lengthgen", None) is None:
        raise RuntimeError(f"the lengthgen spec on {type(module).__name__} needs parameters (out-norm affine, gate or "
                           "learnable query scaling): call lengthgen.hf.retrofit(model, spec) first")


def lengthgen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                scaling: float | None = None, sliding_window: int | None = None,
                                softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"lengthgen"``: q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (B, Lq, H, D).

    Setting ``module.lengthgen_record = {}`` stores this call's inputs and outputs there (for tests and
    diagnostics): q, k, v (keys kept), doc_ids, dense_mask, spec (as run), multipliers, x, y (before out-norm), out.
    """
    spec = module_spec(module)
    _check_call(module, spec, dropout, softcap, kwargs)
    state = getattr(module, "lengthgen", None)
    base = spec.base_scale if spec.base_scale is not None else (scaling or 1.0 / math.sqrt(query.shape[-1]))
    windows = [w for w in (spec.window, sliding_window) if w]
    multipliers = state.multiplier if state is not None else None
    if multipliers is not None:
        multipliers = multipliers.to(query.dtype)
    lq, lk = query.shape[-2], key.shape[-2]
    doc_ids = dense = None
    if attention_mask is None:
        if 1 < lq < lk:        # as HF's sdpa: no mask with more keys than queries = prefill of an empty static cache
            lk = lq
    else:
        plan = plan_for(attention_mask, lq, lk, sliding_window or None)   # the window HF's mask has
        lk, doc_ids = plan.lk, plan.doc_ids
        if plan.explicit:
            dense = bool_mask(attention_mask)[..., :lk].expand(query.shape[0], -1, -1, -1)
    key, value = key[..., :lk, :], value[..., :lk, :]
    run = spec.replace(base_scale=float(base), window=min(windows) if windows else None,
                       doc_masking=doc_ids is not None)
    y = attend(query, key, value, run, doc_ids=doc_ids, mask=dense, multipliers=multipliers,
               backend=getattr(module, "lengthgen_backend", "auto"))
    out = (state.post(y) if state is not None else fn.out_norm(y, spec.out_norm, spec.out_norm_eps)).transpose(1, 2)
    record = getattr(module, "lengthgen_record", None)
    if record is not None:
        record.update(q=query, k=key, v=value, doc_ids=doc_ids, dense_mask=dense, spec=run, multipliers=multipliers,
                      x=state.x if state is not None else None, y=y, out=out)
    return out.contiguous(), None


__all__ = ["LengthgenState", "capture_input", "lengthgen_attention_forward", "module_spec", "needs_state",
           "release_input"]
