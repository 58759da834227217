"""Local transformers models by position: loading without downloads, per-token losses, and `evaluate_hf` through
lengthgen's one evaluator (`lengthgen.eval.evaluate` with the `measure_hf` adapter); their retrieval maps
(`needle_hf`, text needles in a corpus tokenized with the model's tokenizer, with `measure_needle_hf`)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.config import ConfigError
from lengthgen.eval import DEPTHS, LongDocuments, NeedleMap, RunEval, answer_scores, evaluate, needle_map
from lengthgen.eval.evaluate import check_row_fits
from lengthgen.hf.registry import NAME, register, require_transformers
from lengthgen.hf.retrofit import WEIGHT_FILES, causal_lm_class, check_weight_files, from_pretrained

# Causal LMs whose logits are exactly lm_head(final hidden states): `token_losses` can chunk the vocabulary matmul.
_PLAIN_LM_HEADS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
#: logits per chunk of `token_losses`' vocabulary matmul (plain decoder LMs)
MAX_LOGITS = 1 << 26


def model_folder(path: str | os.PathLike) -> Path:
    """``path`` as a local model folder; FileNotFoundError naming it if it is not a directory with a config.json,
    `ConfigError` if that config.json is a lengthgen run's (a run is evaluated without --hf) or has no
    ``model_type``."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else ("is not a directory" if not folder.is_dir()
                                                            else "has no config.json")
        raise FileNotFoundError(f"HF model path {str(path)!r} {what}: expected a local directory saved with "
                                "save_pretrained or lengthgen export (models are never downloaded)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"HF model path {str(path)!r}: its config.json is not JSON ({err})") from None
    if isinstance(config, dict) and {"model", "train", "data"} <= set(config):
        raise ConfigError(f"HF model path {str(path)!r} is a lengthgen run folder: give it as the run, without "
                          f"--hf, or export it first (lengthgen export {path} --out DIR)")
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"HF model path {str(path)!r}: its config.json has no model_type, so it is not a "
                          "Hugging Face model's (save_pretrained or lengthgen export writes one)")
    return folder


def load_local_model(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a causal LM from a local directory (never downloads), in eval mode.

    A directory saved after `retrofit` (``lengthgen_spec`` in its config) or written by ``lengthgen export`` is
    loaded with `lengthgen.hf.from_pretrained`; other models with their default attention. Raises
    FileNotFoundError naming ``path`` if it is not a local directory with a ``config.json`` and weights,
    `ConfigError` naming it if the installed transformers does not know its model type or has no causal LM for it,
    `CheckpointError` naming a weight file that cannot be read (`check_weight_files`).
    """
    folder = model_folder(path)
    transformers = require_transformers()
    register()
    if not any((folder / name).is_file() for files in WEIGHT_FILES for name in files[:2]):
        raise FileNotFoundError(f"HF model path {str(path)!r} has no weights: expected model.safetensors or "
                                "pytorch_model.bin (or a sharded index of them), as save_pretrained or lengthgen "
                                "export writes")
    kwargs["local_files_only"] = True
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except ValueError as err:       # a model type this transformers does not know (a newer one, remote code)
        raise ConfigError(f"HF model path {str(path)!r}: {str(err).splitlines()[0]} (installed transformers "
                          f"{transformers.__version__})") from None
    causal_lm_class(config, path)
    if getattr(config, "lengthgen_spec", None) is not None or config.model_type == "lengthgen":
        model = from_pretrained(folder, config=config, **kwargs)       # which checks its weight files
    else:
        check_weight_files(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, **kwargs)
    return model.eval()


def _plain_lm(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(base model, LM head) of a plain decoder LM (Llama, Mistral, Qwen2/3), whose logits are the head of the
    final hidden states; None for others."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(model).__name__ in _PLAIN_LM_HEADS and base is not None and head is not None:
        return base, head
    return None


@torch.no_grad()
def token_losses(model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_logits: int = MAX_LOGITS, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token next-token NLL, float32 (B, L-1): column j is -log p(tokens[:, j+1] | tokens[:, :j+1]).

    ``attention_mask`` (B, L), 1 = token: targets that are padding get NaN. For plain decoder LMs (Llama,
    Mistral, Qwen2/3) the vocabulary projection runs in chunks of at most ``max_logits`` logits, so long
    sequences do not materialize (B, L, V) at once. ``doc_ids`` (B, L), for an exported lengthgen model
    (`LengthgenForCausalLM`), masks attention across documents as its run did (other models take none).
    """
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"token_losses expects (batch, length >= 2) token ids, got shape {tuple(tokens.shape)}")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    targets = tokens[:, 1:]
    parts = _plain_lm(model)
    if parts is not None:
        base, head = parts
        hidden = base(input_ids=tokens, attention_mask=attention_mask, use_cache=False).last_hidden_state[:, :-1]
        b, n = targets.shape
        step = max(1, max_logits // max(1, b * head.weight.shape[0]))
        nll = torch.cat([torch.nn.functional.cross_entropy(head(hidden[:, i:i + step]).float().transpose(1, 2),
                                                           targets[:, i:i + step], reduction="none")
                         for i in range(0, n, step)], dim=1)
    else:
        extra = {} if doc_ids is None else {"doc_ids": doc_ids.to(device)}
        logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False, **extra).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    if attention_mask is not None:
        nll = nll.masked_fill(attention_mask[:, 1:] == 0, float("nan"))
    return nll


def measure_hf(model: nn.Module, source: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The evaluator's adapter (`lengthgen.eval.Measure`) for a causal LM: ``loss`` per position from
    `token_losses` on the batch's tokens followed by its last target (NaN outside the loss mask). Packed rows'
    document ids go to an exported lengthgen model (its document masking); other models attend across them."""
    tokens = torch.cat([batch.tokens, batch.targets[:, -1:]], dim=1)
    doc_ids = None
    if batch.doc_ids is not None and getattr(model.config, "model_type", None) == NAME:
        doc_ids = torch.cat([batch.doc_ids, batch.doc_ids[:, -1:]], dim=1)
    return {"loss": token_losses(model, tokens, doc_ids=doc_ids).masked_fill(~batch.loss_mask, float("nan"))}


def measure_hf_memory(model: nn.Module, length: int) -> int:
    """A lower bound on the bytes `measure_hf` holds at once over one row of ``length`` (``length`` + 1 tokens),
    counting only what `token_losses` itself computes, nothing inside the model: 8 bytes per logit cross-entropy
    takes at once (the logits as float32, or their float32 copy, and the float32 log-probabilities), for every
    position (a CausalLM's logits: ``config.vocab_size`` a position) or, for a plain decoder LM, for one chunk
    (`MAX_LOGITS`) beside the final hidden states (in the head's weight dtype, which its matmul takes; a quantized
    head's is narrower). Measured peaks: about 1.5x it."""
    parts = _plain_lm(model)
    if parts is None:
        return 8 * length * model.config.vocab_size
    vocab, width = parts[1].weight.shape
    return (length + 1) * width * parts[1].weight.element_size() + 8 * min(length, max(1, MAX_LOGITS // vocab)) * vocab


def measure_needle_hf(model: nn.Module, source: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The retrieval maps' adapter (`lengthgen.eval.Measure`) for a causal LM: `answer_scores` of the logits at
    the answer positions (for plain decoder LMs the head runs on those positions only)."""
    parts = _plain_lm(model)
    if parts is None:
        logits = model(input_ids=batch.tokens, use_cache=False).logits[batch.loss_mask]
    else:
        logits = parts[1](parts[0](input_ids=batch.tokens, use_cache=False).last_hidden_state[batch.loss_mask])
    return answer_scores(logits, batch)


def _declared_bos(folder: Path) -> str | None:
    """The BOS token a model folder declares: ``tokenizer_config.json``'s ``bos_token``, else the token of
    ``config.json``'s ``bos_token_id`` in its ``tokenizer.json``; None if it declares none."""
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        bos = json.loads(tokenizer_config.read_text()).get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if isinstance(bos, str):
            return bos
    bos_id = json.loads((folder / "config.json").read_text()).get("bos_token_id")
    if isinstance(bos_id, int):
        import tokenizers
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).id_to_token(bos_id)
    return None


def _tokenizer(path: str | os.PathLike, name: str | None) -> Any:
    """The lengthgen tokenizer ``name``, or the model folder's own ``tokenizer.json`` when ``name`` is None, with
    the BOS token the folder declares (`_declared_bos`; a warning when it declares none and the tokenizer has no
    usual BOS name either, so that rows start with an id the model never saw)."""
    from lengthgen.data.text import ResourceUnavailableError, make_tokenizer

    options: dict[str, Any] = {}
    if name is None:
        folder = model_folder(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"HF model folder {str(path)!r} has no tokenizer.json: save the model's tokenizer "
                                    "there (tokenizer.save_pretrained) or name one (lengthgen eval --tokenizer byte, "
                                    "gpt2 or hf:PATH)")
        name, bos = f"hf:{path}", _declared_bos(folder)
        if bos is not None:
            options["bos_token"] = bos
    try:
        tok = make_tokenizer(name, **options)
    except (ValueError, ResourceUnavailableError) as err:
        raise ConfigError(f"tokenizer: {err}", "tokenizer") from None
    if getattr(tok, "bos_added", False):
        warnings.warn(f"tokenizer {tok.name!r} names no BOS token: every row starts with id {tok.bos_id}, past its "
                      "vocabulary (declare bos_token in the folder's tokenizer_config.json)", stacklevel=2)
    return tok


def learned_positions(model: nn.Module) -> int | None:
    """The positions a model's learned absolute position embedding holds (GPT-2's ``wpe``, OPT's
    ``embed_positions`` less its offset); None for a model without one (RoPE, ALiBi, NoPE), which runs at any
    length."""
    tokens = model.get_input_embeddings()
    tables = [module.num_embeddings - getattr(module, "offset", 0) for name, module in model.named_modules()
              if isinstance(module, nn.Embedding) and module is not tokens
              and ("pos" in name.rsplit(".", 1)[-1] or name.rsplit(".", 1)[-1] == "wpe")]
    return min(tables, default=None)


def _text_and_model(path: str | os.PathLike, tokenizer: str | None, corpus: str, split: str, lengths: list[int]
                    ) -> tuple[Any, Any, nn.Module]:
    """The tokenizer (`_tokenizer`), ``corpus``'s ``split`` tokenized with it (`make_text_data`) and the model
    (`load_local_model`), checked in that order, before the model loads; `ConfigError` naming the corpus when it
    cannot be read or has no documents there, when the tokenizer has more ids than the model's embedding, or when
    one of ``lengths`` is longer than its learned position embedding (`learned_positions`) holds."""
    from lengthgen.data.text import make_text_data

    model_folder(path)
    tok = _tokenizer(path, tokenizer)
    try:
        data = make_text_data(corpus, tok, split=split)
    except ValueError as err:           # CorpusError, ShardFormatError, a bad corpus spec
        raise ConfigError(f"--corpus: {err}", "corpus") from None
    model = load_local_model(path)
    rows = model.get_input_embeddings().num_embeddings
    if tok.vocab_size > rows:
        raise ConfigError(f"tokenizer: {tok.name!r} has {tok.vocab_size} ids but the model at {str(path)!r} embeds "
                          f"only {rows}", "tokenizer")
    positions = learned_positions(model)
    if positions is not None and max(lengths, default=0) > positions:
        raise ConfigError(f"lengths: length {max(lengths)} is longer than the {positions} positions of the learned "
                          f"position embedding of the model at {str(path)!r}; give lengths up to {positions}",
                          "lengths")
    return tok, data, model


#: tokens per forward pass of an HF model's evaluation (at least one row): its memory stays that of a few rows
#: whatever --tokens or --samples ask for
HF_FORWARD_TOKENS = 16384


def evaluate_hf(path: str | os.PathLike, *, corpus: str = "stdlib", lengths: list[int] = (256, 1024),
                tokens: int = 8192, split: str = "val", seed: int = 0, tokenizer: str | None = None,
                forward_tokens: int | None = HF_FORWARD_TOKENS) -> RunEval:
    """Loss by position of a local HF model (`load_local_model`) on single long documents of ``corpus``'s
    ``split``: `lengthgen.eval.evaluate` with `measure_hf`, in the model's own dtype, ``forward_tokens`` tokens per
    forward pass at most (None: a length's sequences at once).

    ``tokenizer``: a lengthgen tokenizer name (``byte``, ``gpt2``, ``hf:PATH``); default the folder's own
    ``tokenizer.json`` (FileNotFoundError naming the folder when it has none). A tokenizer with more ids than
    the model's embedding raises `ConfigError`, and so does, on the CPU, a length whose one row cannot fit the
    memory left beside the loaded model (`measure_hf_memory`), before any length runs.
    """
    tok, data, model = _text_and_model(path, tokenizer, corpus, split, list(lengths))
    device = next(model.parameters()).device.type
    for length in lengths:
        check_row_fits("lengths", model.config, device, length, row=measure_hf_memory(model, length))
    source = LongDocuments([(f"{split} split", data)], data)
    result = evaluate(model, source, list(lengths), tokens_per_length=tokens, seed=seed, diagnostics=False,
                      measure=measure_hf, memory=measure_hf_memory, forward_tokens=forward_tokens)
    return replace(result, config={"hf_model": str(path), "corpus": corpus, "split": split, "tokenizer": tok.name})


def needle_hf(path: str | os.PathLike, *, corpus: str = "stdlib", lengths: list[int] = (256, 512, 1024, 2048),
              depths: list[float] = DEPTHS, needles: int = 1, samples: int = 100, split: str = "val", seed: int = 0,
              tokenizer: str | None = None, train_length: int | None = None,
              forward_tokens: int | None = HF_FORWARD_TOKENS, progress: bool = True) -> NeedleMap:
    """The retrieval map of a local HF model (`lengthgen.eval.needle_map`): text needles in ``corpus``'s ``split``
    tokenized with ``tokenizer`` (as `evaluate_hf`), in the model's own dtype, ``forward_tokens`` tokens per
    forward pass at most (None: a cell's sequences at once). ``train_length`` marks the map."""
    tok, data, model = _text_and_model(path, tokenizer, corpus, split, list(lengths))
    result = needle_map(model, data, list(lengths), list(depths), needles=needles, samples=samples, seed=seed,
                        forward_tokens=forward_tokens, measure=measure_needle_hf, progress=progress,
                        train_length=train_length)
    return replace(result, config={"hf_model": str(path), "corpus": corpus, "split": split, "tokenizer": tok.name})


__all__ = ["MAX_LOGITS", "evaluate_hf", "learned_positions", "load_local_model", "measure_hf", "measure_hf_memory",
           "measure_needle_hf", "model_folder", "needle_hf", "token_losses"]
