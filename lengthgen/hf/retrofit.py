"""Retrofit a transformers causal LM with lengthgen attention, and reload a retrofit saved with ``save_pretrained``.

`retrofit` works on models whose attention modules use transformers' functional attention interface (Llama,
Mistral, Qwen2, Qwen3, ...). Not applied on them (the model keeps its own): ``position`` / ``rope_theta`` /
``prope_fraction`` (the model applies its RoPE before the attention function; NoPE or p-RoPE retrofits are not
supported), ``rope_min_freq``, ``qk_norm*`` (Qwen3 has its own q_norm/k_norm), ``kv_heads`` (taken from the tensors);
``doc_masking`` is implied by the mask transformers builds (padding; packed sequences from ``position_ids``
resets, which transformers reads only without ``attention_mask`` and without a cache: pass ``use_cache=False``).
`retrofit` warns about these fields. A saved retrofit loads with `from_pretrained` here (``lengthgen eval --hf``
too). transformers' own ``from_pretrained`` would drop the retrofit parameters and hooks, so it must not run
the folder as the base model: the saved config's ``attn_implementation="lengthgen"`` makes transformers refuse
it without `lengthgen.hf`, and with it the attention function raises (`lengthgen.hf.attention.module_spec`). A
``learnable_scaling="global"`` multiplier is shared by reference (not for FSDP-style sharding).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention.backends import BACKENDS
from lengthgen.attention.spec import BASE, AttentionSpec, resolve_spec
from lengthgen.config import ConfigError
from lengthgen.hf.attention import LengthgenState, capture_input, needs_state, release_input
from lengthgen.hf.registry import NAME, register, require_transformers
from lengthgen.train.checkpoint import reading


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
    "rope_min_freq": "the model applies its own RoPE",
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
        notes.append(f"query_scaling={spec.query_scaling!r} multiplies the logits by a factor of n, the keys the "
                     "query sees (not 1 at init)")
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


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a copy of its config (in every submodule that holds it), so that what `retrofit` writes
    there does not reach other models built from the same config object."""
    shared = model.config
    own = copy.deepcopy(shared)
    for m in model.modules():
        if getattr(m, "config", None) is shared:
            m.config = own


def _add_state(m: nn.Module, spec: AttentionSpec, owner: LengthgenState | None) -> LengthgenState:
    """Put the spec's `LengthgenState` (at its init) on attention module ``m``, with the gate's input hooks;
    ``owner``: the state whose global multiplier it shares."""
    weight = m.o_proj.weight
    state = LengthgenState(spec, m.q_proj.in_features, m.q_proj.out_features // m.head_dim, m.head_dim,
                           owner=owner, device=weight.device, dtype=weight.dtype)
    m.lengthgen = state
    if spec.gate != "none":
        m._lengthgen_hooks = (m.register_forward_pre_hook(capture_input, with_kwargs=True),
                              m.register_forward_hook(release_input, with_kwargs=True, always_call=True))
    return state


def retrofit(model: nn.Module, spec: AttentionSpec | str | dict | None = "baseline", *, backend: str = "auto",
             warn: bool = True) -> nn.Module:
    """Make an HF causal LM run lengthgen attention with ``spec``, adding the parameters it needs; returns ``model``.

    Adds ``module.lengthgen`` (`LengthgenState`: the spec's `QueryScaling`, `OutNorm`, `OutputGate` at their
    init: affine ones/zeros, 2sigmoid gate zeros = identity, multipliers at ``scaling_init``) to every attention
    module, a pre-hook that captures the attention input for the gate, sets ``module.lengthgen_spec``,
    ``config.lengthgen_spec`` and ``config.attn_implementation = "lengthgen"`` (both saved in ``config.json`` by
    ``save_pretrained``: reload with `from_pretrained`; the model gets its own copy of the config first) and
    switches the model to ``attn_implementation="lengthgen"``. Outputs are unchanged at init when the spec allows
    it (baseline, 2sigmoid gates); otherwise, and for spec fields the HF path ignores, it warns (see
    `retrofit_notes`).
    ``backend``: the `attend` backend (auto | dense | tiled | sdpa | cpu_flash | flex | triton).
    """
    register()
    spec = resolve_spec(spec)
    if backend not in BACKENDS:
        raise ValueError(f"retrofit: unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"retrofit: found no attention modules with q/k/v/o projections in {type(model).__name__}")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ValueError(f"{type(model).__name__} does not use transformers' AttentionInterface; lengthgen cannot "
                         "replace its attention")
    _own_config(model)
    owner = None
    for _, m in modules:
        for handle in getattr(m, "_lengthgen_hooks", ()):
            handle.remove()
        m._lengthgen_hooks = ()
        if needs_state(spec):
            state = _add_state(m, spec, owner)
            if spec.learnable_scaling == "global" and owner is None:
                owner = state
        elif hasattr(m, "lengthgen"):
            del m.lengthgen
        m.lengthgen_spec = spec
        m.lengthgen_backend = backend
    model.config.lengthgen_spec = spec.to_dict()
    # saved in config.json, which transformers reads as the attention to load with: without lengthgen.hf it refuses
    # the folder instead of loading the base model (transformers drops the in-memory _attn_implementation on save)
    model.config.attn_implementation = NAME
    model.set_attn_implementation(NAME)
    if warn:
        notes = retrofit_notes(spec)
        if notes:
            warnings.warn("lengthgen.hf.retrofit: " + "; ".join(notes), stacklevel=2)
    return model


def lengthgen_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters `retrofit` added, by state-dict name."""
    return {name: p for name, p in model.named_parameters() if ".lengthgen." in f".{name}"}


#: the weights of a model folder as transformers saves them: (sharded index, single file, whether safetensors)
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors", True),
                ("pytorch_model.bin.index.json", "pytorch_model.bin", False))


def _weight_files(path: str | os.PathLike, hub_kwargs: dict[str, Any]) -> tuple[list[Path], bool]:
    """The local files of the (possibly sharded) safetensors or torch checkpoint at ``path`` (directory or hub id)
    and whether they are safetensors; FileNotFoundError when it has none."""
    from transformers.utils import cached_file

    def resolve(filename: str) -> str | None:
        if os.path.isdir(path):
            full = os.path.join(path, hub_kwargs.get("subfolder") or "", filename)
            return full if os.path.isfile(full) else None
        return cached_file(str(path), filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)

    for index_name, single, safe in WEIGHT_FILES:
        index = resolve(index_name)
        if index is not None:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        else:
            files = [single] if resolve(single) is not None else []
        if files:       # a shard the index lists but that is absent: named missing when read
            return [Path(resolve(file) or os.path.join(path, file)) for file in files], safe
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin checkpoint (sharded or not)")


def checkpoint_tensors(path: str | os.PathLike, hub_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the (possibly sharded) safetensors or torch checkpoint at ``path`` (directory or hub id); a
    file that cannot be read is a one-line `CheckpointError` naming it."""
    from safetensors.torch import load_file

    files, safe = _weight_files(path, hub_kwargs)
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with reading(file):
            found.update(load_file(file) if safe else torch.load(file, map_location="cpu", weights_only=True))
    return found


def check_weight_files(path: str | os.PathLike, hub_kwargs: dict[str, Any] | None = None) -> None:
    """A one-line `CheckpointError` naming the first weight file of the local model folder ``path`` that cannot be
    opened (a truncated copy or download), before transformers loads it (its error is a traceback): a safetensors
    file's header and size, a torch zip archive's index (memory-mapped: no tensor is read; a file of torch's legacy
    format is left to transformers). A hub id is left to transformers."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        return
    files, safe = _weight_files(path, hub_kwargs or {})
    for file in files:
        with reading(file):
            if safe:
                with safe_open(str(file), framework="pt"):
                    pass
                continue
            with open(file, "rb") as fh:
                zipped = fh.read(4) == b"PK\x03\x04"
            if zipped:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)


def causal_lm_class(config: Any, path: str | os.PathLike) -> type:
    """transformers' causal-LM class for ``config`` (the model at ``path``'s); `ConfigError` naming ``path`` when
    ``AutoModelForCausalLM`` has none (an encoder or encoder-decoder model, or remote code)."""
    cls = require_transformers().MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        raise ConfigError(f"{path}: {type(config).__name__} has no causal-LM class in transformers' "
                          "AutoModelForCausalLM (remote-code models are not supported)")
    return cls


_HUB_KEYS = ("cache_dir", "revision", "local_files_only", "token", "subfolder", "force_download", "proxies")


def _load_generation_config(model: nn.Module, path: str | os.PathLike, hub_kwargs: dict[str, Any]) -> None:
    transformers = require_transformers()
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, **hub_kwargs)
    except OSError:          # no generation_config.json: keep the one derived from the model config
        pass


def from_pretrained(path: str | os.PathLike, spec: AttentionSpec | str | dict | None = None,
                    **kwargs: Any) -> nn.Module:
    """Load a model folder (or hub id) saved after `retrofit`, or exported with ``lengthgen export``.

    Exported lengthgen runs (model type ``"lengthgen"``) load as `LengthgenForCausalLM` (``spec`` must be None:
    their specs are in their config; ``backend``, if given, replaces the run's attention backend). Otherwise
    the spec comes from ``config.lengthgen_spec`` (or ``spec`` if given) and the retrofit parameters from the
    checkpoint: the base weights are handed to the model class's ``from_pretrained`` as its ``state_dict``,
    then the model is retrofitted and the retrofit parameters copied in. A saved model without them raises
    KeyError, unless ``spec`` is given explicitly: then missing parameters keep their retrofit init.
    ``kwargs`` go to ``from_pretrained`` (``dtype``, ``device_map``, ``local_files_only``, ...); ``backend``
    (default auto) to `retrofit`.
    """
    transformers = require_transformers()
    register()
    from lengthgen.hf.model import LengthgenConfig

    backend = kwargs.pop("backend", None)
    config = kwargs.pop("config", None)
    hub_kwargs = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    if config is None:
        config = transformers.AutoConfig.from_pretrained(path, **hub_kwargs)
    if isinstance(config, LengthgenConfig):
        if spec is not None:
            raise ValueError(f"{path} is an exported lengthgen model: its attention specs are in its config "
                             "(spec= retrofits transformers models)")
        if backend is not None:
            config.gpt["attention_backend"] = backend
        check_weight_files(path, hub_kwargs)
        return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, **hub_kwargs, **kwargs)
    saved = getattr(config, "lengthgen_spec", None)
    if spec is None and saved is None:
        raise ValueError(f"{path} has no lengthgen_spec in its config (not saved after lengthgen.hf.retrofit); "
                         "pass spec=... to retrofit it now")
    spec = resolve_spec(spec if spec is not None else saved)
    cls = causal_lm_class(config, path)
    tensors = checkpoint_tensors(path, hub_kwargs)
    base = {name: t for name, t in tensors.items() if ".lengthgen." not in f".{name}"}
    kwargs.setdefault("attn_implementation", NAME)
    model = cls.from_pretrained(None, config=config, state_dict=base, **kwargs)
    model.config.name_or_path = str(path)
    _load_generation_config(model, path, hub_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        retrofit(model, spec, backend=backend or "auto")
    params = lengthgen_parameters(model)
    missing = sorted(set(params) - set(tensors))
    if missing and saved is not None and spec == resolve_spec(saved):
        raise KeyError(f"{path}: the checkpoint lacks lengthgen parameters {missing[:4]}"
                       f"{' ...' if len(missing) > 4 else ''} (saved before retrofit?)")
    with torch.no_grad():
        for name, p in params.items():
            if name in tensors:
                p.copy_(tensors[name])
    return model


__all__ = ["IGNORED_FIELDS", "WEIGHT_FILES", "attention_modules", "causal_lm_class", "check_weight_files",
           "checkpoint_tensors", "from_pretrained", "lengthgen_parameters", "retrofit", "retrofit_notes"]
