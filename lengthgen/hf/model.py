"""lengthgen's `GPT` as a transformers model (model type ``"lengthgen"``): what ``lengthgen export`` writes.

`LengthgenForCausalLM` wraps the `GPT` built from `LengthgenConfig.gpt` (the run's `GPTConfig`, every option),
so a loaded export runs lengthgen's own modules and math and its logits are the native model's. After
`lengthgen.hf.register` (done when `lengthgen.hf` is imported), ``AutoModelForCausalLM.from_pretrained(DIR)``
loads an exported folder. transformers' ``generate`` decodes with lengthgen's own `KVCache` (every attention option
equals recomputation; ``use_cache=False`` recomputes each step), a document-masking model starting a document at
each ``bos_token_id``; rows are never padded (``attention_mask`` must be all ones) and beam search, which reorders
caches, is not supported with the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lengthgen.attention import KVCache

# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache``: the model takes
# either name and answers under the installed version's.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
from lengthgen.attention.module import Attention
from lengthgen.config import ConfigError
from lengthgen.hf.registry import NAME
from lengthgen.model import GPT, GPTConfig


class LengthgenConfig(PretrainedConfig):
    """transformers config of an exported lengthgen model. ``gpt``: its `GPTConfig` as a dict (checked here:
    a bad value raises `ConfigError` naming the key). The transformers names (``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``tie_word_embeddings``) are read from it."""

    model_type = NAME

    def __init__(self, gpt: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.gpt = GPTConfig.from_dict(gpt or {}).to_dict()
        kwargs["tie_word_embeddings"] = self.gpt["tie_embeddings"]
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int | None:
        return self.gpt["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.gpt["dim"]

    @property
    def num_hidden_layers(self) -> int:
        return self.gpt["layers"]

    @property
    def num_attention_heads(self) -> int:
        return self.gpt["heads"]


class LengthgenForCausalLM(PreTrainedModel, GenerationMixin):
    """A lengthgen `GPT` with an ``lm`` head (``self.model``) as a transformers causal LM.

    ``forward(input_ids, attention_mask=None, labels=None, doc_ids=None, cache=None)``: logits (B, L, V) of the
    wrapped GPT (``doc_ids``: its document masking; ``cache`` or ``past_key_values``: a `KVCache`, input_ids then
    being the positions after the cached ones); with ``labels``, transformers' shifted causal-LM
    cross-entropy (``GPTConfig.z_loss`` is a term of lengthgen's own training loss, not added here).
    """

    config_class = LengthgenConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: LengthgenConfig) -> None:
        super().__init__(config)
        gpt = GPTConfig.from_dict(config.gpt)
        if gpt.resolved_head != "lm":
            raise ConfigError(f"GPTConfig.head={gpt.head!r} has no transformers causal-LM form; only lm heads are "
                              "exported (regress and classify heads are not)", "GPTConfig.head")
        self.model = GPT(gpt)
        self._backends_checked: tuple[str, torch.dtype] | None = None     # (device, dtype) `_runnable_backends` saw
        self._tied_weights_keys = self._shared_parameters()
        self.post_init()

    @classmethod
    def from_gpt(cls, gpt: GPT, **config_kwargs: Any) -> "LengthgenForCausalLM":
        """The transformers form of ``gpt`` (its config and a copy of its weights), in eval mode.
        ``config_kwargs`` go to `LengthgenConfig` (e.g. ``bos_token_id``)."""
        model = cls(LengthgenConfig(gpt=gpt.config.to_dict(), **config_kwargs))
        model.model.load_state_dict(gpt.state_dict())
        return model.eval()

    def _shared_parameters(self) -> dict[str, str]:
        """The parameters the GPT shares (tied embeddings, the one ``global`` query-scaling multiplier): every
        further name -> the first name of the same parameter."""
        first: dict[int, str] = {}
        tied = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[name] = first[id(p)]
            else:
                first[id(p)] = name
        return tied

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        """transformers' tied-weights map: the GPT's shared parameters, so each is saved once and tied again on
        load (whatever ``tie_word_embeddings`` says: the multiplier is shared too)."""
        return dict(self._tied_weights_keys)

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the GPT's own init or the checkpoint; only the RoPE frequencies (a buffer that is not
        saved, left empty when transformers builds the model on the meta device) are recomputed."""
        if isinstance(module, Attention):
            with torch.no_grad():
                module.rope_freqs.copy_(module.rope_frequencies())

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No transformers cache: `prepare_inputs_for_generation` starts lengthgen's `KVCache` (keys after QK-norm
        and RoPE, per-layer windows and documents)."""
        return False

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      past_key_values: KVCache | None = None, use_cache: bool = True,
                                      cache: KVCache | None = None, **kwargs: Any) -> dict[str, Any]:
        """A generation step's inputs: with ``use_cache`` the positions after those in the `KVCache` (a new one at
        the first step), without it the whole sequence. A model that masks documents gets ``doc_ids`` from the
        config's ``bos_token_id`` (a document starts at each BOS, as in training; `GPT.generate`'s ``bos_id``)."""
        doc_ids, bos = None, getattr(self.config, "bos_token_id", None)   # transformers 5 sets it only if given
        if bos is not None and any(spec.doc_masking for spec in self.model.config.layer_specs()):
            doc_ids = (input_ids == bos).long().cumsum(1)
        if not use_cache:
            return {"input_ids": input_ids, "attention_mask": attention_mask, "doc_ids": doc_ids}
        cache = cache if cache is not None else past_key_values
        cache = cache if isinstance(cache, KVCache) else KVCache()
        return {"input_ids": input_ids[:, cache.length:], "attention_mask": attention_mask,
                "doc_ids": None if doc_ids is None else doc_ids[:, cache.length:], "cache": cache}

    def _runnable_backends(self, kind: str) -> None:
        """The run's attention backends where they can run on device ``kind``, else ``auto`` with a warning
        (`fall_back_backends`, as ``lengthgen eval`` does for the run): a GPU run's triton layers on a CPU."""
        from lengthgen.train.setup import fall_back_backends

        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.model.embed.weight.dtype
        if self._backends_checked != (kind, dtype):
            fall_back_backends(self.model, kind, dtype)
            self._backends_checked = (kind, dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, cache: KVCache | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits of ``input_ids`` (B, L), extending ``cache`` (or ``past_key_values``, its name before transformers
        5.24) if given; transformers' other arguments (``use_cache``, ``return_dict``, ...) are accepted and
        ignored."""
        cache = cache if cache is not None else past_key_values
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("LengthgenForCausalLM has no padding: pass rows without padding (attention_mask all "
                             "ones)")
        for name in ("inputs_embeds", "position_ids"):
            if kwargs.get(name) is not None:
                raise ValueError(f"LengthgenForCausalLM does not take {name} (positions come from each layer's spec)")
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"LengthgenForCausalLM caches with lengthgen.attention.KVCache, not "
                             f"{type(cache).__name__}")
        self._runnable_backends(input_ids.device.type)
        logits = self.model(input_ids, doc_ids=doc_ids, cache=cache)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})


__all__ = ["LengthgenConfig", "LengthgenForCausalLM"]
