"""The GPT's blocks: `SequentialBlock` (attention, then MLP) and `ParallelBlock` (seed 001), and the small
gates of seed 000's modded-nanogpt fork (`ValueGate` for value embeddings, `SkipGate` for the U-net skip).

A block's sublayers are optional: attention-only blocks (``mlp_ratio = 0``, seed 003's minimal models) and
MLP-only ones (``GPTConfig.no_attention_layers``, seed 000's layer 6).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.attention import Attention, AttentionSpec, KVCache
from lengthgen.model.config import GPTConfig
from lengthgen.model.norms import HeadNormLinear, make_norm

#: MLP activations: GELU (exact or its tanh approximation, seed 001) and squared ReLU (modded-nanogpt)
ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
               "relu2": lambda h: F.relu(h).square()}


def mlp_width(cfg: GPTConfig) -> int:
    """The MLP's hidden width: ``round(mlp_ratio * dim)``, 0 for attention-only blocks."""
    return int(round(cfg.mlp_ratio * cfg.dim))


class MLP(nn.Module):
    """``proj(act(fc(x)))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = max(1, mlp_width(cfg))
        self.fc = nn.Linear(cfg.dim, hidden, bias=cfg.linear_bias)
        self.proj = nn.Linear(hidden, cfg.dim, bias=cfg.linear_bias)
        self.act = ACTIVATIONS[cfg.mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


def hybrid_spec(spec: AttentionSpec, norm: str) -> AttentionSpec:
    """HybridNorm's attention: the spec's QK-norm, or the model's norm kind when the spec has none."""
    if spec.qk_norm != "none":
        return spec
    return spec.replace(qk_norm="rms" if norm == "rms" else "layer")


class ValueGate(nn.Module):
    """Seed 000's value-embedding mixing (modded-nanogpt): ``v += 2 sigmoid(h[..., :w] W^T) * ve``, one gate per
    key/value head from the first ``w`` channels of the attention input h; W = 0 (the gate is 1 at init)."""

    def __init__(self, width: int, kv_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(kv_heads, width))

    def forward(self, h: torch.Tensor, ve: torch.Tensor) -> torch.Tensor:
        """The (B, L, Hkv*D) term added to the values, from the attention input h and the embedding ve."""
        gate = 2 * torch.sigmoid(F.linear(h[..., :self.weight.shape[1]], self.weight))   # (B, L, Hkv)
        return (ve.unflatten(-1, (gate.shape[-1], -1)) * gate[..., None]).flatten(-2)


class SkipGate(nn.Module):
    """Seed 000's U-net skip weight (modded-nanogpt): ``sigmoid(lam) * 2 sigmoid(x0[..., :w] W^T)`` from the
    first ``w`` channels of the block stack's input x0, with lam = -1.5 and W = 0 (about 0.18 at init)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lam = nn.Parameter(torch.tensor(-1.5))
        self.weight = nn.Parameter(torch.zeros(1, width))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """(B, L, 1) weights of the skipped activations."""
        return torch.sigmoid(self.lam) * 2 * torch.sigmoid(F.linear(x0[..., :self.weight.shape[1]], self.weight))


def _value_gate(cfg: GPTConfig, attn: Attention) -> ValueGate:
    return ValueGate(cfg.gate_width or cfg.dim, attn.kv_heads)


def make_attention(cfg: GPTConfig, spec: AttentionSpec, index: int, multiplier: nn.Parameter | None,
                   out_proj: bool = True) -> Attention:
    return Attention(cfg.dim, cfg.heads, spec, layer_index=index, head_dim=cfg.head_dim, bias=cfg.linear_bias,
                     backend=cfg.attention_backend, multiplier=multiplier, out_proj=out_proj)


class SequentialBlock(nn.Module):
    """Attention, then MLP, each sublayer F placed by ``placement`` (see `GPTConfig`, which names the sources;
    seed 003 compares the first three): ``pre`` x + F(N(x)), ``post`` N(x + F(x)), ``peri`` x + N'(F(N(x))),
    ``hybrid`` / ``hybrid_first`` (HybridNorm / HybridNorm*, seed 002) y = x + MHA(x) (the first block pre-norms
    x), then z = N(y), z + FFN(z). ``attention`` False or ``mlp_ratio = 0`` drop a sublayer."""

    def __init__(self, cfg: GPTConfig, spec: AttentionSpec, index: int, placement: str,
                 multiplier: nn.Parameter | None = None, attention: bool = True, value_embed: bool = False) -> None:
        super().__init__()
        self.placement = placement
        hybrid = placement.startswith("hybrid")
        norm = lambda: make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_affine)  # noqa: E731
        self.attn = None
        if attention:
            if hybrid:
                spec = hybrid_spec(spec, cfg.norm)
            self.attn = make_attention(cfg, spec, index, multiplier)
            if hybrid:  # the V part of QKV-norm
                self.attn.v_proj = HeadNormLinear(self.attn.v_proj, self.attn.head_dim, spec.qk_norm,
                                                  spec.qk_norm_eps, spec.qk_norm_affine)
        self.value_gate = _value_gate(cfg, self.attn) if value_embed else None
        self.mlp = MLP(cfg) if mlp_width(cfg) else None
        self.norm1 = norm() if attention and placement in ("pre", "post", "peri", "hybrid_first") else None
        self.norm1_out = norm() if attention and placement == "peri" else None
        self.norm2 = norm() if self.mlp is not None else None
        self.norm2_out = norm() if self.mlp is not None and placement == "peri" else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, ve: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """``ve``: this layer's value embedding (B, L, Hkv*D), mixed into the values by ``value_gate``;
        ``cache``: the attention's `KVCache` (x holds the positions after the cached ones)."""
        p = self.placement
        if self.attn is not None:
            h = x if self.norm1 is None or p == "post" else self.norm1(x)
            y = self.attn(h, doc_ids, None if ve is None else self.value_gate(h, ve), cache)
            # dropout on the residual branch: after peri's output norm (before it, the norm would undo its scaling)
            x = self.norm1(x + self.drop(y)) if p == "post" else x + self.drop(self.norm1_out(y) if p == "peri" else y)
        if self.mlp is None:
            return x
        if p == "post":
            return self.norm2(x + self.drop(self.mlp(x)))
        if p.startswith("hybrid"):   # z = N(y); x' = z + FFN(z)
            z = self.norm2(x)
            return z + self.drop(self.mlp(z))
        y = self.mlp(self.norm2(x))
        return x + self.drop(self.norm2_out(y) if p == "peri" else y)


class ParallelBlock(nn.Module):
    """Seed 001's block: from one input h, an attention branch and an MLP branch ``act(fc(h))``, projected
    together: ``F(h) = out([act(fc(h)), attention(h)])`` (one output projection over the concatenation, MLP
    branch first). Placed like a sequential sublayer: ``pre`` x + F(N(x)), ``post`` N(x + F(x)), ``peri``
    x + N'(F(N(x))). With ``mlp_ratio = 0`` only the attention branch remains."""

    def __init__(self, cfg: GPTConfig, spec: AttentionSpec, index: int, placement: str,
                 multiplier: nn.Parameter | None = None, attention: bool = True, value_embed: bool = False) -> None:
        super().__init__()
        assert attention, "a parallel block keeps its attention branch (GPTConfig checks no_attention_layers)"
        self.placement = placement
        hidden = mlp_width(cfg)
        self.attn = make_attention(cfg, spec, index, multiplier, out_proj=False)
        self.value_gate = _value_gate(cfg, self.attn) if value_embed else None
        self.fc = nn.Linear(cfg.dim, hidden, bias=cfg.linear_bias) if hidden else None
        self.act = ACTIVATIONS[cfg.mlp]
        self.out = nn.Linear(hidden + self.attn.heads * self.attn.head_dim, cfg.dim, bias=cfg.linear_bias)
        norm = lambda: make_norm(cfg.norm, cfg.dim, cfg.norm_eps, cfg.norm_affine)  # noqa: E731
        self.norm1 = norm()
        self.norm1_out = norm() if placement == "peri" else None
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, ve: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        post = self.placement == "post"
        h = x if post else self.norm1(x)
        branches = [self.attn(h, doc_ids, None if ve is None else self.value_gate(h, ve), cache)]
        if self.fc is not None:
            branches.insert(0, self.act(self.fc(h)))
        y = self.out(torch.cat(branches, dim=-1))
        if post:
            return self.norm1(x + self.drop(y))
        return x + self.drop(self.norm1_out(y) if self.norm1_out is not None else y)


BLOCKS = {"sequential": SequentialBlock, "parallel": ParallelBlock}

__all__ = ["ACTIVATIONS", "BLOCKS", "MLP", "ParallelBlock", "SequentialBlock", "SkipGate", "ValueGate",
           "hybrid_spec", "mlp_width"]
