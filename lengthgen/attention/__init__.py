"""The attention core: `AttentionSpec` (every knob), `attend` (the math), `Attention` (the layer).

Read `spec.py` and `functional.py` for the whole math of one layer.
"""

from lengthgen.attention.core import attend
from lengthgen.attention.module import Attention
from lengthgen.attention.spec import FIELDS, PRESETS, AttentionSpec, resolve_spec

__all__ = ["Attention", "AttentionSpec", "FIELDS", "PRESETS", "attend", "resolve_spec"]
