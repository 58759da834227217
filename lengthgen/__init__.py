"""lengthgen: length generalization of attention.

One composable attention layer (`AttentionSpec`, `attend`, `Attention`), a GPT-style model, tasks, a
trainer and an evaluation harness that measures behaviour far beyond the training length.
"""

from lengthgen.attention import Attention, AttentionSpec, attend
from lengthgen.model import GPT, GPTConfig
from lengthgen.version import __version__

__all__ = ["Attention", "AttentionSpec", "GPT", "GPTConfig", "__version__", "attend"]
