"""The GPT-style decoder: `GPTConfig` (shape, norms, head, per-layer attention specs) and `GPT`."""

from lengthgen.model.config import PLACEMENTS, GPTConfig
from lengthgen.model.gpt import GPT
from lengthgen.model.norms import NORMS, make_norm

__all__ = ["GPT", "GPTConfig", "NORMS", "PLACEMENTS", "make_norm"]
