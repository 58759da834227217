"""Weights from a run folder: `load_run` (a trained run's model, optionally its BEMA weights), `check_trained_data`
(is the data here what it trained on?) and `load_initial_weights` (``train.init_from``: another run's weights in a
model whose attention may add parameters)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.config import ConfigError, ConfigWarning
from lengthgen.train.config import RunConfig
from lengthgen.attention.module import is_spec_parameter
from lengthgen.model import GPT
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train.bema import BEMA
from lengthgen.train.run_folder import load_newest

def _addable(name: str) -> bool:
    """A parameter an attention spec can add without changing the others (kept at its init)."""
    return name == "scaling_multiplier" or (".attn." in name and is_spec_parameter(name.rsplit(".attn.", 1)[1]))


def _aliases(own: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]
             ) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Tied tensors are stored once under one of their names: every name -> the stored name of its tensor (or
    itself), and every name -> all names of its tensor."""
    by_storage: dict[tuple[int, int], list[str]] = {}
    for name, t in own.items():
        by_storage.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    alias: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for names in by_storage.values():
        hit = next((n for n in names if n in stored), None)
        for n in names:
            alias[n], groups[n] = (hit if hit is not None else n), names
    return alias, groups


def load_initial_weights(model: nn.Module, path: str | Path, device: str | torch.device = "cpu"
                         ) -> dict[str, Any]:
    """Load the weights of a run folder or checkpoint into ``model`` whose attention spec may add parameters.

    Parameters of attention layers that the checkpoint lacks (gates, out-norm affine, QK-norm weights,
    learnable scaling multipliers) keep their initialization, so e.g. a 2sigmoid gate starts as the identity.
    Anything else that differs (a missing non-attention parameter, an unexpected checkpoint tensor, a shape
    change) raises `ConfigError` on one line, naming the first three. Returns {"checkpoint", "added"}.
    """
    ckpt, stored = load_newest(path, lambda c: ckpt_io.load_tensors(c, "model.safetensors", device))
    own = model.state_dict()
    alias, groups = _aliases(own, stored)
    problems, added, load = [], [], {}
    for name, t in own.items():
        src = alias[name]
        if src in stored:
            if tuple(stored[src].shape) != tuple(t.shape):
                problems.append(f"{name}: checkpoint shape {tuple(stored[src].shape)}, model {tuple(t.shape)}")
            else:
                load[name] = stored[src]
        elif any(_addable(n) for n in groups[name]):
            added.append(name)
        else:
            problems.append(f"{name}: not in the checkpoint")
    used = {alias[n] for n in own}
    problems += [f"{name}: in the checkpoint, not in the model" for name in stored if name not in used]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(f"cannot initialize from {ckpt}: the new config changes more than added attention "
                          f"parameters ({'; '.join(problems[:3])}{more}); keep the checkpoint's model shape")
    missing, unexpected = model.load_state_dict(load, strict=False)
    assert not unexpected and set(missing) == set(added), (missing, unexpected)
    return {"checkpoint": str(ckpt), "added": added}


def load_run(path: str | Path, *, bema: bool = False, device: str | torch.device = "cpu"
             ) -> tuple[RunConfig, GPT]:
    """(config, model in eval mode) from a run folder (its newest readable checkpoint, see
    `lengthgen.train.run_folder.load_newest`), a checkpoint folder or a file in one. ``bema=True`` loads the BEMA
    weights (`ConfigError` if the run has none). FileNotFoundError names a missing path, `CheckpointError` a
    damaged file, `ConfigError` a ``device`` that is none or not usable here."""
    device = usable_device(device)
    return load_newest(path, lambda ckpt: _load_checkpoint(ckpt, bema, device))[1]


def usable_device(device: Any) -> torch.device:
    """``device`` as a torch.device that this machine has; else a `ConfigError` naming it (as loading a checkpoint
    onto it would fail as if the checkpoint were unreadable)."""
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, TypeError, AssertionError) as err:    # AssertionError: torch built without CUDA
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"device={str(device)!r} cannot be used here ({why}); give 'cpu', 'cuda' or 'cuda:N' of "
                          "this machine", "device") from None
    return device


def _load_checkpoint(ckpt: Path, bema: bool, device: str | torch.device) -> tuple[RunConfig, GPT]:
    state = ckpt_io.read_state(ckpt)
    cfg = ckpt_io.saved_config(state["config"], ckpt / "state.json")
    if bema and not cfg.train.bema.enabled:
        raise ConfigError(f"{ckpt} has no BEMA weights: its run was trained with train.bema.enabled = false; "
                          "leave out --bema")
    model = GPT(cfg.model)
    ckpt_io.load_weights(model, ckpt, device)
    model.to(device)
    if bema:     # no BEMA tensors: BEMA had not started (step < tau), its weights are the model's
        tracker = BEMA(model, **{k: v for k, v in state.get("bema", {}).items() if k != "step"})
        tracker.load(ckpt_io.load_bema_tensors(ckpt, state.get("bema"), device) or {}, state.get("bema", {}))
        model.load_state_dict(tracker.state_dict_for_model())
    return cfg, model.eval()


def check_trained_data(path: str | Path, source: Any) -> None:
    """A `ConfigWarning` when ``source`` (the run's training data built here) is not the text the newest checkpoint
    at ``path`` trained on (its token digest): a corpus's split is drawn per document, so the documents evaluated as
    held out may then be text the run trained on (a resume refuses such data). Give the checkpoint whose weights
    were loaded (`load_newest`'s), not its run folder: that one is not looked for, nor warned about, twice."""
    trained_on = load_newest(path, ckpt_io.read_state)[1].get("data_digest")
    now = source.digest() if hasattr(source, "digest") else None
    if trained_on is not None and now is not None and trained_on != now:
        warnings.warn(f"{path} was trained on other text than data.text reads here "
                      f"({ckpt_io.data_change(trained_on, now)}): documents it trained on may be evaluated as held out",
                      ConfigWarning, stacklevel=2)


def check_trained_tokenizer(path: str | Path, tokenizer: Any) -> None:
    """A `ConfigError` keyed ``data.text.tokenizer`` when ``tokenizer`` (the run's, built here) maps text to other
    ids than the one the newest checkpoint at ``path`` trained with (its `cache_key`): an ``hf:`` tokenizer.json
    changed since. Checkpoints written before they kept it are not checked."""
    trained_with = load_newest(path, ckpt_io.read_state)[1].get("tokenizer")
    if trained_with is not None and trained_with != tokenizer.cache_key:
        raise ConfigError(f"data.text.tokenizer: {tokenizer.name} maps text to other ids than when the run trained "
                          "(its file changed since): restore the tokenizer the run trained with", "data.text.tokenizer")


__all__ = ["check_trained_data", "check_trained_tokenizer", "load_initial_weights", "load_run"]
