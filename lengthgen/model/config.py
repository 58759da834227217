"""`GPTConfig`: the decoder's shape, norms, head and per-layer attention specs.

Per-layer attention (``layer_attention``) is one of

* ``None``: every layer uses ``attention``;
* a list of *rules*, each a dict with ``spec`` and either ``every`` (with optional ``offset``, default 0:
  layers ``i`` with ``i % every == offset``) or ``layers`` (a list of indices, negative counts from the
  end). Later rules win. A single rule dict is accepted too;
* a list of exactly ``layers`` entries (no ``spec`` keys): layer i's spec, ``None`` keeping the default.

A rule's ``spec`` (or a per-layer entry) is a preset name (a whole spec, e.g. ``"nope"``), an
`AttentionSpec`, a dict with ``preset`` (that preset with fields changed), or a dict without ``preset``:
fields changed on top of the default ``attention``. Example, "every 4th layer global NoPE, the others local
RoPE with a 128-token window"::

    GPTConfig(attention={"window": 128}, layer_attention=[{"every": 4, "offset": 3, "spec": "nope"}])

In TOML: ``attention = {window = 128}`` and ``layer_attention = [{every = 4, offset = 3, spec = "nope"}]``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from lengthgen.attention import PRESETS, AttentionSpec, resolve_spec
from lengthgen.config import ConfigError, build, check, check_value, invalid, option, to_plain, unknown_key
from lengthgen.model.norms import Norm

Placement = Literal["pre", "post", "peri", "hybrid", "hybrid_star", "mix"]
Mlp = Literal["gelu", "relu2"]
Head = Literal["lm", "regress", "classify"]
Backend = Literal["auto", "dense", "tiled", "sdpa", "cpu_flash", "flex", "triton"]
PLACEMENTS = typing.get_args(Placement)
#: placements that end with a norm before the head (post ends normalized already)
FINAL_NORM_PLACEMENTS = ("pre", "peri", "hybrid", "hybrid_star", "mix")
RULE_KEYS = ("spec", "every", "offset", "layers")


def resolve_layer_spec(value: Any, default: AttentionSpec) -> AttentionSpec:
    """A per-layer spec: preset name, AttentionSpec, dict with ``preset``, or a dict of overrides on ``default``."""
    if value is None:
        return default
    if isinstance(value, dict) and "preset" not in value:
        return resolve_spec({**dataclasses.asdict(default), **value})   # default's fields, then the changes
    return resolve_spec(value)


@dataclass
class GPTConfig:
    """A decoder-only transformer. ``vocab_size``/``head``/``num_classes`` are filled from the task in runs.

    Norm placements (N = norm, F = attention or MLP):
    ``pre``: x = x + F(N(x)); ``post``: x = N(x + F(x)); ``peri`` (sandwich): x = x + N2(F(N1(x)));
    ``hybrid`` (HybridNorm, Zhuo et al. 2025): attention with QKV-norm and no pre-norm, y = x + MHA(x), then
    z = N(y), x' = z + FFN(z); QKV-norm is the spec's ``qk_norm`` on Q and K (set to the model's norm kind,
    ``rms`` for rms and ``layer`` otherwise, when the spec has none) plus the same per-head norm on V
    (`HeadNormLinear` replacing ``v_proj``); ``hybrid_star``: hybrid, and the first block also pre-norms its
    attention input; ``mix`` (Mix-LN, Li et al. 2024): post for the first ceil(mix_alpha * layers) layers,
    pre after. A final norm precedes the head for every placement except ``post``.
    """

    vocab_size: int | None = option(None, "vocabulary size (default: the data's)", ge=1)
    dim: int = option(128, "model width", ge=1)
    layers: int = option(2, "number of transformer blocks", ge=1)
    heads: int = option(4, "attention heads per layer", ge=1)
    head_dim: int | None = option(None, "width of one head (default dim // heads)", ge=1)
    mlp_ratio: float = option(4.0, "MLP hidden width / dim", gt=0)
    mlp: Mlp = option("gelu", "MLP activation: gelu or relu2 (squared ReLU)")
    dropout: float = option(0.0, "dropout probability on embeddings and residual branches", ge=0, lt=1)
    tie_embeddings: bool = option(True, "lm head shares the embedding matrix")
    norm: Norm = option("layer", "norm kind (batch: seed 001 only, it leaks statistics across positions)")
    norm_placement: Placement = option("pre", "where the norms sit in a block (see GPTConfig)")
    norm_eps: float = option(1e-5, "norm eps", gt=0)
    mix_alpha: float = option(0.25, "mix placement: fraction of post-norm layers", ge=0, le=1)
    attention: AttentionSpec = option(PRESETS["baseline"], "every layer's attention: a preset name or a "
                                      "table of AttentionSpec fields (with an optional preset)",
                                      parse=resolve_spec)
    layer_attention: Any = option(None, "per-layer attention: rules {spec, every[, offset]} or {spec, "
                                  "layers}, or one spec per layer (see the module docstring)")
    attention_backend: Backend = option("auto", "attention backend (auto picks by device, spec and size)")
    head: Head | None = option(None, "output head (default: the data's; lm without data)")
    num_classes: int = option(0, "classes of the classify head", ge=0)
    z_loss: float = option(0.0, "lm: coefficient of mean(logsumexp(logits)^2)", ge=0)
    logit_cap: float | None = option(None, "lm: logits -> cap * tanh(logits / cap)", gt=0)
    init_std: float = option(0.02, "standard deviation of the weight init", ge=0)

    def __post_init__(self) -> None:
        check(self)
        if self.head_dim is None and self.dim % self.heads:
            raise invalid("GPTConfig.heads", self.heads, f"a divisor of dim={self.dim} (or set head_dim)")
        if self.head == "classify" and self.num_classes < 2:
            raise invalid("GPTConfig.num_classes", self.num_classes, "an integer >= 2 for the classify head")
        self.layer_specs()  # validates layer_attention

    # -- derived -------------------------------------------------------------------------------------
    @property
    def resolved_head(self) -> str:
        return self.head or "lm"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.heads

    def placement(self, index: int) -> str:
        """The norm placement of layer ``index``: pre | post | peri | hybrid | hybrid_first."""
        p = self.norm_placement
        if p == "mix":
            return "post" if index < math.ceil(self.mix_alpha * self.layers) else "pre"
        if p == "hybrid_star":
            return "hybrid_first" if index == 0 else "hybrid"
        return p

    def layer_specs(self) -> list[AttentionSpec]:
        """The resolved AttentionSpec of every layer (before the hybrid placements' QKV-norm adjustment)."""
        default, n, rules, key = self.attention, self.layers, self.layer_attention, "GPTConfig.layer_attention"
        specs = [default] * n
        if rules is None:
            return specs
        if isinstance(rules, dict):
            rules = [rules]
        if not isinstance(rules, (list, tuple)):
            raise invalid(key, rules, "a list of rules or of per-layer specs")
        is_rule = [isinstance(r, dict) and "spec" in r for r in rules]
        if rules and not all(is_rule):
            if any(is_rule) or len(rules) != n:
                raise invalid(key, rules, f"a per-layer list of exactly layers={n} entries (specs or None); "
                              "rules are tables with spec and every or layers")
            for i, entry in enumerate(rules):
                specs[i] = _layer_spec(entry, default, f"{key}[{i}]")
            return specs
        for r, rule in enumerate(rules):
            where = f"{key}[{r}]"
            for name in rule:
                if name not in RULE_KEYS:
                    raise unknown_key(where, name, RULE_KEYS)
            if ("every" in rule) == ("layers" in rule):
                raise ConfigError(f"{where}: a rule needs exactly one of 'every' or 'layers'", where)
            spec = _layer_spec(rule["spec"], default, f"{where}.spec")
            if "every" in rule:
                every = check_value(f"{where}.every", rule["every"], int, ge=1)
                offset = check_value(f"{where}.offset", rule.get("offset", 0), int, ge=0, lt=every)
                chosen = [i for i in range(n) if i % every == offset]
            else:
                if "offset" in rule:
                    raise ConfigError(f"{where}: 'offset' goes with 'every', not 'layers'", where)
                chosen = [i % n for i in check_value(f"{where}.layers", rule["layers"], list[int], ge=-n, lt=n)]
            for i in chosen:
                specs[i] = spec
        return specs

    # -- (de)serialization ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        return build(cls, data)

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


def _layer_spec(value: Any, default: AttentionSpec, key: str) -> AttentionSpec:
    try:
        return resolve_layer_spec(value, default)
    except ConfigError as err:
        raise err.under(key) from None
