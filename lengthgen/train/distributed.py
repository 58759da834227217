"""Data-parallel training (DDP) under ``torchrun``: process group setup and the few collectives the trainer uses.

``torchrun --nproc_per_node=N -m lengthgen train ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous address; `setup` then joins the process group (``nccl`` on CUDA, ``gloo`` on CPU). Every rank draws
the same global batch from the per-step generator and keeps its contiguous share of the rows, so the union
of the ranks' shards is exactly the single-process batch; DDP averages the gradients. Only rank 0 logs,
writes checkpoints and runs the final evaluation.
"""

from __future__ import annotations

import datetime
import os
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

#: long enough for rank 0's periodic evaluation or checkpoint while the others wait in a collective
TIMEOUT = datetime.timedelta(hours=2)
T = TypeVar("T")


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def setup(device_type: str) -> tuple[int, int, int]:
    """Join the process group when launched with WORLD_SIZE > 1 (idempotent); returns (rank, world, local rank)."""
    rank, world, local = env_world()
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=TIMEOUT)
    return rank, world, local


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (in place; returned)."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def on_main(decide: Callable[[], T]) -> T:
    """Rank 0 runs ``decide()``; every rank returns its result or raises the exception it raised (so the other
    ranks stop with rank 0 instead of waiting for it in a collective)."""
    outcome: list = [None, None]
    if not active() or dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except Exception as err:  # noqa: BLE001 - handed to every rank, raised below
            outcome[1] = err
    if active():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def cleanup() -> None:
    """Leave the process group (call once at the end of a torchrun launch)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["TIMEOUT", "active", "all_reduce_max", "all_reduce_mean", "cleanup", "env_world", "on_main", "setup"]
