"""``lengthgen export RUN --out DIR``: a trained run as a transformers model folder.

The folder holds ``config.json`` (model type ``"lengthgen"``: `LengthgenConfig` with the run's `GPTConfig`),
``model.safetensors`` and ``generation_config.json``, plus the run's tokenizer where transformers can load it:
the byte tokenizer as a ``tokenizers`` byte-level tokenizer with the same ids (UTF-8 bytes 0..255, then
``<|bos|>``, ``<|eos|>``, ``<|pad|>`` = 256, 257, 258), an ``hf:`` tokenizer as its own ``tokenizer.json`` with
the BOS the run used (``<|bos|>`` added at the id lengthgen appended when the tokenizer names none);
tiktoken encodings (``gpt2``) and task runs get none, and the export says why.
`lengthgen.hf.from_pretrained(DIR)` and ``AutoModelForCausalLM.from_pretrained(DIR)`` (after
`lengthgen.hf.register`) load it with the native model's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lengthgen.atomic import atomic_write_folder
from lengthgen.config import ConfigError
from lengthgen.data.text import make_tokenizer
from lengthgen.hf.registry import register, require_transformers
from lengthgen.optional import MissingPackageError
from lengthgen.train import load_run
from lengthgen.train.run_folder import RunFolderError, load_newest, outside_checkpoints
from lengthgen.train.weights import check_trained_tokenizer


def byte_tokenizer() -> Any:
    """`ByteTokenizer` as a transformers fast tokenizer (same ids for every text, same decoding)."""
    require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()                             # byte -> the printable character ByteLevel uses for it
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # the special tokens are added after the 256 bytes, in ByteTokenizer's order: BOS 256, EOS 257, PAD 258
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")


def _tokenizer(cfg: Any, run: str | Path) -> tuple[Any | None, str]:
    """(the run's tokenizer as a transformers tokenizer, or None; what the export says about it); an ``hf:``
    tokenizer changed since ``run`` trained is a `ConfigError` (`check_trained_tokenizer`)."""
    if cfg.data.kind != "text":
        return None, f"no tokenizer: a {cfg.data.task!r} task run's ids are the task's symbols"
    name = cfg.data.text.get("tokenizer", "byte")
    if name == "byte":
        return byte_tokenizer(), "tokenizer: byte-level, the same ids as lengthgen's byte tokenizer"
    if name.startswith("hf:"):
        from transformers import PreTrainedTokenizerFast

        trained = make_tokenizer(name)
        check_trained_tokenizer(run, trained)
        fast = PreTrainedTokenizerFast(tokenizer_file=str(trained.path))
        # the BOS the run put at each document's start: a token of the vocabulary, or the id lengthgen appended
        bos = "<|bos|>" if trained.bos_added else fast.convert_ids_to_tokens(trained.bos_id)
        fast.add_special_tokens({"bos_token": bos})
        if fast.bos_token_id != trained.bos_id:
            raise ConfigError(f"{name}: its BOS (id {trained.bos_id}) cannot be saved with the tokenizer", "tokenizer")
        return fast, f"tokenizer: {trained.path} (BOS {bos!r} = id {trained.bos_id}, as the run put it)"
    return None, (f"no tokenizer: {name!r} is a tiktoken encoding, which transformers cannot load from a model "
                  "folder; save the matching transformers tokenizer there (e.g. GPT-2's for gpt2)")


def _special_ids(cfg: Any, tokenizer: Any | None) -> tuple[dict[str, int | None], str]:
    """config.json's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (a document starts at each BOS, as in
    training; generation stops at EOS): the saved tokenizer's, else, for a tiktoken run, its encoding's end-of-text
    id (BOS = EOS, `TiktokenTokenizer`) where tiktoken and the encoding's file are here; and what the export says
    where they are not."""
    if tokenizer is not None:
        return {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}, ""
    if cfg.data.kind != "text":
        return {}, ""
    try:
        trained = make_tokenizer(cfg.data.text.get("tokenizer", "byte"))
    except (FileNotFoundError, MissingPackageError):
        return {}, ("; config.json names no BOS or EOS id (tiktoken or its encoding's file is not here), so neither "
                    "generate nor eval --hf split documents at its end-of-text id: set bos_token_id and eos_token_id")
    return ({"bos_token_id": trained.bos_id, "eos_token_id": trained.eos_id},
            f"; config.json names its end-of-text id {trained.bos_id} as BOS and EOS, as the run put it")


def export_run(run: str | Path, out: str | Path, *, bema: bool = False) -> list[str]:
    """Write the run folder or checkpoint ``run`` (its BEMA weights with ``bema``) as a transformers model folder
    ``out`` (new or empty); returns what was written, one line each (naming the checkpoint exported). `RunFolderError`
    if ``out`` holds files or is inside a run's checkpoints (`outside_checkpoints`); `ConfigError` for a run whose
    head is not ``lm``."""
    out = outside_checkpoints(out)
    register()
    from lengthgen.hf.model import LengthgenForCausalLM

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunFolderError(f"export folder {out} " + ("is not empty" if out.is_dir() else "is a file")
                             + ": choose a new folder")
    # the checkpoint read, named in the output and read again for its tokenizer (a run training meanwhile writes newer)
    ckpt, (cfg, gpt) = load_newest(run, lambda checkpoint: load_run(checkpoint, bema=bema))
    if gpt.head_kind != "lm":
        raise ConfigError(f"{run}: model.head={gpt.head_kind!r} cannot be exported; transformers models are causal "
                          "LMs, so only runs with the lm head are (not regress or classify)", "model.head")
    tokenizer, note = _tokenizer(cfg, ckpt)
    ids, ids_note = _special_ids(cfg, tokenizer)
    note += ids_note
    model = LengthgenForCausalLM.from_gpt(gpt, **ids)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    try:            # a failed export leaves nothing; one into a folder written meanwhile is refused
        atomic_write_folder(out, write)
    except FileExistsError:
        raise RunFolderError(f"export folder {out} was written by another process meanwhile: choose a new "
                             "folder") from None
    weights = "BEMA weights" if bema else "weights"
    return [f"model: {out / 'config.json'}, {out / 'model.safetensors'} ({weights} of {ckpt})", note]


__all__ = ["byte_tokenizer", "export_run"]
