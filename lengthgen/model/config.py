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
from lengthgen.attention.spec import ABC_SCALINGS
from lengthgen.config import (MAX_SIZE, ConfigError, build, check, check_value, documented, invalid, option,
                              to_plain, unknown_key)
from lengthgen.model.norms import Norm

Placement = Literal["pre", "post", "peri", "hybrid", "hybrid_star", "mix"]
BlockKind = Literal["sequential", "parallel"]
Mlp = Literal["gelu", "gelu_tanh", "relu2"]
Head = Literal["lm", "regress", "classify"]
Backend = Literal["auto", "dense", "tiled", "sdpa", "cpu_flash", "flex", "triton"]
Init = Literal["normal", "uniform", "torch"]
LogitCap = Literal["tanh", "sigmoid"]
PLACEMENTS = typing.get_args(Placement)
#: placements that end with a norm before the head (post ends normalized already)
FINAL_NORM_PLACEMENTS = ("pre", "peri", "hybrid", "hybrid_star", "mix")

RULE_KEYS = ("spec", "every", "offset", "layers")


def final_norm_note(placement: str, final_norm: bool | None) -> str:
    """``, no final norm`` / ``, final norm`` where ``final_norm`` overrides the placement's default, else ''."""
    if final_norm is None or final_norm == (placement in FINAL_NORM_PLACEMENTS):
        return ""
    return ", final norm" if final_norm else ", no final norm"


def resolve_layer_spec(value: Any, default: AttentionSpec) -> AttentionSpec:
    """A per-layer spec: preset name, AttentionSpec, dict with ``preset``, or a dict of overrides on ``default``."""
    if value is None:
        return default
    if isinstance(value, dict) and "preset" not in value:
        return resolve_spec({**dataclasses.asdict(default), **value})   # default's fields, then the changes
    return resolve_spec(value)


@documented
@dataclass
class GPTConfig:
    """A decoder-only transformer. ``vocab_size``/``head``/``num_classes`` are filled from the task in runs.

    Norm placements (N = norm, F = attention or MLP):
    ``pre`` (Xiong et al. 2020): x = x + F(N(x)); ``post`` (Vaswani et al. 2017): x = N(x + F(x)); ``peri``
    (sandwich; Peri-LN, Kim et al. 2025): x = x + N2(F(N1(x))); seed 003 ("Post-Norm can Resharpen Attention")
    compares the three, seed 002 writes pre and post;
    ``hybrid`` (HybridNorm, Zhuo et al. 2025): attention with QKV-norm and no pre-norm, y = x + MHA(x), then
    z = N(y), x' = z + FFN(z); QKV-norm is the spec's ``qk_norm`` on Q and K (set to the model's norm kind,
    ``rms`` for rms and ``layer`` otherwise, when the spec has none) plus the same per-head norm on V
    (`HeadNormLinear` replacing ``v_proj``); seed 002 writes norm(Q), norm(K), norm(V) without naming the axis:
    here each head is normalized over head_dim, with the QK-norm's eps and affine; ``hybrid_star``: hybrid, and
    the first block also pre-norms its attention input (keeping its QKV-norm), Y = X + MHA(N(X)) as seed 002's
    HybridNorm*; ``mix`` (Mix-LN, Li et al. 2024): post for the first ceil(mix_alpha * layers) layers, pre
    after (seed 002 names no fraction). A final norm precedes the head for every placement except ``post``
    (seed 002's formulas stop at the block; for hybrid and mix the final norm is lengthgen's, as in
    pre-norm models, and mix keeps it even when mix_alpha = 1 makes every layer post); ``final_norm`` sets it
    either way (seed 003's component map, embedding -> attention -> residual -> RMSNorm (post / peri) ->
    unembedding, has none in its pre-norm model: with one layer, a final norm would make pre-norm a post-norm
    of the residual stream).

    Blocks (`lengthgen.model.blocks`): ``sequential`` (attention, then MLP) or ``parallel`` (seed 001: one norm,
    one input projection to q, k, v and an MLP branch, one output projection over [MLP branch, attention]);
    ``mlp_ratio = 0`` gives attention-only blocks (seed 003's minimal models), ``no_attention_layers`` MLP-only
    ones (seed 000). Seed 000's modded-nanogpt fork adds value embeddings (``value_embeds``), a U-net skip
    (``skips``) and the sigmoid soft-cap (``logit_cap_form``).
    """

    vocab_size: int | None = option(None, "vocabulary size (default: the data's)", ge=1, le=MAX_SIZE)
    dim: int = option(128, "model width", ge=1, le=MAX_SIZE)
    layers: int = option(2, "number of transformer blocks", ge=1, le=MAX_SIZE)
    heads: int = option(4, "attention heads per layer", ge=1, le=MAX_SIZE)
    head_dim: int | None = option(None, "width of one head (default dim // heads)", ge=1, le=MAX_SIZE)
    mlp_ratio: float = option(4.0, "MLP hidden width / dim; 0: attention-only blocks (seed 003)", ge=0)
    mlp: Mlp = option("gelu", "MLP activation: gelu, gelu_tanh (tanh approximation, seed 001) or relu2 "
                      "(squared ReLU)")
    block: BlockKind = option("sequential", "sequential (attention, then MLP) or parallel (seed 001: both "
                              "branches from one norm, one output projection)")
    linear_bias: bool = option(False, "the blocks' linear layers have biases (seed 001)")
    no_attention_layers: list[int] = option([], "layers without attention, MLP only (seed 000: [6]); negative "
                                            "indices count from the end")
    dropout: float = option(0.0, "dropout probability on embeddings and residual branches", ge=0, lt=1)
    tie_embeddings: bool = option(True, "lm head shares the embedding matrix")
    first_token_embedding: bool = option(False, "add a learned 2-entry embedding of 'position 0 or not' "
                                         "(seed 001's NoPE models)")
    scale_grad_by_freq: bool = option(False, "scale token-embedding gradients by the inverse frequency of "
                                      "each token in the batch (nn.Embedding's option; seed 001)")
    value_embeds: list[int] = option([], "per layer, the value-embedding table added to its values, -1: "
                                     "none; layers with the same index share a table (seed 000: [1, 2, -1, -1, "
                                     "-1, -1, -1, -1, 0, 1, 2]); empty: none", ge=-1)
    skips: list[tuple[int, int]] = option([], "U-net skips [from, to]: block from's output is added, gated, "
                                          "to block to's input (seed 000: [[3, 6]])", ge=0)
    gate_width: int | None = option(None, "the value-embedding and skip gates read the first gate_width "
                                    "channels (seed 000: 12); none: all", ge=1)
    norm: Norm = option("layer", "norm kind (batch: seed 001 only, it leaks statistics across positions)")
    norm_placement: Placement = option("pre", "where the norms sit in a block (see GPTConfig)")
    norm_eps: float = option(1e-5, "norm eps", gt=0)
    norm_affine: bool = option(True, "the model's norms have learnable weights (seed 000's have none)")
    final_norm: bool | None = option(None, "a norm before the head; none: every placement but post has one "
                                     "(seed 003's minimal pre-norm model has none: false)")
    embed_norm: bool = option(False, "normalize the embeddings (the model's norm kind) before the first block "
                              "(seed 000's modded-nanogpt)")
    mix_alpha: float = option(0.25, "mix placement: fraction of post-norm layers", ge=0, le=1)
    attention: AttentionSpec = option(PRESETS["baseline"], "every layer's attention: a preset name or a "
                                      "table of AttentionSpec fields (with an optional preset)",
                                      parse=resolve_spec)
    layer_attention: Any = option(None, "per-layer attention: rules {spec, every[, offset]} or {spec, "
                                  "layers}, or one spec per layer (see the module docstring)")
    attention_backend: Backend = option("auto", "attention backend (auto picks by device, spec and size)")
    head: Head | None = option(None, "output head (default: the data's; lm without data)")
    num_classes: int = option(0, "classes of the classify head", ge=0)
    z_loss: float = option(0.0, "lm: coefficient of mean(logsumexp(logits)^2) (PaLM's z-loss, Chowdhery et al. "
                           "2022)", ge=0)
    logit_cap: float | None = option(None, "lm: soft-cap of the logits (see logit_cap_form)", gt=0)
    logit_cap_form: LogitCap = option("tanh", "tanh: cap * tanh(logits / cap) (Gemma 2); sigmoid: cap * "
                                      "sigmoid((logits + 5) / 7.5) (seed 000's modded-nanogpt, cap 23)")
    init: Init = option("normal", "weight init: normal(0, init_std) or uniform with std init_std (zero "
                        "biases), or torch (every module's PyTorch default; seed 001)")
    init_std: float = option(0.02, "standard deviation of the weight init", ge=0)
    init_overrides: dict[str, float] = option({}, "parameter-name pattern (fnmatch, e.g. 'blocks.*.mlp.proj."
                                              "weight') -> init std, drawn like init (normal for torch); 0: "
                                              "zeros. Later patterns win", ge=0)

    def __post_init__(self) -> None:
        check(self)
        if self.head_dim is None and self.dim % self.heads:
            raise invalid("GPTConfig.heads", self.heads, f"a divisor of dim={self.dim} (or set head_dim)")
        if self.head == "classify" and self.num_classes < 2:
            raise invalid("GPTConfig.num_classes", self.num_classes, "an integer >= 2 for the classify head")
        if self.block == "parallel" and self.norm_placement.startswith("hybrid"):
            raise invalid("GPTConfig.norm_placement", self.norm_placement, "pre, post, peri or mix for "
                          "block='parallel' (hybrid placements norm attention and MLP differently)")
        if (self.gate_width or 0) > self.dim:
            raise invalid("GPTConfig.gate_width", self.gate_width, f"at most dim={self.dim}")
        self.check_layers()
        shared = self.global_scaling_spec()  # validates layer_attention
        for spec, attention in zip(self.layer_specs(), self.attention_layers()):  # what each layer's attention needs
            key = "GPTConfig.attention" if spec is self.attention else "GPTConfig.layer_attention"
            if attention and spec.learnable_scaling == "global":
                # one multiplier m of one gain g = a + m f(n) (`functional.query_gain`): the same f, and for log_bn /
                # sqrt_log_n (f of log(b n + c)) the same a, b, c
                fields = ("query_scaling", "scaling_init")
                if shared.query_scaling in ABC_SCALINGS:
                    fields += ("scaling_a", "scaling_b", "scaling_c")
                for field in fields:
                    if getattr(spec, field) != getattr(shared, field):
                        raise invalid(f"{key}.{field}", getattr(spec, field), f"{getattr(shared, field)!r}, the "
                                      f"{field} of the first layer with learnable_scaling='global' (they share one "
                                      "multiplier)")
            if self.heads % (spec.kv_heads or self.heads):
                raise invalid(f"{key}.kv_heads", spec.kv_heads, f"a divisor of heads={self.heads}")
            if (spec.gate_width or 0) > self.dim:
                raise invalid(f"{key}.gate_width", spec.gate_width, f"at most dim={self.dim} (the gate reads the "
                              "first gate_width channels of the layer input)")
            if self.resolved_head_dim % 2 and spec.position != "nope":
                raise invalid("GPTConfig.head_dim", self.resolved_head_dim, f"even (dim // heads when unset) for "
                              f"position={spec.position!r}, which rotates pairs of dimensions")

    def check_layers(self) -> None:
        """The per-layer options name existing layers, and every layer keeps attention or an MLP."""
        n = self.layers
        attention = self.attention_layers()
        if self.block == "parallel" and not all(attention):
            raise invalid("GPTConfig.no_attention_layers", self.no_attention_layers, "empty for block='parallel' "
                          "(a parallel block keeps its attention branch)")
        if 0 < self.mlp_ratio and round(self.mlp_ratio * self.dim) == 0:
            raise invalid("GPTConfig.mlp_ratio", self.mlp_ratio, f"0 (attention-only blocks) or "
                          f"more than {0.5 / self.dim:g}, so that the MLP of width round(mlp_ratio x dim) has a unit "
                          f"(dim = {self.dim})")
        if self.mlp_ratio == 0 and not all(attention):
            raise invalid("GPTConfig.no_attention_layers", self.no_attention_layers,
                          "empty when mlp_ratio = 0 (a layer would have neither attention nor an MLP)")
        if self.value_embeds and len(self.value_embeds) != n:
            raise invalid("GPTConfig.value_embeds", self.value_embeds, f"empty or one entry per layer ({n})")
        if any(t >= 0 and not attention[i] for i, t in enumerate(self.value_embeds)):
            raise invalid("GPTConfig.value_embeds", self.value_embeds, "-1 at layers without attention")
        for a, b in self.skips:
            if not a < b < n:
                raise invalid("GPTConfig.skips", self.skips, f"pairs [from, to] with from < to < layers={n}")

    def unused(self) -> list[str]:
        """Attention fields that no layer reads (`AttentionSpec.unused`; a hybrid placement's QK-norm counts),
        one message each."""
        notes, attention = {}, self.attention_layers()
        for index, spec in enumerate(self.layer_specs()):
            key = "model.attention" if spec is self.attention else "model.layer_attention"
            if not attention[index]:
                continue
            if self.placement(index).startswith("hybrid") and spec.qk_norm == "none":
                spec = spec.replace(qk_norm="rms")      # `hybrid_spec`: the layer norms queries and keys
            for name, needs in spec.unused().items():
                value = to_plain(getattr(spec, name))
                notes.setdefault((key, name, value), f"{key}.{name}={value!r} has no effect: it is read only with "
                                                     f"{needs}")
        return list(notes.values())

    def idle_windows(self, lengths: list[int]) -> list[str]:
        """A note for each sliding window at least as long as every length in ``lengths`` (those the model runs at):
        key j is visible iff i - j < window, so such a window hides no key and its layers are full causal attention."""
        notes = {}
        for spec, attention in zip(self.layer_specs(), self.attention_layers()):
            if attention and spec.window is not None and spec.window >= max(lengths):
                key = "model.attention" if spec is self.attention else "model.layer_attention"
                notes.setdefault((key, spec.window), f"{key}.window={spec.window} has no effect at lengths "
                                 f"{', '.join(map(str, lengths))}: it hides no key, so its layers are full causal "
                                 f"attention, as without a window; set a window below {max(lengths)}")
        return list(notes.values())

    def global_scaling_spec(self) -> AttentionSpec | None:
        """The spec of the first attention layer with ``learnable_scaling="global"``, whose ``scaling_init`` starts
        the one multiplier those layers share (`lengthgen.model.GPT`); None when no layer has one."""
        return next((spec for spec, attention in zip(self.layer_specs(), self.attention_layers())
                     if attention and spec.learnable_scaling == "global"), None)

    def attention_layers(self) -> list[bool]:
        """Whether each layer has attention (`no_attention_layers`, negative indices from the end)."""
        key, n = "GPTConfig.no_attention_layers", self.layers
        without = {i % n for i in check_value(key, self.no_attention_layers, list[int], ge=-n, lt=n)}
        return [i not in without for i in range(n)]

    # -- derived -------------------------------------------------------------------------------------
    @property
    def resolved_head(self) -> str:
        return self.head or "lm"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def has_final_norm(self) -> bool:
        """``final_norm``, else every placement but post (`FINAL_NORM_PLACEMENTS`)."""
        return self.norm_placement in FINAL_NORM_PLACEMENTS if self.final_norm is None else self.final_norm

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
