"""lengthgen attention inside Hugging Face transformers models (optional extra: ``pip install lengthgen[hf]``).

Importing this module registers an attention implementation named ``"lengthgen"`` with transformers'
``AttentionInterface`` (and its mask with ``AttentionMaskInterface``), so any model that uses the standard
functional attention interface (Llama, Mistral, Qwen2, Qwen3, ...) can run lengthgen's attention math::

    import lengthgen.hf as lhf
    model = lhf.retrofit(AutoModelForCausalLM.from_pretrained(path), "gated")   # spec + parameters, ready to finetune
    model.save_pretrained(out); model = lhf.from_pretrained(out)                 # reload keeps the retrofit

What the HF path computes, per attention layer, on the model's own projected (and RoPE-rotated) q, k, v:
p-softmax, query-length scaling (n_i = visible *real* tokens: padding and other packed documents are not
counted), distance terms (scale_invariant, alibi, log_bias), sliding windows, then out-norm (+ affine) and the
output gate on the per-head output, before ``o_proj``. The logit scale is the model's own ``scaling`` unless
the spec sets ``base_scale``.

Where the spec comes from: ``module.lengthgen_spec`` on each attention module (set by `retrofit`), else
``model.config.lengthgen_spec`` (a dict, saved in ``config.json`` by ``save_pretrained``), else ``baseline``.

Not applied by the HF path (the model keeps its own): ``position`` / ``rope_theta`` / ``prope_fraction`` (the
model applies its RoPE before the attention function; NoPE or p-RoPE retrofits are not supported), ``qk_norm*``
(Qwen3 has its own q_norm/k_norm), ``kv_heads`` (taken from the tensors). ``doc_masking`` is implied by the
mask HF builds (padding, packed sequences from ``position_ids``). `retrofit` warns about these fields.

Masks: the ``"lengthgen"`` mask is HF's boolean SDPA mask. A mask that is "causal (+ sliding window) within
contiguous runs" on the real query rows (left or right padding, packed sequences, KV-cache decoding) becomes
``doc_ids`` for `lengthgen.attend` (any backend). Any other causal mask is passed to `attend` as an explicit
mask (dense, tiled, sdpa or cpu_flash; n_i = the number of keys the row sees); masks that let a query see later keys
raise ValueError.

Limits: causal decoder self-attention only (no encoder / cross attention, softcapping, attention sinks,
attention dropout, per-head masks, ``output_attentions`` weights); a plain ``AutoModelForCausalLM.from_pretrained``
of a retrofitted checkpoint ignores the spec and drops the retrofit parameters (use `from_pretrained` here);
a ``learnable_scaling="global"`` multiplier is shared by reference (not for FSDP-style sharding);
``torch.compile`` is untested (planning a mask reads its values).
"""

from __future__ import annotations

import json
import math
import os
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.core import attend
from lengthgen.attention.extras import OutNorm, OutputGate, QueryScaling
from lengthgen.attention.spec import BASE, AttentionSpec, resolve_spec
from lengthgen.eval import LongDocuments, RunEval, evaluate

NAME = "lengthgen"
_INSTALL = "lengthgen's Hugging Face integration needs transformers: pip install 'lengthgen[hf]'"
# Causal LMs whose logits are exactly lm_head(final hidden states): `token_losses` can chunk the vocabulary matmul.
_PLAIN_LM_HEADS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"{_INSTALL} ({err})") from err
    return transformers


# ---------------------------------------------------------------------------------------------------
# masks -> documents


def _bool_mask(mask: Any) -> torch.Tensor | None:
    """HF's mask as a boolean (B, 1, Lq, Lk) tensor (True = visible), or None for plain causal."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"lengthgen attention got a {type(mask).__name__} attention mask; it needs a boolean or "
                        "additive float tensor (use attn_implementation='lengthgen', not a flex BlockMask)")
    if mask.dim() == 2:      # a raw (B, Lk) padding mask (1 = token), e.g. from a model that forwards it untouched
        raise ValueError("lengthgen attention got a 2D padding mask: the model did not build a 4D mask for the "
                         "'lengthgen' implementation (is lengthgen.hf.register() called before the forward?)")
    if mask.dim() != 4:
        raise ValueError("lengthgen attention expects a 4D (batch, 1, queries, keys) mask, "
                         f"got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if (mask[allowed] != 0).any():
        raise ValueError("lengthgen attention got an additive float mask with biases other than 0 / -inf; "
                         "only visibility masks are supported")
    return allowed


class _Plan:
    """How to run one (mask, sizes, window): keys kept, and doc_ids or an explicit boolean mask for `attend`."""

    __slots__ = ("lk", "doc_ids", "dense")

    def __init__(self, lk: int, doc_ids: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> None:
        self.lk, self.doc_ids, self.dense = lk, doc_ids, dense


def _expected(lq: int, lk: int, doc_ids: torch.Tensor | None, window: int | None, device) -> torch.Tensor:
    spec = BASE.replace(window=window, doc_masking=doc_ids is not None)
    visible = mods.mask_mod_for(spec, lq, lk, mods.document_starts(spec, doc_ids))
    return mods.dense_mask(visible, 1 if doc_ids is None else doc_ids.shape[0], lq, lk, device)


def plan_mask(allowed: torch.Tensor, lq: int, lk: int, window: int | None) -> _Plan:
    """Turn a boolean (B, 1, Lq, Lk) mask into documents for `attend`, or keep it as an explicit mask.

    Queries are the last Lq of the kept keys. Trailing key columns that no query sees (an unfilled static
    cache) are dropped. A query row is *real* if it sees its own key; padding rows (which see nothing, or
    only earlier keys) are not constrained and their outputs are unspecified (finite). On real rows the
    mask must be "causal, inside ``window``, same contiguous run": each real row's first visible key starts
    a run unless the window cut it.
    """
    if allowed.shape[-1] < lk:
        raise ValueError(f"lengthgen attention: mask covers {allowed.shape[-1]} keys but there are {lk}")
    allowed = allowed[..., :lk]
    if allowed.shape[1] != 1:
        raise ValueError("lengthgen attention supports masks shared by all heads (B, 1, Lq, Lk), "
                         f"got {tuple(allowed.shape)}")
    b = allowed.shape[0]
    seen = allowed.any(dim=(0, 1, 2)).nonzero()
    lk = max(lq, int(seen.max()) + 1 if len(seen) else lq)
    allowed = allowed[..., :lk]
    a = allowed[:, 0]                                              # (B, Lq, Lk)
    rows = torch.arange(lq, device=a.device)
    q_pos = rows + (lk - lq)
    future = torch.arange(lk, device=a.device)[None, :] > q_pos[:, None]
    if (a & future).any():
        raise ValueError("lengthgen attention is causal: the attention mask lets queries see later keys "
                         "(bidirectional or prefix-LM masks are not supported)")
    real = a[:, rows, q_pos]                                       # (B, Lq): the query sees itself
    first = a.to(torch.uint8).argmax(-1)                           # first visible key of each row
    starts = real if window is None else real & (q_pos[None, :] - first + 1 < window)
    boundary = torch.zeros(b, lk, dtype=torch.bool, device=a.device)
    boundary[:, 0] = True
    boundary.scatter_(1, torch.where(starts, first, torch.zeros_like(first)), True)
    doc_ids = boundary.long().cumsum(-1) - 1
    if not bool(boundary[:, 1:].any()):
        doc_ids = None
    want = _expected(lq, lk, doc_ids, window, a.device)[:, 0].expand_as(a)
    if bool(((want != a) & real[:, :, None]).any()):
        return _Plan(lk, dense=allowed)
    return _Plan(lk, doc_ids=doc_ids)


_PLANS: list[tuple[Any, tuple, _Plan]] = []    # a few recent plans: every layer of a forward shares one mask


def _plan_for(mask: torch.Tensor, allowed: torch.Tensor, lq: int, lk: int, window: int | None) -> _Plan:
    key = (mask.shape, mask.device, lq, lk, window, getattr(mask, "_version", None))
    for ref, k, plan in _PLANS:
        if ref() is mask and k == key:
            return plan
    plan = plan_mask(allowed, lq, lk, window)
    _PLANS.insert(0, (weakref.ref(mask), key, plan))
    del _PLANS[4:]
    return plan


# ---------------------------------------------------------------------------------------------------
# per-module state: the parameters a spec adds (out-norm affine, gate, learnable query scaling)


class LengthgenState(nn.Module):
    """What `retrofit` adds to one HF attention module (as ``module.lengthgen``): the spec's extras ``scaling``
    (`QueryScaling`), ``out_norm`` (`OutNorm`) and ``gate`` (`OutputGate`), as in lengthgen's `Attention`.

    A ``learnable_scaling="global"`` multiplier is owned by the first attention module and held by reference
    (not registered, so it is saved once) by the others. ``x`` holds the attention input during a forward
    (captured by a pre-hook) for the gate.
    """

    def __init__(self, spec: AttentionSpec, hidden_size: int, heads: int, head_dim: int, *,
                 shared_multiplier: nn.Parameter | None = None, device=None, dtype=None) -> None:
        super().__init__()
        f = dict(device=device, dtype=dtype)
        shared = spec.learnable_scaling == "global" and shared_multiplier is not None
        self._shared = [shared_multiplier] if shared else []       # a plain list: not registered here
        self.scaling = None if shared else QueryScaling(spec, heads, **f)
        self.out_norm = OutNorm(spec, heads, head_dim, **f)
        self.gate = OutputGate(spec, hidden_size, heads, head_dim, **f)
        self.x: torch.Tensor | None = None

    @property
    def multiplier(self) -> torch.Tensor | None:
        """The query-scaling multiplier this module runs with (its own or the shared global one)."""
        return self._shared[0] if self._shared else self.scaling.multiplier

    def post(self, y: torch.Tensor) -> torch.Tensor:
        """Out-norm (+ affine) and gate on the per-head output y: (B, H, Lq, D) -> (B, H, Lq, D)."""
        y = self.out_norm(y)
        if self.gate.weight is None:
            return y
        x = self.x
        if x is None or tuple(x.shape[:2]) != (y.shape[0], y.shape[2]):
            raise RuntimeError("lengthgen gate: the attention input was not captured for this forward "
                               "(call lengthgen.hf.retrofit(model, spec) to install the hook)")
        return self.gate(y, x)


def _capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    state = getattr(module, "lengthgen", None)
    if state is not None:
        state.x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)


def _release_input(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    state = getattr(module, "lengthgen", None)
    if state is not None:
        state.x = None


# ---------------------------------------------------------------------------------------------------
# the attention function


def module_spec(module: nn.Module) -> AttentionSpec:
    """The spec an HF attention module runs: ``module.lengthgen_spec``, else ``config.lengthgen_spec``, else
    baseline."""
    spec = getattr(module, "lengthgen_spec", None)
    if spec is not None:
        return spec
    return resolve_spec(getattr(getattr(module, "config", None), "lengthgen_spec", None))


def _needs_state(spec: AttentionSpec) -> bool:
    return (spec.out_norm != "none" and spec.out_norm_affine) or spec.gate != "none" or spec.learnable_scaling != "none"


def lengthgen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                scaling: float | None = None, sliding_window: int | None = None,
                                softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"lengthgen"``: q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (B, Lq, H, D).

    Setting ``module.lengthgen_record = {}`` stores this call's inputs and outputs there (for tests and
    diagnostics): q, k, v (keys kept), doc_ids, dense_mask, spec (as run), multipliers, x, y (before out-norm), out.
    """
    spec = module_spec(module)
    state = getattr(module, "lengthgen", None)
    if dropout:
        raise ValueError(f"lengthgen attention has no attention dropout (got {dropout}); set the model config's "
                         "attention_dropout to 0")
    if softcap is not None or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("lengthgen attention does not support logit softcapping, position biases or attention sinks")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError("lengthgen attention is causal; this module asks for bidirectional attention")
    if _needs_state(spec) and state is None:
        raise RuntimeError(f"the lengthgen spec on {type(module).__name__} needs parameters (out-norm affine, gate or "
                           "learnable query scaling): call lengthgen.hf.retrofit(model, spec) first")
    base = spec.base_scale if spec.base_scale is not None else (scaling or 1.0 / math.sqrt(query.shape[-1]))
    windows = [w for w in (spec.window, sliding_window) if w]
    window = min(windows) if windows else None
    multipliers = state.multiplier if state is not None else None
    if multipliers is not None:
        multipliers = multipliers.to(query.dtype)
    lq, lk = query.shape[-2], key.shape[-2]
    allowed = _bool_mask(attention_mask)
    doc_ids = dense = None
    if allowed is None:
        if 1 < lq < lk:        # as HF's sdpa: no mask with more keys than queries = prefill of an empty static cache
            lk = lq
    else:
        plan = _plan_for(attention_mask, allowed, lq, lk, sliding_window or None)   # the window HF's mask has
        lk, doc_ids, dense = plan.lk, plan.doc_ids, plan.dense
    key, value = key[..., :lk, :], value[..., :lk, :]
    run = spec.replace(base_scale=float(base), window=window, doc_masking=doc_ids is not None)
    if dense is not None:
        dense = dense.expand(query.shape[0], -1, -1, -1)
    y = attend(query, key, value, run, doc_ids=doc_ids, mask=dense, multipliers=multipliers,
               backend=getattr(module, "lengthgen_backend", "auto"))
    out = (state.post(y) if state is not None else fn.out_norm(y, spec.out_norm, spec.out_norm_eps)).transpose(1, 2)
    record = getattr(module, "lengthgen_record", None)
    if record is not None:
        record.update(q=query, k=key, v=value, doc_ids=doc_ids, dense_mask=dense, spec=run, multipliers=multipliers,
                      x=state.x if state is not None else None, y=y, out=out)
    return out.contiguous(), None


def register() -> None:
    """Register ``"lengthgen"`` with transformers' AttentionInterface and AttentionMaskInterface (idempotent).

    Done when this module is imported (if transformers is installed)."""
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, lengthgen_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


# ---------------------------------------------------------------------------------------------------
# retrofit, save / reload


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The HF self-attention modules of ``model``: those with q/k/v/o projections, ``head_dim`` and a config."""
    found = []
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "config")) \
                and isinstance(getattr(m, "q_proj"), nn.Linear):
            found.append((name, m))
    return found


#: Spec fields the HF path does not apply, with why.
IGNORED_FIELDS = {
    "position": "the model applies its own RoPE before the attention function",
    "rope_theta": "the model applies its own RoPE",
    "prope_fraction": "the model applies its own RoPE",
    "qk_norm": "QK-norm is the model's own (e.g. Qwen3 q_norm/k_norm)",
    "qk_norm_affine": "QK-norm is the model's own",
    "qk_norm_eps": "QK-norm is the model's own",
    "kv_heads": "key/value heads come from the model",
    "doc_masking": "documents come from the model's attention mask (padding, packed position_ids)",
}


def retrofit_notes(spec: AttentionSpec | str | dict | None) -> list[str]:
    """Why a retrofitted model's outputs differ from the original at init, and which fields are not applied."""
    spec = resolve_spec(spec)
    notes = []
    for field, why in IGNORED_FIELDS.items():
        if getattr(spec, field) != getattr(BASE, field):
            notes.append(f"{field}={getattr(spec, field)!r} is not applied on HF models ({why})")
    if spec.softmax_p != 1:
        notes.append(f"softmax_p={spec.softmax_p} changes the attention weights")
    if spec.query_scaling != "none":
        notes.append(f"query_scaling={spec.query_scaling!r} multiplies the logits by g(n) != 1")
    if spec.distance != "none":
        notes.append(f"distance={spec.distance!r} changes the logits")
    if spec.window is not None:
        notes.append(f"window={spec.window} hides keys further than the window")
    if spec.base_scale is not None:
        notes.append(f"base_scale={spec.base_scale} replaces the model's own logit scale")
    if spec.out_norm != "none":
        notes.append(f"out_norm={spec.out_norm!r} normalizes the attention output (not an identity at init)")
    if spec.gate != "none" and spec.gate_act == "sigmoid":
        notes.append("gate_act='sigmoid' starts near 0.5, not 1 (use gate_act='2sigmoid' for an identity at init)")
    return notes


def retrofit(model: nn.Module, spec: AttentionSpec | str | dict | None = "baseline", *, backend: str = "auto",
             warn: bool = True) -> nn.Module:
    """Make an HF causal LM run lengthgen attention with ``spec``, adding the parameters it needs; returns ``model``.

    Adds ``module.lengthgen`` (`LengthgenState`: the spec's `QueryScaling`, `OutNorm`, `OutputGate` at their
    init: affine ones/zeros, 2sigmoid gate zeros = identity, multipliers at ``scaling_init``) to every attention
    module, a pre-hook that
    captures the attention input for the gate, sets ``module.lengthgen_spec``, ``config.lengthgen_spec`` (saved by
    ``save_pretrained``) and ``attn_implementation="lengthgen"``. Outputs are unchanged at init when the spec
    allows it (baseline, 2sigmoid gates); otherwise, and for spec fields the HF path ignores, it warns
    (see `retrofit_notes`). ``backend``: the `attend` backend (auto | dense | tiled | sdpa | cpu_flash | flex |
    triton).
    """
    register()
    spec = resolve_spec(spec)
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"retrofit: found no attention modules with q/k/v/o projections in {type(model).__name__}")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ValueError(f"{type(model).__name__} does not use transformers' AttentionInterface; lengthgen cannot "
                         "replace its attention")
    shared = None
    for _, m in modules:
        heads = m.q_proj.out_features // m.head_dim
        weight = m.o_proj.weight
        for handle in getattr(m, "_lengthgen_hooks", ()):
            handle.remove()
        m._lengthgen_hooks = ()
        if _needs_state(spec):
            state = LengthgenState(spec, m.q_proj.in_features, heads, m.head_dim, shared_multiplier=shared,
                                   device=weight.device, dtype=weight.dtype)
            if spec.learnable_scaling == "global" and shared is None:
                shared = state.multiplier
            m.lengthgen = state
            if spec.gate != "none":
                m._lengthgen_hooks = (m.register_forward_pre_hook(_capture_input, with_kwargs=True),
                                      m.register_forward_hook(_release_input, with_kwargs=True, always_call=True))
        elif hasattr(m, "lengthgen"):
            del m.lengthgen
        m.lengthgen_spec = spec
        m.lengthgen_backend = backend
    model.config.lengthgen_spec = spec.to_dict()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    if warn:
        notes = retrofit_notes(spec)
        if notes:
            warnings.warn("lengthgen.hf.retrofit: " + "; ".join(notes), stacklevel=2)
    return model


def lengthgen_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters `retrofit` added, by state-dict name."""
    return {name: p for name, p in model.named_parameters() if ".lengthgen." in f".{name}"}


def _checkpoint_tensors(path: str | os.PathLike, names: set[str],
                        hub_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read ``names`` from the (possibly sharded) safetensors or torch checkpoint at ``path`` (directory or hub id)."""
    from transformers.utils import cached_file

    def resolve(filename: str) -> str | None:
        if os.path.isdir(path):
            full = os.path.join(path, hub_kwargs.get("subfolder") or "", filename)
            return full if os.path.isfile(full) else None
        return cached_file(str(path), filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)

    found: dict[str, torch.Tensor] = {}
    for index_name, single, safe in (("model.safetensors.index.json", "model.safetensors", True),
                                     ("pytorch_model.bin.index.json", "pytorch_model.bin", False)):
        index = resolve(index_name)
        if index is not None:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            files = sorted({weight_map[n] for n in names if n in weight_map})
        else:
            files = [single] if resolve(single) is not None else []
        for file in files:
            local = resolve(file)
            if safe:
                from safetensors import safe_open
                with safe_open(local, framework="pt") as fh:
                    found.update({n: fh.get_tensor(n) for n in names if n in fh.keys()})
            else:
                data = torch.load(local, map_location="cpu", weights_only=True)
                found.update({n: data[n] for n in names if n in data})
        if files:
            break
    return found


_HUB_KEYS = ("cache_dir", "revision", "local_files_only", "token", "subfolder", "force_download", "proxies")


def from_pretrained(path: str | os.PathLike, spec: AttentionSpec | str | dict | None = None,
                    **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` that restores a retrofit saved with ``save_pretrained``.

    The spec comes from ``config.lengthgen_spec`` (or ``spec`` if given); the retrofit parameters are read
    from the checkpoint (a saved model without them raises KeyError, unless ``spec`` is given explicitly: then
    missing parameters keep their retrofit init). ``kwargs`` go to ``from_pretrained`` (``dtype``,
    ``device_map``, ``local_files_only``, ...); ``backend`` to `retrofit`.
    """
    transformers = _transformers()
    register()
    backend = kwargs.pop("backend", "auto")
    config = kwargs.pop("config", None)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
    if config is None:
        config = transformers.AutoConfig.from_pretrained(path, **hub_kwargs)
    saved = getattr(config, "lengthgen_spec", None)
    if spec is None and saved is None:
        raise ValueError(f"{path} has no lengthgen_spec in its config (not saved after lengthgen.hf.retrofit); "
                         "pass spec=... to retrofit it now")
    spec = resolve_spec(spec if spec is not None else saved)
    kwargs.setdefault("attn_implementation", NAME)
    try:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{path}: {type(config).__name__} has no causal-LM class in transformers' "
                         "AutoModelForCausalLM (remote-code models are not supported)") from None
    # The checkpoint holds the retrofit parameters the bare class does not have: keep HF's load report quiet
    # about them (they are loaded below).
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", None)
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    cls._keys_to_ignore_on_load_unexpected = set(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()) \
        | {r"\.lengthgen\."}
    try:
        model = cls.from_pretrained(path, config=config, **kwargs)
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = before
        else:
            del cls._keys_to_ignore_on_load_unexpected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        retrofit(model, spec, backend=backend)
    params = lengthgen_parameters(model)
    if params:
        tensors = _checkpoint_tensors(path, set(params), hub_kwargs)
        missing = sorted(set(params) - set(tensors))
        if missing and saved is not None and spec == resolve_spec(saved):
            raise KeyError(f"{path}: the checkpoint lacks lengthgen parameters {missing[:4]}"
                           f"{' ...' if len(missing) > 4 else ''} (saved before retrofit?)")
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
    return model


# ---------------------------------------------------------------------------------------------------
# evaluation helpers


def load_local_model(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a causal LM from a local directory (never downloads), in eval mode.

    A directory saved after `retrofit` (``lengthgen_spec`` in its config) is restored with `from_pretrained`;
    other models load with their default attention. Raises FileNotFoundError naming ``path`` if it is not a
    local directory with a ``config.json``.
    """
    transformers = _transformers()
    folder = Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else ("is not a directory" if not folder.is_dir()
                                                            else "has no config.json")
        raise FileNotFoundError(f"HF model path {str(path)!r} {what}: expected a local directory saved with "
                                "save_pretrained (models are never downloaded)")
    kwargs["local_files_only"] = True
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    if getattr(config, "lengthgen_spec", None) is not None:
        model = from_pretrained(folder, config=config, **kwargs)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, **kwargs)
    return model.eval()


def load_local_tokenizer(path: str | os.PathLike, **kwargs: Any):
    """The tokenizer saved next to a local model (``local_files_only=True``); FileNotFoundError if none."""
    transformers = _transformers()
    if not Path(path).expanduser().is_dir():
        raise FileNotFoundError(f"HF tokenizer path {str(path)!r} is not a local directory")
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no tokenizer could be loaded from {str(path)!r}: {err}") from err


@torch.no_grad()
def token_losses(model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_logits: int = 1 << 26) -> torch.Tensor:
    """Per-token next-token NLL, float32 (B, L-1): column j is -log p(tokens[:, j+1] | tokens[:, :j+1]).

    ``attention_mask`` (B, L), 1 = token: targets that are padding get NaN. For plain decoder LMs (Llama,
    Mistral, Qwen2/3) the vocabulary projection runs in chunks of at most ``max_logits`` logits, so long
    sequences do not materialize (B, L, V) at once.
    """
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"token_losses expects (batch, length >= 2) token ids, got shape {tuple(tokens.shape)}")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    targets = tokens[:, 1:]
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(model).__name__ in _PLAIN_LM_HEADS and base is not None and head is not None:
        hidden = base(input_ids=tokens, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
        b, n = targets.shape
        step = max(1, max_logits // max(1, b * head.weight.shape[0]))
        parts = [torch.nn.functional.cross_entropy(head(hidden[:, i:i + step]).float().transpose(1, 2),
                                                   targets[:, i:i + step], reduction="none")
                 for i in range(0, n, step)]
        nll = torch.cat(parts, dim=1)
    else:
        logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    if attention_mask is not None:
        nll = nll.masked_fill(attention_mask[:, 1:] == 0, float("nan"))
    return nll


def measure_hf(model: nn.Module, source: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The evaluator's adapter (`lengthgen.eval.Measure`) for a causal LM: ``loss`` per position from
    `token_losses` on the batch's tokens followed by its last target (NaN outside the loss mask)."""
    tokens = torch.cat([batch.tokens, batch.targets[:, -1:]], dim=1)
    return {"loss": token_losses(model, tokens).masked_fill(~batch.loss_mask, float("nan"))}


def evaluate_hf(path: str | os.PathLike, *, corpus: str = "stdlib", lengths: list[int] = (256, 1024),
                tokens: int = 8192, split: str = "val", seed: int = 0) -> RunEval:
    """Loss by position of a local HF model (`load_local_model`) on single long documents of ``corpus``'s
    ``split``, tokenized with the model's own tokenizer: `lengthgen.eval.evaluate` with `measure_hf`, in the
    model's own dtype."""
    from lengthgen.data.text import make_text_data

    model = load_local_model(path)
    data = make_text_data(corpus, f"hf:{path}", split=split)
    source = LongDocuments([(f"{split} split", data)], data)
    result = evaluate(model, source, list(lengths), tokens_per_length=tokens, seed=seed, diagnostics=False,
                      measure=measure_hf)
    return replace(result, config={"hf_model": str(path), "corpus": corpus, "split": split})


try:
    register()
except ImportError:      # transformers is optional: the functions above raise a clear ImportError when used
    pass

__all__ = ["LengthgenState", "attention_modules", "evaluate_hf", "from_pretrained", "lengthgen_attention_forward",
           "lengthgen_parameters", "load_local_model", "load_local_tokenizer", "measure_hf", "module_spec",
           "plan_mask", "register", "retrofit", "retrofit_notes", "token_losses"]
