"""The parameterized pieces around `attend`: query-scaling multiplier, out-norm, output gate.

`Attention` and the Hugging Face adapter (`lengthgen.hf`) both build these, so each is written once. Each is
the identity (and has no parameters) when its spec fields are off. Layout: per-head outputs ``y`` are
(B, H, L, D); the layer input ``x`` is (B, L, dim).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.attention import functional as fn
from lengthgen.attention.spec import AttentionSpec


class QueryScaling(nn.Module):
    """The learnable multiplier of query-length scaling: s of ``log_n`` (Scalable-Softmax, Nakanishi 2025) or
    r of ``sqrt_log_n`` (seed 004), at ``spec.learnable_scaling`` granularity.

    ``multiplier``: None (fixed at ``spec.scaling_init``), a () parameter (``global``, ``layer``) or (H,)
    (``head``), initialized at ``spec.scaling_init``. ``shared``: one ``global`` multiplier for several layers
    (`new_parameter`); each layer registers it, ``model.parameters()`` lists it once.
    """

    def __init__(self, spec: AttentionSpec, heads: int, shared: nn.Parameter | None = None, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.granularity = spec.learnable_scaling
        if spec.learnable_scaling == "none":
            self.multiplier = None
        elif spec.learnable_scaling == "global" and shared is not None:
            self.multiplier = shared
        else:
            self.multiplier = self.new_parameter(spec, heads, device=device, dtype=dtype)

    @staticmethod
    def new_parameter(spec: AttentionSpec, heads: int, *, device=None, dtype=None) -> nn.Parameter:
        """A multiplier at ``spec.scaling_init``: (H,) for ``head`` granularity, () otherwise."""
        shape = (heads,) if spec.learnable_scaling == "head" else ()
        return nn.Parameter(torch.full(shape, float(spec.scaling_init), device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return self.granularity


class OutNorm(nn.Module):
    """AVNorm (seed 000) on the per-head output (`functional.out_norm`), then the optional affine
    (``spec.out_norm_affine``): ``weight`` (H*D) and, for the ``*_layer`` kinds, ``bias`` (H*D), one per channel
    of the merged output (channel ``h * D + d``), initialized at 1 and 0."""

    def __init__(self, spec: AttentionSpec, heads: int, head_dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.kind, self.eps, self.heads, self.head_dim = spec.out_norm, spec.out_norm_eps, heads, head_dim
        affine = spec.out_norm != "none" and spec.out_norm_affine
        f = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(heads * head_dim, **f)) if affine else None
        self.bias = nn.Parameter(torch.zeros(heads * head_dim, **f)) if affine and self.kind.endswith("layer") \
            else None

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y = fn.out_norm(y, self.kind, self.eps)
        if self.weight is not None:
            y = y * self.weight.view(self.heads, 1, self.head_dim)
        if self.bias is not None:
            y = y + self.bias.view(self.heads, 1, self.head_dim)
        return y

    def extra_repr(self) -> str:
        return f"{self.kind}, affine={self.weight is not None}"


class OutputGate(nn.Module):
    """Gated attention (Qiu et al. 2025; seed 004): ``y * act(x W_g^T)`` with one gate per head
    (``gate="head"``, W_g (H, w)) or per channel (``"elementwise"``, W_g (H*D, w), channel ``h * D + d``), where
    the gate reads the first ``w = spec.gate_width`` channels of x (default all; seed 000's modded-nanogpt: 12).

    ``act = sigmoid`` starts from W_g ~ N(0, 0.02) (gates near 1/2); ``2sigmoid`` from W_g = 0, the identity at
    init (seed 004). ``weight`` is a plain parameter, not an ``nn.Linear``, so model-wide linear inits skip it."""

    def __init__(self, spec: AttentionSpec, dim: int, heads: int, head_dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.kind, self.act, self.heads, self.head_dim = spec.gate, spec.gate_act, heads, head_dim
        self.width = spec.gate_width or dim
        if self.width > dim:
            raise ValueError(f"AttentionSpec.gate_width={self.width} exceeds the layer width {dim}")
        out = {"none": 0, "head": heads, "elementwise": heads * head_dim}[spec.gate]
        self.weight = nn.Parameter(torch.empty(out, self.width, device=device, dtype=dtype)) if out else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is None:
            return
        if self.act == "2sigmoid":
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return y
        gate = torch.sigmoid(F.linear(x[..., :self.width], self.weight))   # (B, L, H) or (B, L, H*D)
        if self.act == "2sigmoid":
            gate = 2 * gate
        b, length = x.shape[:2]          # no -1 below: it is ambiguous for an empty batch or length
        gate = gate.view(b, length, self.heads, gate.shape[-1] // self.heads).transpose(1, 2)  # (B, H, L, 1 or D)
        return y * gate

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.act}"
