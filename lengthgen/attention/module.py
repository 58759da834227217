"""`Attention`: the layer around `attend()`; the math is `lengthgen.attention.functional`.

``x -> q, k, v projections (GQA) -> QK-norm -> RoPE / p-RoPE -> attend -> out-norm -> gate -> o_proj``
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention import functional as fn
from lengthgen.attention.core import attend
from lengthgen.attention.spec import AttentionSpec, resolve_spec


# Backend selection is Python control flow: under torch.compile the attention call is one graph break and
# the fast backends (FlexAttention, Triton) compile themselves.
_attend_eager = torch.compiler.disable(attend)


def scaling_multiplier(spec: AttentionSpec, heads: int) -> nn.Parameter | None:
    """The learnable query-scaling multiplier (s or r) at the spec's granularity, or None if fixed."""
    if spec.learnable_scaling == "none":
        return None
    shape = (heads,) if spec.learnable_scaling == "head" else ()
    return nn.Parameter(torch.full(shape, float(spec.scaling_init)))


class Attention(nn.Module):
    """Multi-head causal self-attention with every lengthgen mechanism.

    Args:
        dim: model width. heads: query heads. spec: `AttentionSpec`, preset name or dict.
        layer_index: the layer's index (recorded for per-layer specs and diagnostics).
        head_dim: default ``dim // heads``. backend: see `attend`.
        multiplier: a shared parameter for ``learnable_scaling="global"`` (one for the whole model);
            without it a global multiplier is owned by this layer.
    Setting ``self.record = {}`` makes the next forward store its internals there (for diagnostics):
    ``q``, ``k``, ``v`` (after QK-norm and RoPE, before query scaling), ``y`` (attention output before
    out-norm), ``y_norm`` (after) and ``doc_ids``.
    """

    def __init__(self, dim: int, heads: int, spec: AttentionSpec | str | dict[str, Any] | None = None, *,
                 layer_index: int = 0, head_dim: int | None = None, bias: bool = False, backend: str = "auto",
                 multiplier: nn.Parameter | None = None) -> None:
        super().__init__()
        self.spec = spec = resolve_spec(spec)
        self.heads, self.head_dim = heads, head_dim or dim // heads
        self.kv_heads = spec.kv_heads or heads
        if heads % self.kv_heads:
            raise ValueError(f"AttentionSpec.kv_heads={self.kv_heads} must divide heads={heads}")
        if self.head_dim % 2 and spec.position != "nope":
            raise ValueError(f"head_dim={self.head_dim} must be even for position={spec.position!r}")
        self.layer_index, self.backend, self.record = layer_index, backend, None
        inner, kv_inner = heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(dim, kv_inner, bias=bias)
        self.v_proj = nn.Linear(dim, kv_inner, bias=bias)
        self.o_proj = nn.Linear(inner, dim, bias=bias)
        affine_qk = spec.qk_norm != "none" and spec.qk_norm_affine
        self.q_norm_weight = nn.Parameter(torch.ones(self.head_dim)) if affine_qk else None
        self.k_norm_weight = nn.Parameter(torch.ones(self.head_dim)) if affine_qk else None
        if spec.out_norm != "none" and spec.out_norm_affine:
            self.out_norm_weight = nn.Parameter(torch.ones(inner))
            self.out_norm_bias = nn.Parameter(torch.zeros(inner)) if spec.out_norm.endswith("layer") else None
        else:
            self.out_norm_weight = self.out_norm_bias = None
        gate_out = {"none": 0, "head": heads, "elementwise": inner}[spec.gate]
        self.gate_proj = nn.Linear(dim, gate_out, bias=False) if gate_out else None
        if spec.learnable_scaling == "global" and multiplier is not None:
            self.multiplier = multiplier
        else:
            self.multiplier = scaling_multiplier(spec, heads)
        fraction = {"nope": 0.0, "rope": 1.0, "prope": spec.prope_fraction}[spec.position]
        self.register_buffer("rope_freqs", fn.rope_frequencies(self.head_dim, spec.rope_theta, fraction),
                             persistent=False)
        self.reset_gate()

    def reset_gate(self) -> None:
        """2sigmoid gates start at W_g = 0 (gate = 1: identity, seed 004); sigmoid gates at N(0, 0.02)."""
        if self.gate_proj is not None:
            if self.spec.gate_act == "2sigmoid":
                nn.init.zeros_(self.gate_proj.weight)
            else:
                nn.init.normal_(self.gate_proj.weight, std=0.02)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, length, _ = x.shape
        spec = self.spec
        q = self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if spec.qk_norm != "none":
            q = fn.head_norm(q, spec.qk_norm, spec.qk_norm_eps, self.q_norm_weight)
            k = fn.head_norm(k, spec.qk_norm, spec.qk_norm_eps, self.k_norm_weight)
        if spec.position != "nope":
            pos = torch.arange(length, device=x.device)
            q, k = fn.apply_rope(q, pos, self.rope_freqs), fn.apply_rope(k, pos, self.rope_freqs)
        y = _attend_eager(q, k, v, spec, doc_ids=doc_ids, multipliers=self.multiplier, backend=self.backend)
        return self.output(y, x, record=(q, k, v, doc_ids) if self.record is not None else None)

    def output(self, y: torch.Tensor, x: torch.Tensor, record: tuple | None = None) -> torch.Tensor:
        """out-norm -> merge heads -> affine -> gate -> o_proj for attention output y (B, H, L, D) and layer
        input x. Pure tensor code: `torch.compile` fuses it (the attention call itself stays eager)."""
        spec = self.spec
        b, _, length, _ = y.shape
        y_norm = fn.out_norm(y, spec.out_norm, spec.out_norm_eps)
        if record is not None:
            q, k, v, doc_ids = record
            self.record.update(q=q, k=k, v=v, y=y, y_norm=y_norm, doc_ids=doc_ids)
        y = y_norm.transpose(1, 2).reshape(b, length, self.heads * self.head_dim)
        if self.out_norm_weight is not None:
            y = y * self.out_norm_weight
            if self.out_norm_bias is not None:
                y = y + self.out_norm_bias
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(x))
            if spec.gate_act == "2sigmoid":
                gate = 2 * gate
            if spec.gate == "head":
                gate = gate.repeat_interleave(self.head_dim, dim=-1)
            y = y * gate
        return self.o_proj(y)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, layer={self.layer_index}"
