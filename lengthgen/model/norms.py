"""Normalization layers of the GPT: ``layer`` (LayerNorm), ``rms`` (RMSNorm), ``batch`` (BatchNorm).

Formulas (seed 002, "A Note on Normalization"), over the last axis unless said: ``layer`` (x - mean) /
sqrt(var + eps) with the biased variance, as seed 002; ``rms`` x / sqrt(mean(x^2) + eps) (torch's RMSNorm, as
seed 000's and seed 004's code), where seed 002 writes x / (RMS(x) + eps): the two differ only for RMS(x)
near sqrt(eps); ``batch`` per channel over the batch. Each then has a learnable weight (and, for layer and
batch, a bias) when affine.

``batch`` exists only to reproduce seed 001 ("Attention Normalizes the Wrong Norm"), whose counting models
used BatchNorm. It is NOT causal: in training mode its mean and variance are taken over every position of
every sequence in the batch, so a token's normalized value depends on later tokens and on other sequences
(it leaks statistics across positions and across the batch), and in eval mode it uses running statistics
gathered at the training length. Do not use it for language modelling.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
import torch.nn as nn

from lengthgen.attention import functional as fn

Norm = Literal["layer", "rms", "batch"]
NORMS = typing.get_args(Norm)


class SequenceBatchNorm(nn.BatchNorm1d):
    """BatchNorm over (B, L, D) inputs: statistics per channel over all B*L tokens (see module docstring), as seed
    001's BatchNorm1d on (B, D, L): training normalizes by the biased batch variance and updates the running
    mean and (unbiased) variance with momentum 0.1; eval normalizes by the running statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return super().forward(x.reshape(-1, shape[-1])).reshape(shape)


def make_norm(kind: str, dim: int, eps: float = 1e-5, affine: bool = True) -> nn.Module:
    """A norm over the last axis of width ``dim``: ``layer`` | ``rms`` | ``batch``, with learnable weights (and
    biases for layer and batch) when ``affine``."""
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)
    if kind == "rms":
        return nn.RMSNorm(dim, eps=eps, elementwise_affine=affine)
    if kind == "batch":
        return SequenceBatchNorm(dim, eps=eps, affine=affine)
    raise ValueError(f"norm={kind!r} is not valid; choose one of {', '.join(NORMS)}")


class HeadNormLinear(nn.Linear):
    """A linear projection followed by a per-head norm over ``head_dim`` (the V part of HybridNorm's QKV-norm).

    It replaces `Attention.v_proj` (same ``weight`` name, so checkpoints and optimizer grouping are unchanged);
    ``kind`` is ``rms`` or ``layer`` as in `functional.head_norm`, with an optional per-channel weight. A value
    embedding (seed 000's, `ValueGate`) is added to the values after this norm.
    """

    def __init__(self, linear: nn.Linear, head_dim: int, kind: str, eps: float, affine: bool) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.head_dim, self.kind, self.eps = head_dim, kind, eps
        self.norm_weight = nn.Parameter(torch.ones(head_dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        shape = y.shape
        y = y.reshape(*shape[:-1], shape[-1] // self.head_dim, self.head_dim)
        return fn.head_norm(y, self.kind, self.eps, self.norm_weight).reshape(shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, head_dim={self.head_dim}, norm={self.kind}"
