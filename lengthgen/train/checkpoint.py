"""Atomic checkpoints.

A run folder::

    config.json            the resolved RunConfig
    metrics.jsonl          one JSON object per logged step / evaluation
    latest.json            {"step": N, "checkpoint": "checkpoints/step_000000N"}   (replaced atomically)
    checkpoints/step_000000N/
        model.safetensors  weights (shared/tied tensors stored once: safetensors.torch.save_model)
        bema.safetensors   BEMA state (theta0.*, ema.*, bema.*), when BEMA is on
        adamw_grads.safetensors  AdamW's parameters' gradients summed since its last step, by name, when the
                           step falls between two of its steps (train.adam_every > 1)
        optimizer.pt       optimizer states (torch.save)
        state.json         config, step, RNG states (torch, CUDA, data seed scheme), loss history, tokens, ranks
        digests.json       each file's digest, checked when it is read

Every file is written to a temporary name, flushed to disk and moved with ``os.replace``; a checkpoint folder is
assembled as ``step_N.tmp-*`` and renamed when complete, and only then does ``latest.json`` point at it. A failure
at any point leaves the previous checkpoint and ``latest.json`` untouched and no partial files behind. So a
folder named ``step_N`` is a complete checkpoint (`complete_checkpoints`); ``latest.json`` says which is the newest
for people and other tools. Reading a file that is missing, damaged or whose bytes changed since it was written
(its digest) raises `CheckpointError` naming it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from lengthgen.atomic import atomic_write, atomic_write_text, fsync
from lengthgen.config import ConfigError
from lengthgen.data.tasks import own_task
from lengthgen.memory import out_of_memory
from lengthgen.train.config import RunConfig

LATEST = "latest.json"
#: a checkpoint's record of each of its files' digest, written last (`file_digest`)
DIGESTS = "digests.json"
#: AdamW's gradients summed since its last step, in a checkpoint between two of its steps (`load_pending_grads`)
PENDING_GRADS = "adamw_grads.safetensors"
CHECKPOINTS = "checkpoints"
#: the name of a complete checkpoint folder (``step_N.tmp-*`` is one being written)
COMPLETE = re.compile(r"step_\d+")


class CheckpointError(ValueError):
    """A checkpoint file that is missing or cannot be read back; the message names the file."""


# ---------------------------------------------------------------------------------------------------
# RNG states as JSON


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# ---------------------------------------------------------------------------------------------------
# save / load


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as a safetensors file (contiguous, on the CPU), written atomically."""
    atomic_write(path, lambda p: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, p))


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer_states: list[dict[str, Any]],
                    state: dict[str, Any], bema_tensors: dict[str, torch.Tensor] | None = None,
                    keep: int = 2, pending_grads: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest.json`` at it, keep the newest ``keep``.
    ``optimizer_states``: each optimizer's ``state_dict()``; ``pending_grads``: AdamW's summed gradients between
    two of its steps (``train.adam_every``), None when none are pending."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp_dir = root / f"{final.name}.tmp-{secrets.token_hex(4)}"
    tmp_dir.mkdir()      # not tempfile.mkdtemp: its folders are private to their owner, not the umask's
    try:
        atomic_write(tmp_dir / "model.safetensors", lambda p: save_model(model, p))
        if bema_tensors:
            _write_tensors(tmp_dir / "bema.safetensors", bema_tensors)
        if pending_grads is not None:
            _write_tensors(tmp_dir / PENDING_GRADS, pending_grads)
        atomic_write(tmp_dir / "optimizer.pt",
                     lambda p: torch.save({"optimizers": optimizer_states}, p))
        atomic_write_text(tmp_dir / "state.json", json.dumps({"step": step, **state}))
        atomic_write_text(tmp_dir / DIGESTS, json.dumps({p.name: file_digest(p) for p in sorted(tmp_dir.iterdir())}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_dir, final)
        fsync(root)                      # on disk before latest.json points at it and older ones are pruned
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    atomic_write_text(run_dir / LATEST, json.dumps({"step": step, "checkpoint": f"{CHECKPOINTS}/{final.name}"}))
    for stale in complete_checkpoints(run_dir)[keep:]:
        if stale != final:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoint folders of a run folder, newest (highest step) first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if COMPLETE.fullmatch(p.name) and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def file_digest(path: Path) -> str:
    """The blake2b digest of a file's bytes."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path) -> None:
    """`CheckpointError` when a checkpoint file's bytes differ from the digest its checkpoint recorded when it was
    written (`DIGESTS`; checkpoints written before it was kept are not checked)."""
    record = path.parent / DIGESTS
    want = json.loads(record.read_text()).get(path.name) if record.is_file() else None
    got = file_digest(path) if want is not None else None
    if got != want:
        raise CheckpointError(f"{path} is unreadable (its bytes changed since it was written: digest "
                              f"{got[:12]}, recorded {want[:12]})")


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turn a failure to read ``path``, or bytes that changed since it was written (`_verify`), into a one-line
    `CheckpointError` naming it. Running out of memory says nothing of the file: it is raised as it is (else a
    reader would take an older checkpoint's weights, and a resume would set the newest aside)."""
    try:
        _verify(path)
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError,
            SafetensorError) as err:
        if out_of_memory(err) is not None:
            raise
        detail = " ".join(line.strip() for line in str(err).splitlines() if line.strip())     # one line, e.g.
        detail = detail if len(detail) <= 300 else detail[:297] + "..."          # state_dict's size mismatches
        raise CheckpointError(f"{path} is unreadable ({type(err).__name__}: {detail})") from None


def read_state(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's ``state.json``: step, config, RNG states, loss history, ..."""
    path = Path(ckpt) / "state.json"
    with reading(path):
        state = json.loads(path.read_text())
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("config"), dict)
                and isinstance(state.get("history"), list) and isinstance(state.get("rng"), dict)):
            raise ValueError("not a lengthgen checkpoint state (step, config, history, rng)")
    return state


def data_change(trained_on: str, now: str) -> str:
    """How a checkpoint's training-data digest (``data_digest``) and the data's here (``now``) differ, for the
    messages of a refused resume and of an evaluation on changed text."""
    return (f"token digest {trained_on[:12]}, now {now[:12]}: the corpus files changed, or how this lengthgen "
            "orders, splits or tokenizes them")


def saved_config(data: Any, where: Path) -> RunConfig:
    """The `RunConfig` saved as ``data`` in ``where`` (a checkpoint's state.json, a run's config.json); a
    `CheckpointError` when it does not load, but a `ConfigError` for a researcher's own task (``module:Class``) that
    does not resolve here: the file is sound, its task's module is not importable from this folder."""
    try:
        return RunConfig.from_dict(data)
    except ConfigError as err:
        task = data.get("data", {}).get("task") if isinstance(data, dict) and isinstance(data.get("data"), dict) \
            else None
        if err.key == "data.task" and own_task(task):
            raise ConfigError(f"{where}: {err}", err.key) from None
        raise CheckpointError(f"{where}: its config does not load ({err})") from None


def load_weights(model: nn.Module, ckpt: Path, device: str | torch.device = "cpu") -> None:
    path = Path(ckpt) / "model.safetensors"
    with reading(path):
        load_model(model, str(path), strict=True, device=str(device))


def load_tensors(ckpt: Path, name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint's safetensors file ``name``."""
    path = Path(ckpt) / name
    with reading(path):
        return load_file(str(path), device=str(device))


def load_bema_tensors(ckpt: Path, meta: dict[str, Any] | None, device: str | torch.device = "cpu"
                      ) -> dict[str, torch.Tensor] | None:
    """BEMA's tensors; None when the checkpoint has none (BEMA off, or not started: step < tau). ``meta``: the
    checkpoint's BEMA record (`BEMA.meta`); a started BEMA without its file is a `CheckpointError` (resuming
    would restart the average from the current weights)."""
    path = Path(ckpt) / "bema.safetensors"
    if path.exists():
        return load_tensors(ckpt, "bema.safetensors", device)
    if meta is not None and meta.get("step", -1) >= meta.get("tau", 0):
        raise CheckpointError(f"{path} is unreadable (missing: BEMA had started, step {meta['step']} >= tau "
                              f"{meta['tau']})")
    return None


def load_pending_grads(ckpt: Path, pending: bool, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """AdamW's parameters' gradients summed since its last step (by name) when the checkpoint's step falls between
    two AdamW steps (``pending``: step % train.adam_every != 0), else None. Then a missing file, or one whose
    tensors are not gradients of ``model``'s parameters (names, shapes, dtypes), is a `CheckpointError` (resuming
    without them would drop those steps' gradients from AdamW's next update)."""
    if not pending:
        return None
    path = Path(ckpt) / PENDING_GRADS
    with reading(path):
        grads = load_file(str(path))
        params = dict(model.named_parameters())
        for name, grad in grads.items():
            p = params.get(name)
            if p is None or p.shape != grad.shape or p.dtype != grad.dtype:
                have = "no such parameter" if p is None else f"the parameter's is {p.dtype} {list(p.shape)}"
                raise ValueError(f"{name} is {grad.dtype} {list(grad.shape)}, not a gradient of this model ({have})")
    return grads


def read_optimizers(ckpt: Path, device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    """The optimizers' state dicts of a checkpoint."""
    path = Path(ckpt) / "optimizer.pt"
    with reading(path):
        return torch.load(path, map_location=device, weights_only=True)["optimizers"]
