"""`AttentionSpec`: every length-generalization knob of one attention layer, validated.

The math each field controls is written out in `lengthgen.attention.functional` and `lengthgen.attention.mods`.
Sources: p-softmax (seed 001, "Attention Normalizes the Wrong Norm"); AVNorm out-norm (seed 000);
`log_n` query scaling (Scalable-Softmax, Nakanishi 2025); `sqrt_log_n`, `log_bias`, 2sigmoid gate,
finite QK-norm eps (seed 004); `scale_invariant` (Anson, Wang, Aitchison 2025); ALiBi (Press et al. 2022);
RoPE (Su et al. 2021); p-RoPE (Barbero et al. 2024); NoPE (Kazemnejad et al. 2023); QK-norm (Dehghani et al.
2023; seed 002's QKNorm, Henry et al. 2020); gated attention (Qiu et al. 2025); sliding windows (local attention,
Beltagy et al. 2020; seed 004's local layers); document masking (seed 004).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from lengthgen.config import MAX_SIZE, ConfigError, check, documented, option, to_plain

QueryScaling = Literal["none", "log_n", "log_bn", "sqrt_log_n"]
Granularity = Literal["none", "global", "layer", "head"]
Distance = Literal["none", "scale_invariant", "alibi", "log_bias"]
QKNorm = Literal["none", "rms", "layer"]
Position = Literal["nope", "rope", "prope"]
OutNorm = Literal["none", "head_layer", "head_rms", "global_layer", "global_rms"]
Gate = Literal["none", "head", "elementwise"]
GateAct = Literal["sigmoid", "2sigmoid"]
#: the query scalings of ``log(b n + c)``, which read the constants scaling_a, scaling_b, scaling_c
ABC_SCALINGS = ("log_bn", "sqrt_log_n")


@documented
@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's configuration. Frozen and validated on construction.

    Logits: ``logit_ij = g_i * a_t * (q_i . k_j) * base_scale + bias_t`` with
    ``t = i - j``; weights ``w_ij = exp(logit_ij) / (sum_j exp(p * logit_ij))^(1/p)``.
    """

    softmax_p: float = option(1.0, "p-softmax power (seed 001): 1 is softmax, 2 keeps the output variance "
                              "for uncorrelated values (within [0.001, 1000]: p times a float32 logit stays finite)",
                              ge=1e-3, le=1e3)
    query_scaling: QueryScaling = option("none", "query-length scaling g of the n visible keys: log_n "
                                         "(g = s log n), log_bn (g = a + s log(b n + c), seed 004's log n) or "
                                         "sqrt_log_n (g = a + r sqrt(2 log(b n + c)))")
    scaling_a: float = option(0.0, "log_bn / sqrt_log_n constant a (seed 004's tuned value)")
    scaling_b: float = option(0.1, "log_bn / sqrt_log_n constant b (seed 004's tuned value)")
    scaling_c: float = option(1.9, "log_bn / sqrt_log_n constant c (seed 004's tuned value)")
    scaling_init: float = option(1.0, "initial (or fixed) query-scaling multiplier s / r")
    learnable_scaling: Granularity = option("none", "granularity of a learnable multiplier s / r")
    distance: Distance = option("none", "distance term: logit multiplier a_t (scale_invariant) or bias_t "
                                "(alibi, log_bias), t = i - j")
    tau: float = option(10.0, "length scale of scale_invariant and log_bias (>= 0.001: t / tau stays finite in "
                        "float32)", ge=1e-3)
    log_bias_lambda: float = option(1.0, "log_bias strength: bias_t = -lambda log(1 + t / tau)")
    window: int | None = option(None, "sliding window W: key j visible iff i - j < W", ge=1, le=MAX_SIZE)
    doc_masking: bool = option(False, "attend within a document only (needs doc_ids)")
    base_scale: float | None = option(None, "logit scale (default 1/sqrt(head_dim))", gt=0)
    kv_heads: int | None = option(None, "key/value heads for grouped-query attention (default: heads)", ge=1)
    qk_norm: QKNorm = option("none", "per-head norm of queries and keys over head_dim")
    qk_norm_affine: bool = option(True, "learnable QK-norm weight")
    qk_norm_eps: float = option(1e-6, "QK-norm eps; a large finite eps keeps some norm information "
                                "(seed 004)", gt=0)
    position: Position = option("rope", "positions: nope, rope, or prope (p-RoPE: rotate only the "
                                "highest-frequency pairs)")
    rope_theta: float = option(10000.0, "RoPE base", gt=0)
    prope_fraction: float = option(0.75, "p-RoPE: fraction of (highest-frequency) pairs rotated", ge=0, le=1)
    rope_min_freq: float | None = option(None, "rotated pairs' frequencies log-spaced from 1 down to this, both "
                                         "ends included (seed 000's half-truncated RoPE: 1/1024); none: "
                                         "theta^(-i / pairs)", gt=0, le=1)
    out_norm: OutNorm = option("none", "norm of the attention output (AVNorm, seed 000), per head or over "
                               "all heads")
    out_norm_affine: bool = option(False, "learnable out-norm weight")
    out_norm_eps: float = option(1e-5, "out-norm eps", gt=0)
    gate: Gate = option("none", "output gate (Qiu et al. 2025): one per head or one per channel")
    gate_act: GateAct = option("sigmoid", "gate activation: sigmoid (normal init) or 2sigmoid "
                               "(W_g = 0: identity at init)")
    gate_width: int | None = option(None, "the gate reads the first gate_width channels of the layer input "
                                    "(seed 000's modded-nanogpt: 12); none: all", ge=1)

    def __post_init__(self) -> None:
        check(self)
        if self.learnable_scaling != "none" and self.query_scaling == "none":
            raise ConfigError("AttentionSpec.learnable_scaling="
                              f"{self.learnable_scaling!r} needs query_scaling log_n, log_bn or sqrt_log_n, got "
                              "'none'", "AttentionSpec.learnable_scaling")
        if self.query_scaling in ABC_SCALINGS:
            low, why = (1, "> 0") if self.query_scaling == "sqrt_log_n" else (0, "is defined")
            if self.scaling_b < 0 or self.scaling_b + self.scaling_c <= low:
                raise ConfigError(f"AttentionSpec.scaling_b={self.scaling_b}, scaling_c={self.scaling_c} are not "
                                  f"valid; {self.query_scaling} needs b >= 0 and b + c > {low} so that log(b n + c) "
                                  f"{why} for n >= 1", "AttentionSpec.scaling_b")

    def unused(self) -> dict[str, str]:
        """The fields set away from their default that this spec's other choices never read (`USED_WITH`), each
        with the choices it needs: e.g. ``prope_fraction`` without p-RoPE, ``tau`` without a distance term."""
        return {name: needs for name, (used, needs) in USED_WITH.items()
                if getattr(self, name) != getattr(BASE, name) and not used(self)}

    # -- convenience ---------------------------------------------------------------------------------
    @property
    def has_distance_terms(self) -> bool:
        return self.distance != "none"

    def replace(self, **changes: Any) -> "AttentionSpec":
        """A copy with some fields changed (validated); unknown fields raise `ConfigError`."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSpec":
        return BASE.replace(**data)

    @classmethod
    def preset(cls, name: str, **changes: Any) -> "AttentionSpec":
        """A named variant from the seeds (see `PRESETS`), optionally with fields changed."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ConfigError(f"unknown attention preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name].replace(**changes)

    def with_preset(self, name: str) -> "AttentionSpec":
        """Preset ``name`` applied on top of this spec (`set_preset`): ``l2`` on a NoPE spec is NoPE with p = 2
        (compare's variants)."""
        return resolve_spec(AttentionSpec.set_preset(self.to_dict(), name))

    @classmethod
    def set_preset(cls, table: dict[str, Any], name: Any) -> dict[str, Any]:
        """Preset ``name`` on top of an attention table (``--set model.attention.preset=NAME``, `with_preset`):
        the fields in which the preset differs from ``baseline`` are written over the table's, whatever else the
        table holds, valid yet or not; an unknown name is set as the table's preset, for the checker to name."""
        if not isinstance(name, str) or name not in PRESETS:
            return {**table, "preset": name}
        preset = PRESETS[name]
        return {**table, **{f: to_plain(getattr(preset, f)) for f in FIELDS if getattr(preset, f) != getattr(BASE, f)}}


FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSpec))


def _check_names(changes: dict[Any, Any]) -> None:
    unknown = [name for name in changes if name not in FIELDS]
    if unknown:
        raise ConfigError(f"unknown AttentionSpec field(s) {sorted(map(str, unknown))}; valid fields: "
                          f"{', '.join(FIELDS)}")


BASE = AttentionSpec()

#: field -> (whether a spec reads it, the choices it needs): the fields that only refine another choice
USED_WITH: dict[str, tuple[Any, str]] = {
    **{f"scaling_{x}": (lambda s: s.query_scaling in ABC_SCALINGS, f"query_scaling {' or '.join(ABC_SCALINGS)}")
       for x in "abc"},
    "scaling_init": (lambda s: s.query_scaling != "none", "a query_scaling"),
    "tau": (lambda s: s.distance in ("scale_invariant", "log_bias"), "distance scale_invariant or log_bias"),
    "log_bias_lambda": (lambda s: s.distance == "log_bias", "distance log_bias"),
    "qk_norm_affine": (lambda s: s.qk_norm != "none", "a qk_norm"),
    "qk_norm_eps": (lambda s: s.qk_norm != "none", "a qk_norm"),
    "rope_theta": (lambda s: s.position != "nope" and s.rope_min_freq is None,
                   "position rope or prope and no rope_min_freq"),
    "prope_fraction": (lambda s: s.position == "prope", "position prope"),
    "rope_min_freq": (lambda s: s.position != "nope", "position rope or prope"),
    "out_norm_affine": (lambda s: s.out_norm != "none", "an out_norm"),
    "out_norm_eps": (lambda s: s.out_norm != "none", "an out_norm"),
    "gate_act": (lambda s: s.gate != "none", "a gate"),
    "gate_width": (lambda s: s.gate != "none", "a gate"),
}

#: The seeds' variants by name. Each differs from `baseline` (softmax + RoPE) in the knobs its seed studies;
#: only ALiBi, which replaces position embeddings in its paper, changes the position (scale-invariant attention
#: and seed 004's log bias were run on p-RoPE, so they keep the base's position).
PRESETS: dict[str, AttentionSpec] = {
    "baseline": BASE,
    "l2": AttentionSpec(softmax_p=2.0),                                    # seed 001
    "avnorm": AttentionSpec(out_norm="head_layer"),                        # seed 000
    "avnorm_rms": AttentionSpec(out_norm="head_rms"),                      # seed 000
    "ssmax": AttentionSpec(query_scaling="log_n", learnable_scaling="head"),  # Scalable-Softmax
    "sqrt_log_n": AttentionSpec(query_scaling="sqrt_log_n", learnable_scaling="head", qk_norm="rms"),  # seed 004
    "scale_invariant": AttentionSpec(distance="scale_invariant"),          # Anson et al. 2025 (with p-RoPE there)
    "alibi": AttentionSpec(distance="alibi", position="nope"),             # Press et al. 2022
    "log_bias": AttentionSpec(distance="log_bias"),                        # seed 004 (on its p-RoPE base)
    "gated": AttentionSpec(gate="elementwise", gate_act="2sigmoid"),       # seed 004 / Qiu et al. 2025
    "nope": AttentionSpec(position="nope"),                                # Kazemnejad et al. 2023; seed 004
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
        name = data.pop("preset", "baseline")
        _check_names(data)
        return AttentionSpec.preset(name, **data)
    raise ConfigError(f"attention spec must be an AttentionSpec, a preset name or a dict, got {type(spec).__name__}")


__all__ = ["ABC_SCALINGS", "AttentionSpec", "PRESETS", "FIELDS", "resolve_spec"]
