"""`Attention`: the layer around `attend()`.

``x -> q, k, v projections (GQA) -> QK-norm -> RoPE / p-RoPE -> attend -> out-norm -> gate -> o_proj``
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention import functional as fn
from lengthgen.attention.backends import BACKENDS
from lengthgen.attention.cache import KVCache
from lengthgen.attention.core import attend
from lengthgen.attention.extras import OutNorm, OutputGate, QueryScaling
from lengthgen.attention.spec import AttentionSpec, resolve_spec
from lengthgen.config import MAX_SIZE, ConfigError, check_value, invalid

#: The parameters (names inside `Attention`) that a spec adds to the q/k/v/o projections: a checkpoint
#: trained without them can be loaded, these keeping their init (e.g. a 2sigmoid gate: the identity).
SPEC_PARAMETERS = ("q_norm_weight", "k_norm_weight", "scaling.multiplier", "out_norm.weight", "out_norm.bias",
                   "gate.weight")


#: The spec fields that a layer's parameters and submodules are built from: a spec set on a built layer keeps them.
BUILT_FROM = ("kv_heads", "learnable_scaling", "out_norm", "out_norm_affine", "out_norm_eps", "gate", "gate_act",
              "gate_width")


def is_spec_parameter(name: str) -> bool:
    """Whether ``name`` (a parameter name inside an `Attention` layer) is one a spec adds (`SPEC_PARAMETERS`)."""
    return name in SPEC_PARAMETERS


class Attention(nn.Module):
    """Multi-head causal self-attention with every lengthgen mechanism.

    Args:
        dim: model width. heads: query heads. spec: `AttentionSpec`, preset name or dict.
        layer_index: the layer's index (for per-layer specs and diagnostics).
        head_dim: default ``dim // heads``. backend: see `attend`.
        multiplier: a shared parameter for ``learnable_scaling="global"`` (one for the whole model, from
            `QueryScaling.new_parameter`); without it a global multiplier is owned by this layer.
        out_proj: False leaves ``o_proj`` out (an identity): the layer returns the merged heads (B, L, H*D),
            for a block that projects them together with another branch (seed 001's parallel block).
    Submodules: ``scaling`` (`QueryScaling`), ``out_norm`` (`OutNorm`), ``gate`` (`OutputGate`).
    Setting ``self.capture = {}`` makes the next forward store its internals there (for diagnostics and
    QK-clip): ``q``, ``k``, ``v`` (after QK-norm and RoPE, before query scaling; with a cache every key it
    attended to), ``y`` (attention output before out-norm), ``y_norm`` (after out-norm and its affine) and
    ``doc_ids``.
    """

    def __init__(self, dim: int, heads: int, spec: AttentionSpec | str | dict[str, Any] | None = None, *,
                 layer_index: int = 0, head_dim: int | None = None, bias: bool = False, backend: str = "auto",
                 multiplier: nn.Parameter | None = None, out_proj: bool = True) -> None:
        super().__init__()
        self._spec = spec = resolve_spec(spec)
        dim, heads, head_dim, layer_index = self._check_sizes(spec, dim, heads, head_dim, layer_index)
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if multiplier is not None and spec.learnable_scaling == "global" and not (
                isinstance(multiplier, nn.Parameter) and multiplier.dim() == 0):    # else not learned, or per head
            got = (f"a {type(multiplier).__name__} of shape {tuple(multiplier.shape)}"
                   if isinstance(multiplier, torch.Tensor) else f"a {type(multiplier).__name__}")
            raise ConfigError(f"Attention.multiplier must be the 0-d nn.Parameter that learnable_scaling='global' "
                              f"layers share (QueryScaling.new_parameter), got {got}", "Attention.multiplier")
        self.dim, self.heads, self.head_dim, self.kv_heads = dim, heads, head_dim, spec.kv_heads or heads
        self.layer_index, self.backend, self.capture = layer_index, backend, None
        inner, kv_inner = heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(dim, kv_inner, bias=bias)
        self.v_proj = nn.Linear(dim, kv_inner, bias=bias)
        self.o_proj = nn.Linear(inner, dim, bias=bias) if out_proj else nn.Identity()
        affine_qk = spec.qk_norm != "none" and spec.qk_norm_affine
        self.q_norm_weight = nn.Parameter(torch.ones(self.head_dim)) if affine_qk else None
        self.k_norm_weight = nn.Parameter(torch.ones(self.head_dim)) if affine_qk else None
        self.scaling = QueryScaling(spec, heads, multiplier)
        self.out_norm = OutNorm(spec, heads, self.head_dim)
        self.gate = OutputGate(spec, dim, heads, self.head_dim)
        self.register_buffer("rope_freqs", self.rope_frequencies(), persistent=False)

    @property
    def spec(self) -> AttentionSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: AttentionSpec | str | dict[str, Any]) -> None:
        """Another spec for the built layer (``layer.spec = layer.spec.replace(window=64)``): it may change what
        `attend` and the positions read (``rope_freqs`` is recomputed), not what the layer's parameters and
        submodules were built from (`BUILT_FROM`, QK-norm's weights): that is a `ConfigError` naming the fields."""
        spec = resolve_spec(spec)
        built = [f for f in BUILT_FROM if getattr(spec, f) != getattr(self._spec, f)
                 and not (f == "kv_heads" and (spec.kv_heads or self.heads) == self.kv_heads)]
        if (spec.qk_norm != "none" and spec.qk_norm_affine) != (self.q_norm_weight is not None):   # its weights
            built.append("qk_norm" if spec.qk_norm != self._spec.qk_norm else "qk_norm_affine")
        if built:
            changes = ", ".join(f"{f} {getattr(self._spec, f)!r} -> {getattr(spec, f)!r}" for f in built)
            raise ConfigError(f"Attention.spec: {changes} would change the layer's parameters or submodules, built "
                              "from the spec it was made with; build a new Attention with this spec", "Attention.spec")
        self._check_sizes(spec, self.dim, self.heads, self.head_dim, self.layer_index)
        self._spec = spec
        self._reset_rope_freqs()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "spec" in state:           # a layer pickled whole (torch.save(model)) before spec became a property
            state["_spec"] = state.pop("spec")
        super().__setstate__(state)

    @staticmethod
    def _check_sizes(spec: AttentionSpec, dim: Any, heads: Any, head_dim: Any, layer_index: Any
                     ) -> tuple[int, int, int, int]:
        """``(dim, heads, head_dim, layer_index)`` checked (a `ConfigError` naming the argument), with head_dim
        resolved to ``dim // heads`` when None."""
        dim = check_value("Attention.dim", dim, int, ge=1, le=MAX_SIZE)
        heads = check_value("Attention.heads", heads, int, ge=1, le=MAX_SIZE)
        head_dim = check_value("Attention.head_dim", head_dim, int | None, ge=1, le=MAX_SIZE)
        layer_index = check_value("Attention.layer_index", layer_index, int, ge=0)
        if head_dim is None and dim % heads:
            raise invalid("Attention.heads", heads, f"a divisor of dim={dim} (or pass head_dim)")
        head_dim = head_dim or dim // heads
        if heads % (spec.kv_heads or heads):
            raise invalid("AttentionSpec.kv_heads", spec.kv_heads, f"a divisor of heads={heads}")
        if head_dim % 2 and spec.position != "nope":
            raise invalid("Attention.head_dim", head_dim, f"even for position={spec.position!r}, which rotates pairs "
                          "of dimensions (dim // heads when not given)")
        return dim, heads, head_dim, layer_index

    def rope_frequencies(self) -> torch.Tensor:
        """The ``rope_freqs`` buffer's value: RoPE / p-RoPE frequencies of the spec (all 0 for NoPE). The buffer is
        not saved: loaders that build the layer on the meta device (transformers) recompute it from this."""
        fraction = {"nope": 0.0, "rope": 1.0, "prope": self.spec.prope_fraction}[self.spec.position]
        return fn.rope_frequencies(self.head_dim, self.spec.rope_theta, fraction, min_freq=self.spec.rope_min_freq)

    def _apply(self, fn, recurse: bool = True):
        """After every cast or move ``rope_freqs`` is set anew from the spec (computed as at construction, then
        moved): ``module.to(torch.bfloat16)`` (``.half()``, ...) casts every floating buffer, and half-precision
        frequencies are kept in float32 (bfloat16 ones are off by up to 2^-9 relative, an angle error of about 2 rad
        at position 4096; transformers' Llama rotary embedding likewise builds its ``inv_freq`` in float32);
        ``to_empty`` of a layer built on the meta device would leave them uninitialized, and no state dict holds
        them."""
        super()._apply(fn, recurse)
        self._reset_rope_freqs()
        return self

    def _reset_rope_freqs(self) -> None:
        """``rope_freqs`` computed anew from the spec, on the buffer's device and in its dtype (float32 for a half
        one)."""
        dtype = self.rope_freqs.dtype
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.rope_freqs = self.rope_frequencies().to(self.rope_freqs.device, dtype)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, value: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """``value``: an optional (B, L, Hkv*D) term added to the values (seed 000's value embeddings).
        ``cache``: x holds the positions after those in ``cache.layer(layer_index)``, whose keys and values this
        call attends to and extends (``doc_ids``: the new positions' ids)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"Attention expects (batch, length, dim={self.dim}) input, got {got}")
        self._check_activations("x", x)
        b, length, _ = x.shape
        if value is not None:
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b, length, self.kv_heads * self.head_dim):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"Attention: value must be (batch, length, kv_heads * head_dim) = "
                                 f"{(b, length, self.kv_heads * self.head_dim)}, got {got}")
            self._check_activations("value", value)
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"Attention: cache must be a KVCache (lengthgen.attention) or None, got "
                             f"{type(cache).__name__}")
        spec = self.spec
        q = self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x)
        v = (v if value is None else v + value).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if spec.qk_norm != "none":
            q = fn.head_norm(q, spec.qk_norm, spec.qk_norm_eps, self.q_norm_weight)
            k = fn.head_norm(k, spec.qk_norm, spec.qk_norm_eps, self.k_norm_weight)
        past = None if cache is None else cache.layer(self.layer_index, owner=self)
        if spec.position != "nope":
            start = 0 if past is None else past.seen
            pos = torch.arange(start, start + length, device=x.device)
            q, k = fn.apply_rope(q, pos, self.rope_freqs), fn.apply_rope(k, pos, self.rope_freqs)
        if past is not None:
            k, v, doc_ids = past.extend(k, v, doc_ids)
        y = attend(q, k, v, spec, doc_ids=doc_ids, multipliers=self.scaling.multiplier, backend=self.backend)
        out = self.output(y, x, capture=(q, k, v, doc_ids) if self.capture is not None else None)
        if past is not None:          # only now: a forward that raised leaves the cache as it was
            past.keep(k, v, doc_ids, spec.window)
        return out

    def _check_activations(self, name: str, t: torch.Tensor) -> None:
        """A ValueError naming ``name`` unless ``t`` is floating-point, on the layer's device and of its dtype (any
        float dtype under autocast)."""
        weight = self.q_proj.weight
        if not t.is_floating_point() or t.device != weight.device or (t.dtype != weight.dtype and not (
                torch.amp.is_autocast_available(t.device.type) and torch.is_autocast_enabled(t.device.type))):
            raise ValueError(f"Attention: {name} must be floating-point activations on the layer's device and of its "
                             f"dtype ({weight.device}, {weight.dtype}; another under autocast), got {t.dtype} on "
                             f"{t.device}")

    def output(self, y: torch.Tensor, x: torch.Tensor, capture: tuple | None = None) -> torch.Tensor:
        """out-norm -> gate -> merge heads -> o_proj for attention output y (B, H, L, D) and layer input x.
        Pure tensor code: `torch.compile` fuses it."""
        y_norm = self.out_norm(y)
        if capture is not None:
            q, k, v, doc_ids = capture
            self.capture.update(q=q, k=k, v=v, y=y, y_norm=y_norm, doc_ids=doc_ids)
        y = self.gate(y_norm, x)
        b, _, length, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, length, self.heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, layer={self.layer_index}"
