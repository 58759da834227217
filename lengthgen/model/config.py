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
from dataclasses import dataclass
from typing import Any

from lengthgen.attention import AttentionSpec, resolve_spec
from lengthgen.model.norms import NORMS

PLACEMENTS = ("pre", "post", "peri", "hybrid", "hybrid_star", "mix")
MLPS = ("gelu", "relu2")
HEADS = ("lm", "regress", "classify")
#: placements that end with a norm before the head (post ends normalized already)
FINAL_NORM_PLACEMENTS = ("pre", "peri", "hybrid", "hybrid_star", "mix")


def _err(field: str, value: Any, what: str) -> ValueError:
    return ValueError(f"model.{field}={value!r} is not valid; {what}")


def _check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _err(field, value, f"it must be an integer >= {minimum}")


def _check_number(field: str, value: Any, minimum: float, *, strict: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or (value <= minimum if strict else value < minimum):
        raise _err(field, value, f"it must be a number {'>' if strict else '>='} {minimum}")


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _err(field, value, f"choose one of {', '.join(choices)}")


def resolve_layer_spec(value: Any, default: AttentionSpec) -> AttentionSpec:
    """A per-layer spec: preset name, AttentionSpec, dict with ``preset``, or a dict of overrides on ``default``."""
    if value is None:
        return default
    if isinstance(value, dict) and "preset" not in value:
        return default.replace(**value)
    return resolve_spec(value)


def _spec_to_plain(value: Any) -> Any:
    return value.to_dict() if isinstance(value, AttentionSpec) else value


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

    vocab_size: int | None = None
    dim: int = 128
    layers: int = 2
    heads: int = 4
    head_dim: int | None = None          # default dim // heads
    mlp_ratio: float = 4.0
    mlp: str = "gelu"                    # gelu | relu2
    dropout: float = 0.0
    tie_embeddings: bool = True          # lm head only
    norm: str = "layer"                  # layer | rms | batch (batch: seed 001 only, leaks statistics)
    norm_placement: str = "pre"          # pre | post | peri | hybrid | hybrid_star | mix
    norm_eps: float = 1e-5
    mix_alpha: float = 0.25              # mix: fraction of post-norm layers
    attention: Any = "baseline"          # AttentionSpec, preset name or dict (resolved to an AttentionSpec)
    layer_attention: Any = None          # per-layer overrides, see the module docstring
    attention_backend: str = "auto"      # see `attend`
    head: str | None = None              # lm | regress | classify (None: lm)
    num_classes: int = 0                 # classify head
    z_loss: float = 0.0                  # lm: coefficient of mean(logsumexp(logits)^2)
    logit_cap: float | None = None       # lm: logits -> cap * tanh(logits / cap)
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.vocab_size is not None:
            _check_int("vocab_size", self.vocab_size, 1)
        for name in ("dim", "layers", "heads"):
            _check_int(name, getattr(self, name), 1)
        if self.head_dim is None:
            if self.dim % self.heads:
                raise _err("heads", self.heads, f"it must divide dim={self.dim} (or set head_dim)")
        else:
            _check_int("head_dim", self.head_dim, 1)
        _check_number("mlp_ratio", self.mlp_ratio, 0, strict=True)
        _check_choice("mlp", self.mlp, MLPS)
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1) or isinstance(self.dropout, bool):
            raise _err("dropout", self.dropout, "it must be a number in [0, 1)")
        if not isinstance(self.tie_embeddings, bool):
            raise _err("tie_embeddings", self.tie_embeddings, "it must be true or false")
        _check_choice("norm", self.norm, NORMS)
        _check_choice("norm_placement", self.norm_placement, PLACEMENTS)
        _check_number("norm_eps", self.norm_eps, 0, strict=True)
        if isinstance(self.mix_alpha, bool) or not isinstance(self.mix_alpha, (int, float)) \
                or not 0 <= self.mix_alpha <= 1:
            raise _err("mix_alpha", self.mix_alpha, "it must be a number in [0, 1]")
        if self.head is not None:
            _check_choice("head", self.head, HEADS)
        if self.head == "classify":
            _check_int("num_classes", self.num_classes, 2)
        _check_number("z_loss", self.z_loss, 0)
        if self.logit_cap is not None:
            _check_number("logit_cap", self.logit_cap, 0, strict=True)
        _check_number("init_std", self.init_std, 0)
        if not isinstance(self.attention_backend, str):
            raise _err("attention_backend", self.attention_backend, "it must be a backend name")
        try:
            self.attention = resolve_spec(self.attention)
        except (ValueError, TypeError) as err:
            raise ValueError(f"model.attention: {err}") from None
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
        default, n, rules = self.attention, self.layers, self.layer_attention
        specs = [default] * n
        if rules is None:
            return specs
        if isinstance(rules, dict):
            rules = [rules]
        if not isinstance(rules, (list, tuple)):
            raise _err("layer_attention", rules, "it must be a list of rules or of per-layer specs")
        is_rule = [isinstance(r, dict) and "spec" in r for r in rules]
        if rules and not all(is_rule):
            if any(is_rule) or len(rules) != n:
                raise _err("layer_attention", rules, f"a per-layer list needs exactly layers={n} entries "
                           "(specs or None); rules are dicts with 'spec' and 'every' or 'layers'")
            for i, entry in enumerate(rules):
                try:
                    specs[i] = resolve_layer_spec(entry, default)
                except (ValueError, TypeError) as err:
                    raise ValueError(f"model.layer_attention[{i}]: {err}") from None
            return specs
        for r, rule in enumerate(rules):
            where = f"model.layer_attention[{r}]"
            unknown = set(rule) - {"spec", "every", "offset", "layers"}
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; a rule has spec and every "
                                 "(with optional offset) or layers")
            if ("every" in rule) == ("layers" in rule):
                raise ValueError(f"{where}: a rule needs exactly one of 'every' or 'layers'")
            try:
                spec = resolve_layer_spec(rule["spec"], default)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{where}.spec: {err}") from None
            if "every" in rule:
                every, offset = rule["every"], rule.get("offset", 0)
                if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                    raise ValueError(f"{where}.every={every!r} is not valid; it must be an integer >= 1")
                if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < every:
                    raise ValueError(f"{where}.offset={offset!r} is not valid; it must be in [0, every)")
                chosen = [i for i in range(n) if i % every == offset]
            else:
                if "offset" in rule:
                    raise ValueError(f"{where}: 'offset' goes with 'every', not 'layers'")
                layers = rule["layers"]
                if not isinstance(layers, (list, tuple)) or not all(
                        isinstance(i, int) and not isinstance(i, bool) and -n <= i < n for i in layers):
                    raise ValueError(f"{where}.layers={layers!r} is not valid; it must be a list of layer "
                                     f"indices in [-{n}, {n})")
                chosen = [i % n for i in layers]
            for i in chosen:
                specs[i] = spec
        return specs

    # -- (de)serialization ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["attention"] = self.attention.to_dict()
        rules = self.layer_attention
        if isinstance(rules, dict):
            rules = [rules]
        if isinstance(rules, (list, tuple)):
            out["layer_attention"] = [
                {**r, "spec": _spec_to_plain(r["spec"])} if isinstance(r, dict) and "spec" in r
                else _spec_to_plain(r) for r in rules]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown model key(s) {sorted(unknown)}; valid keys: {', '.join(sorted(names))}")
        return cls(**data)

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)
