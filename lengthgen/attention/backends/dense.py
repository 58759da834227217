"""`dense`: materializes the (Lq, Lk) weights. The oracle every other backend is tested against."""

from __future__ import annotations

import torch

from lengthgen.attention.functional import dense_attention
from lengthgen.attention.spec import AttentionSpec


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool) -> str | None:
    return None


attention = dense_attention
