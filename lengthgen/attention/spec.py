"""`AttentionSpec`: every length-generalization knob of one attention layer, validated.

The math each field controls is written out in `lengthgen.attention.functional` and `lengthgen.attention.mods`.
Sources: p-softmax (seed 001, "Attention Normalizes the Wrong Norm"); AVNorm out-norm (seed 000);
`log_n` query scaling (Scalable-Softmax, Nakanishi 2025); `sqrt_log_n`, `log_bias`, 2sigmoid gate,
finite QK-norm eps (seed 004); `scale_invariant` (Anson, Wang, Aitchison 2025); ALiBi (Press et al. 2022);
p-RoPE (Barbero et al. 2024); gated attention (Qiu et al. 2025).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

QUERY_SCALINGS = ("none", "log_n", "sqrt_log_n")
GRANULARITIES = ("none", "global", "layer", "head")
DISTANCES = ("none", "scale_invariant", "alibi", "log_bias")
QK_NORMS = ("none", "rms", "layer")
POSITIONS = ("nope", "rope", "prope")
OUT_NORMS = ("none", "head_layer", "head_rms", "global_layer", "global_rms")
GATES = ("none", "head", "elementwise")
GATE_ACTS = ("sigmoid", "2sigmoid")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"AttentionSpec.{name}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(name: str, value: Any, *, allow_none: bool = False, integer: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
        what = "a positive integer" if integer else "a positive (finite) number"
        raise ValueError(f"AttentionSpec.{name}={value!r} is not valid; it must be {what}"
                         + (" or None" if allow_none else ""))


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's configuration. Frozen and validated on construction.

    Logits: ``logit_ij = g_i * a_t * (q_i . k_j) * base_scale + bias_t`` with
    ``t = i - j``; weights ``w_ij = exp(logit_ij) / (sum_j exp(p * logit_ij))^(1/p)``.
    """

    # p-softmax (seed 001): p=1 is softmax, p=2 keeps output variance for uncorrelated values.
    softmax_p: float = 1.0
    # query-length scaling g_i, a function of n_i = number of visible keys.
    query_scaling: str = "none"          # none | log_n (g = s log n) | sqrt_log_n (g = a + r sqrt(2 log(b n + c)))
    scaling_a: float = 0.0               # sqrt_log_n constants (seed 004's tuned values)
    scaling_b: float = 0.1
    scaling_c: float = 1.9
    scaling_init: float = 1.0            # initial (or fixed) multiplier s / r
    learnable_scaling: str = "none"      # none | global | layer | head
    # distance terms a_t (logit multiplier) and bias_t
    distance: str = "none"               # none | scale_invariant | alibi | log_bias
    tau: float = 10.0                    # scale_invariant and log_bias length scale
    log_bias_lambda: float = 1.0         # log_bias: bias_t = -lambda log(1 + t/tau)
    # masks
    window: int | None = None            # sliding window W: key j visible iff i - j < W
    doc_masking: bool = False            # attend within a document only (needs doc_ids)
    # projections
    base_scale: float | None = None      # default 1/sqrt(head_dim)
    kv_heads: int | None = None          # grouped-query attention; default = heads
    qk_norm: str = "none"                # none | rms | layer, per head over head_dim
    qk_norm_affine: bool = True
    qk_norm_eps: float = 1e-6            # a large finite eps keeps some norm information (seed 004)
    position: str = "rope"               # nope | rope | prope
    rope_theta: float = 10000.0
    prope_fraction: float = 0.75         # p-RoPE: fraction of (highest-frequency) pairs rotated
    # after attend()
    out_norm: str = "none"               # AVNorm (seed 000): none | head_layer | head_rms | global_layer | global_rms
    out_norm_affine: bool = False
    out_norm_eps: float = 1e-5
    gate: str = "none"                   # none | head | elementwise
    gate_act: str = "sigmoid"            # sigmoid (normal init) | 2sigmoid (W_g = 0: identity at init)

    def __post_init__(self) -> None:
        _positive("softmax_p", self.softmax_p)
        _choice("query_scaling", self.query_scaling, QUERY_SCALINGS)
        _choice("learnable_scaling", self.learnable_scaling, GRANULARITIES)
        if self.learnable_scaling != "none" and self.query_scaling == "none":
            raise ValueError("AttentionSpec.learnable_scaling="
                             f"{self.learnable_scaling!r} needs query_scaling log_n or sqrt_log_n, got 'none'")
        for name in ("scaling_a", "scaling_b", "scaling_c", "scaling_init", "log_bias_lambda"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"AttentionSpec.{name}={value!r} is not valid; it must be a number")
        if self.query_scaling == "sqrt_log_n" and (self.scaling_b < 0 or self.scaling_b + self.scaling_c <= 1):
            raise ValueError(f"AttentionSpec.scaling_b={self.scaling_b}, scaling_c={self.scaling_c} are not valid; "
                             "sqrt_log_n needs b >= 0 and b + c > 1 so that log(b n + c) > 0 for n >= 1")
        _choice("distance", self.distance, DISTANCES)
        _positive("tau", self.tau)
        _positive("window", self.window, allow_none=True, integer=True)
        _positive("base_scale", self.base_scale, allow_none=True)
        _positive("kv_heads", self.kv_heads, allow_none=True, integer=True)
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        _positive("qk_norm_eps", self.qk_norm_eps)
        _choice("position", self.position, POSITIONS)
        _positive("rope_theta", self.rope_theta)
        if isinstance(self.prope_fraction, bool) or not (isinstance(self.prope_fraction, (int, float))
                                                         and 0 <= self.prope_fraction <= 1):
            raise ValueError(f"AttentionSpec.prope_fraction={self.prope_fraction!r} is not valid; it must be in [0, 1]")
        _choice("out_norm", self.out_norm, OUT_NORMS)
        _positive("out_norm_eps", self.out_norm_eps)
        _choice("gate", self.gate, GATES)
        _choice("gate_act", self.gate_act, GATE_ACTS)
        for name in ("doc_masking", "qk_norm_affine", "out_norm_affine"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AttentionSpec.{name}={getattr(self, name)!r} is not valid; it must be true or false")

    # -- convenience ---------------------------------------------------------------------------------
    @property
    def has_distance_terms(self) -> bool:
        return self.distance != "none"

    def replace(self, **changes: Any) -> "AttentionSpec":
        """A copy with some fields changed (validated); unknown fields raise ValueError."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown AttentionSpec field(s) {sorted(unknown)}; valid fields: {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSpec":
        return BASE.replace(**data)

    @classmethod
    def preset(cls, name: str, **changes: Any) -> "AttentionSpec":
        """A named variant from the seeds (see `PRESETS`), optionally with fields changed."""
        if name not in PRESETS:
            raise ValueError(f"unknown attention preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name].replace(**changes)


FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSpec))
BASE = AttentionSpec()

#: The seeds' variants by name. Each differs from `baseline` (softmax + RoPE) in the knobs its seed studies.
PRESETS: dict[str, AttentionSpec] = {
    "baseline": BASE,
    "l2": AttentionSpec(softmax_p=2.0),                                    # seed 001
    "avnorm": AttentionSpec(out_norm="head_layer"),                        # seed 000
    "avnorm_rms": AttentionSpec(out_norm="head_rms"),                      # seed 000
    "ssmax": AttentionSpec(query_scaling="log_n", learnable_scaling="head"),  # Scalable-Softmax
    "sqrt_log_n": AttentionSpec(query_scaling="sqrt_log_n", learnable_scaling="head", qk_norm="rms"),  # seed 004
    "scale_invariant": AttentionSpec(distance="scale_invariant", position="nope"),  # Anson et al. 2025
    "alibi": AttentionSpec(distance="alibi", position="nope"),             # Press et al. 2022
    "log_bias": AttentionSpec(distance="log_bias", position="nope"),       # seed 004
    "gated": AttentionSpec(gate="elementwise", gate_act="2sigmoid"),       # seed 004 / Qiu et al. 2025
    "nope": AttentionSpec(position="nope"),
    "nope_avnorm": AttentionSpec(position="nope", out_norm="head_layer"),  # seed 000
}


def resolve_spec(spec: "AttentionSpec | str | dict[str, Any] | None") -> AttentionSpec:
    """Accept a spec, a preset name, or a dict of fields (optionally with ``preset``)."""
    if spec is None:
        return BASE
    if isinstance(spec, AttentionSpec):
        return spec
    if isinstance(spec, str):
        return AttentionSpec.preset(spec)
    if isinstance(spec, dict):
        data = dict(spec)
        return AttentionSpec.preset(data.pop("preset", "baseline"), **data)
    raise ValueError(f"attention spec must be an AttentionSpec, a preset name or a dict, got {type(spec).__name__}")


__all__ = ["AttentionSpec", "PRESETS", "FIELDS", "resolve_spec"]
