"""The attention core: `AttentionSpec` (every knob), `attend` (the math), `Attention` (the layer).

Read `spec.py`, `functional.py` and `mods.py` for the whole math of one layer; `extras.py` holds the
parameterized pieces around `attend` (query-scaling multiplier, out-norm, output gate), `cache.py` the
`KVCache` for decoding.

Adding a mechanism, e.g. a distance term (checked by adding one):

1. `spec.py`: the choice in its ``Literal`` (``Distance``; validation, ``--set``, ``lengthgen config show`` and the
   error messages read the choices from there); a new parameter as an ``option`` with its ``USED_WITH`` entry (an
   existing one it reads, such as ``tau``: the choice in that entry); a preset in ``PRESETS`` if a paper names one;
   the README's table of fields.
2. `mods.py`: a builder beside ``log_bias``, a branch of ``_score_mod`` and its parameters passed by
   ``score_mod_for``. A score mod must be ``a_t s + bias_t`` with a_t, bias_t functions of the head and t = i - j
   only (tiled and cpu_flash evaluate it once per distance, ``affine_terms``). A factor of the query's position
   alone is a query gain instead (``functional.gain_feature``; ``spec.ABC_SCALINGS`` if it reads scaling_a, b, c):
   ``s (1 + c log(i + 1))`` is ``query_scaling="log_bn", scaling_a=1, scaling_b=1, scaling_c=0, scaling_init=c``.
3. Backends: dense, tiled and flex run it as it is; sdpa refuses every distance term; cpu_flash runs a term with
   a_t = 1 and raises for another, to be named in ``cpu_flash.unsupported`` (as ``scale_invariant``); the Triton
   kernel refuses a name missing from ``triton_psoftmax.DISTANCE_CODES`` (its terms are written in ``_logits``).
4. Tests: ``test_the_options_use_every_choice`` (tests/test_attention_matrix.py) fails until an entry of
   ``OPTIONS`` (tests/test_attention_backends.py) uses the choice, which then runs through the matrix (every
   backend against dense, float64 gradcheck, bfloat16 against float64); ``naive_attention`` there needs its formula,
   and ``test_interpreter_cases_cover_every_option`` (tests/test_triton.py) a case of the Triton kernel.
   A new field fails ``test_bad_values_cover_every_field`` and the ``REFINEMENTS`` test (tests/test_attention_module.py)
   until it has entries there, and the matrix's tests until an option sets it (in ``OPTIONS`` if ``attend`` reads
   it) to a value its cells read. Options of the layer around ``attend`` go in ``MODULE_OPTIONS`` there;
   ``explicit_layer`` (tests/test_attention_matrix.py) needs their formula.

A visibility rule is not local: besides ``mods.mask_mod_for`` and ``mods.first_visible`` (each query sees an
interval of keys), the window and documents are named by sdpa's and cpu_flash's causal fast paths,
``backends.choose``, flex's block-mask cache key, the Triton kernel and ``KVCache.keep``.
"""

from lengthgen.attention.cache import KVCache
from lengthgen.attention.core import attend
from lengthgen.attention.module import Attention
from lengthgen.attention.spec import FIELDS, PRESETS, AttentionSpec, resolve_spec

__all__ = ["Attention", "AttentionSpec", "FIELDS", "KVCache", "PRESETS", "attend", "resolve_spec"]
