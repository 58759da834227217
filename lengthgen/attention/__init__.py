"""The attention core: `AttentionSpec` (every knob), `attend` (the math), `Attention` (the layer).

Read `spec.py`, `functional.py` and `mods.py` for the whole math of one layer; `extras.py` holds the
parameterized pieces around `attend` (query-scaling multiplier, out-norm, output gate), `cache.py` the
`KVCache` for decoding.
"""

from lengthgen.attention.cache import KVCache
from lengthgen.attention.core import attend
from lengthgen.attention.module import Attention
from lengthgen.attention.spec import FIELDS, PRESETS, AttentionSpec, resolve_spec

__all__ = ["Attention", "AttentionSpec", "FIELDS", "KVCache", "PRESETS", "attend", "resolve_spec"]
