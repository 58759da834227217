"""What lengthgen registers with transformers, and the one place that imports it for the other modules."""

from __future__ import annotations

from typing import Any

from lengthgen.optional import MissingPackageError, require

#: the attention implementation, mask and model type names lengthgen registers
NAME = "lengthgen"
#: the oldest transformers the integration is tested with: 5.0-5.3 load a saved retrofit with transformers' own
#: ``from_pretrained`` as the plain base model (its ``attn_implementation="lengthgen"`` ignored), silently
MIN_TRANSFORMERS = "5.4"


def require_transformers() -> Any:
    """The ``transformers`` module (at least `MIN_TRANSFORMERS`), or a `MissingPackageError` that says how to
    install it."""
    transformers = require("transformers", "lengthgen's Hugging Face integration", "'lengthgen[hf]'")
    from packaging.version import Version      # a dependency of transformers

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise MissingPackageError(f"lengthgen's Hugging Face integration needs transformers >= {MIN_TRANSFORMERS} "
                                  f"(installed: {transformers.__version__}): pip install -U 'lengthgen[hf]'")
    return transformers


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


__all__ = ["MIN_TRANSFORMERS", "NAME", "register", "require_transformers"]
