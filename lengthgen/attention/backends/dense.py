"""`dense`: materializes the (Lq, Lk) logits. The oracle every other backend is tested against."""

from __future__ import annotations

import torch

from lengthgen.attention.functional import dense_attention
from lengthgen.attention.spec import AttentionSpec


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    return None


attention = dense_attention
