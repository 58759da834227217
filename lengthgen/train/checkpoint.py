"""Atomic checkpoints.

A run folder::

    config.json            the resolved RunConfig
    metrics.jsonl          one JSON object per logged step / evaluation
    latest.json            {"step": N, "checkpoint": "checkpoints/step_000000N"}   (replaced atomically)
    checkpoints/step_000000N/
        model.safetensors  weights (shared/tied tensors stored once: safetensors.torch.save_model)
        bema.safetensors   BEMA state (theta0.*, ema.*, bema.*), when BEMA is on
        optimizer.pt       optimizer states (torch.save)
        state.json         config, step, RNG states (torch, CUDA, data seed scheme), loss history, metrics

Every file is written to a temporary name and moved with ``os.replace``; a checkpoint folder is assembled
as ``step_N.tmp-*`` and renamed when complete, and only then does ``latest.json`` point at it. A failure
at any point leaves the previous checkpoint and ``latest.json`` untouched and no partial files behind.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file, load_model, save_file, save_model

from lengthgen.atomic import atomic_write, atomic_write_text

LATEST = "latest.json"
CHECKPOINTS = "checkpoints"


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


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                    state: dict[str, Any], bema_tensors: dict[str, torch.Tensor] | None = None,
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest.json`` at it, keep the newest ``keep``."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
    try:
        atomic_write(tmp_dir / "model.safetensors", lambda p: save_model(model, p))
        if bema_tensors:
            atomic_write(tmp_dir / "bema.safetensors",
                         lambda p: save_file({k: v.detach().contiguous().cpu() for k, v in bema_tensors.items()}, p))
        atomic_write(tmp_dir / "optimizer.pt",
                     lambda p: torch.save({"optimizers": [o.state_dict() for o in optimizers]}, p))
        atomic_write_text(tmp_dir / "state.json", json.dumps({"step": step, **state}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_dir, final)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    atomic_write_text(run_dir / LATEST, json.dumps({"step": step, "checkpoint": f"{CHECKPOINTS}/{final.name}"}))
    old = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and ".tmp-" not in p.name)
    for stale in old[:-keep]:
        if stale != final:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder for a run folder (its latest), a checkpoint folder or a file inside one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run folder or checkpoint at {path}")
    if path.is_file():
        path = path.parent
    if (path / "state.json").exists():
        return path
    latest = path / LATEST
    if latest.exists():
        ckpt = path / json.loads(latest.read_text())["checkpoint"]
        if (ckpt / "state.json").exists():
            return ckpt
        raise FileNotFoundError(f"{latest} points at {ckpt}, which is not a complete checkpoint")
    raise FileNotFoundError(f"no checkpoint in {path} (expected {LATEST} of a run folder or state.json of a "
                            "checkpoint folder)")


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "state.json").read_text())


def load_weights(model: nn.Module, ckpt: Path, device: str | torch.device = "cpu") -> None:
    missing, unexpected = load_model(model, str(Path(ckpt) / "model.safetensors"), strict=True, device=str(device))
    if missing or unexpected:  # pragma: no cover - strict raises first
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}")


def load_bema_tensors(ckpt: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor] | None:
    path = Path(ckpt) / "bema.safetensors"
    return load_file(str(path), device=str(device)) if path.exists() else None


def load_optimizers(optimizers: list[torch.optim.Optimizer], ckpt: Path, device: str | torch.device) -> None:
    data = torch.load(Path(ckpt) / "optimizer.pt", map_location=device, weights_only=True)
    states = data["optimizers"]
    if len(states) != len(optimizers):
        raise RuntimeError(f"checkpoint {ckpt} has {len(states)} optimizer states, the run has {len(optimizers)}")
    for opt, st in zip(optimizers, states):
        opt.load_state_dict(st)
