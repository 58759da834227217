"""lengthgen and Hugging Face transformers (optional extra: ``pip install lengthgen[hf]``).

Both directions::

    import lengthgen.hf as lhf
    model = lhf.retrofit(AutoModelForCausalLM.from_pretrained(path), "gated")  # lengthgen attention in a Llama
    model.save_pretrained(out); model = lhf.from_pretrained(out)                # reload keeps the retrofit
    lhf.export_run("runs/l2", "hf/l2"); model = lhf.from_pretrained("hf/l2")    # a lengthgen run as a HF model

Modules: ``masks`` (transformers masks -> documents for `attend`), ``attention`` (the ``"lengthgen"``
attention function and the parameters a spec adds), ``retrofit`` (retrofit, reload), ``model`` (the exported
model type ``"lengthgen"``), ``export`` (``lengthgen export``), ``eval`` (local models by position and their
retrieval maps through lengthgen's evaluator), ``registry`` (`register`). Importing this package calls `register`
when transformers is installed; nothing else changes transformers.
"""

from lengthgen.hf.attention import LengthgenState, lengthgen_attention_forward, module_spec
from lengthgen.hf.eval import (evaluate_hf, load_local_model, measure_hf, measure_needle_hf, needle_hf,
                               token_losses)
from lengthgen.hf.export import byte_tokenizer, export_run
from lengthgen.hf.masks import plan_mask
from lengthgen.hf.registry import register
from lengthgen.hf.retrofit import (attention_modules, from_pretrained, lengthgen_parameters, retrofit,
                                   retrofit_notes)

try:
    register()
except ImportError:      # transformers is optional: the functions above raise a clear ImportError when used
    pass

__all__ = ["LengthgenState", "attention_modules", "byte_tokenizer", "evaluate_hf", "export_run", "from_pretrained",
           "lengthgen_attention_forward", "lengthgen_parameters", "load_local_model", "measure_hf", "measure_needle_hf",
           "module_spec", "needle_hf", "plan_mask", "register", "retrofit", "retrofit_notes", "token_losses"]
