"""What a run resolves and checks before its first step: the config completed from its data source, the lengths
and DDP shares it can use, its device and its autocast dtype. Everything here fails with `ConfigError`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lengthgen.config import ConfigError
from lengthgen.train.config import RunConfig, load_config


def as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    """A `RunConfig` from itself, its dict or a TOML path."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return RunConfig.from_dict(config)
    return load_config(config)


def fill_model_from_source(cfg: RunConfig, source: Any) -> RunConfig:
    """Set model.vocab_size / head / num_classes from the data source (errors if they contradict it)."""
    model = cfg.model
    head = getattr(source, "head", "lm")
    name = getattr(source, "name", cfg.data.task)
    if model.head is not None and model.head != head:
        raise ConfigError(f"model.head={model.head!r} does not fit the data: {name!r} needs head {head!r}")
    vocab = source.vocab_size
    if model.vocab_size is not None:
        if model.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the data's vocabulary "
                              f"({vocab}); leave it unset to take it from the data")
        vocab = model.vocab_size
    changes: dict[str, Any] = {"head": head, "vocab_size": vocab}
    if head == "classify":
        classes = source.num_classes
        if model.num_classes not in (0, classes):
            raise ConfigError(f"model.num_classes={model.num_classes} does not fit {name!r} ({classes} classes)")
        changes["num_classes"] = classes
    try:
        return RunConfig(model.replace(**changes), cfg.train, cfg.data, cfg.name)
    except ConfigError as err:
        raise err.under("model") from None


def check_lengths(cfg: RunConfig, source: Any) -> None:
    """Every training and eval length must be one the data can generate (checked by sampling one sequence)."""
    for key, lengths in (("data.length", [cfg.data.length]), ("train.stages", [s[1] for s in cfg.train.stages]),
                         ("train.eval_lengths", cfg.train.eval_lengths)):
        check_source_lengths(source, key, lengths)


def check_source_lengths(source: Any, key: str, lengths: list[int]) -> None:
    """A `ConfigError` naming ``key`` when ``source`` cannot generate one of ``lengths``."""
    max_length = getattr(source, "max_length", None)
    for length in lengths:
        if max_length is not None and length > max_length:
            raise ConfigError(f"{key}: length {length} exceeds the data's maximum length {max_length}")
        try:
            source.sample(1, length, torch.Generator().manual_seed(0))
        except ValueError as err:
            raise ConfigError(f"{key}: length {length}: {err}") from None


def check_world(cfg: RunConfig, world: int) -> None:
    """Under DDP every step's global batch must split into ``world`` equal shares of >= grad_accum rows."""
    for step in sorted({0, *(s[0] for s in cfg.train.stages)}):
        batch = cfg.batch_size_at(step)
        if batch % world or batch // world < cfg.train.grad_accum:
            raise ConfigError(f"train: the batch of {batch} sequences at length {cfg.length_at(step)} does not "
                              f"split into {world} equal shares of at least train.grad_accum="
                              f"{cfg.train.grad_accum} sequences (WORLD_SIZE={world}); change "
                              "train.batch_size / train.tokens_per_step or train.grad_accum")


def config_difference(saved: Any, now: Any, prefix: str) -> str | None:
    """The first key at which two config dicts differ, as ``"key: checkpoint X, now Y"`` (None: equal)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        for key in sorted(set(saved) | set(now)):
            found = config_difference(saved.get(key), now.get(key), f"{prefix}.{key}")
            if found:
                return found
        return None
    return None if saved == now else f"{prefix}: checkpoint {saved!r}, now {now!r}"


def device_type(train: Any) -> str:
    """``"cuda"`` or ``"cpu"`` from ``train.device`` (``auto``: CUDA when available)."""
    if train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but CUDA is not available")
    return train.device


def autocast_dtype(train: Any, device_type: str) -> torch.dtype | None:
    """The dtype training and evaluation autocast to: bfloat16 when ``train.dtype`` says so, or by default
    (``auto``) on CUDA; None (float32) otherwise."""
    if train.dtype == "bfloat16" or (train.dtype == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


__all__ = ["as_config", "autocast_dtype", "check_lengths", "check_source_lengths", "check_world",
           "config_difference", "device_type", "fill_model_from_source"]
