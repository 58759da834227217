"""What lengthgen registers with transformers, and the one place that imports it for the other modules."""

from __future__ import annotations

from typing import Any

from lengthgen.optional import require

#: the attention implementation, mask and model type names lengthgen registers
NAME = "lengthgen"


def require_transformers() -> Any:
    """The ``transformers`` module, or a `MissingPackageError` that says how to install it."""
    return require("transformers", "lengthgen's Hugging Face integration", "'lengthgen[hf]'")


def register() -> None:
    """Register lengthgen with transformers (idempotent).

    * ``"lengthgen"`` in ``AttentionInterface`` (`lengthgen.hf.attention.lengthgen_attention_forward`) and in
      ``AttentionMaskInterface`` (transformers' boolean SDPA mask), so ``attn_implementation="lengthgen"`` works;
    * the model type ``"lengthgen"`` (`LengthgenConfig`, `LengthgenForCausalLM`: exported lengthgen runs) with
      ``AutoConfig`` and ``AutoModelForCausalLM``.

    Importing `lengthgen.hf` calls it when transformers is installed. Nothing else changes transformers.
    """
    transformers = require_transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from lengthgen.hf.attention import lengthgen_attention_forward
    from lengthgen.hf.model import LengthgenConfig, LengthgenForCausalLM

    transformers.AttentionInterface.register(NAME, lengthgen_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    transformers.AutoConfig.register(LengthgenConfig.model_type, LengthgenConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(LengthgenConfig, LengthgenForCausalLM, exist_ok=True)


__all__ = ["NAME", "register", "require_transformers"]
