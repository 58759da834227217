"""Data-parallel training under ``torchrun``: DDP or FSDP2, the process group, and the collectives the trainer uses.

``torchrun --nproc_per_node=N -m lengthgen train ...`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous address; `setup` then joins the process group (``nccl`` on CUDA, ``gloo`` on CPU). Every rank draws
the same global batch from the per-step generator and keeps its contiguous share of the rows, so the union
of the ranks' shards is exactly the single-process batch. `parallelize` wraps the model by ``train.parallel``:

* ``ddp``: ``DistributedDataParallel``: every rank holds the whole model; gradients are averaged (all-reduce).
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``, as torchtitan applies it): each block and then the
  root are sharded in place, so parameters, gradients and optimizer states are split across ranks
  (``DTensor`` parameters); a block's weights are all-gathered for its forward and backward, gradients are
  reduce-scattered and averaged. Checkpoints hold full weights: `gather_full` collects them on rank 0 and
  `load_full` shards them back.

Only rank 0 logs and writes checkpoints. Under DDP rank 0 alone evaluates and hands the results to the others
(`on_main`); under FSDP2 every rank takes part in the evaluations (its forwards are collective).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from lengthgen.config import ConfigError, differences

#: long enough for rank 0's periodic evaluation or checkpoint while the others wait in a collective
TIMEOUT = datetime.timedelta(hours=2)
#: how long a rank that leaves its failure to another rank to report waits for torchrun to stop it (`linger`)
LINGER_SECONDS = 10.0
T = TypeVar("T")
_linger = False


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) without one. `ConfigError` names a
    variable that is not an integer."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return 0, 1, 0
    return _env_int("RANK", 0), world, _env_int("LOCAL_RANK", 0)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer; torchrun sets it (unset it to "
                          "train in one process)", name) from None


def setup(device_type: str) -> tuple[int, int, int]:
    """Join the process group when launched with WORLD_SIZE > 1 (idempotent); returns (rank, world, local rank).
    `ConfigError` when the environment lacks torchrun's rendezvous address (a WORLD_SIZE set by hand)."""
    rank, world, local = env_world()
    if world > 1 and not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"environment variable WORLD_SIZE={world} asks for {world} processes, but "
                              f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: launch "
                              "with torchrun (it sets them), or unset WORLD_SIZE to train in one process",
                              "WORLD_SIZE")
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=TIMEOUT)
    return rank, world, local


def check_same(what: dict[str, Any], ignore: frozenset[str] = frozenset()) -> None:
    """Collective: `ConfigError` on every rank (rank 0 reports it) naming each key whose value in ``what`` (the
    resolved config and the run's options) differs between ranks, but for the dotted keys in ``ignore``; else the
    ranks would train apart without a word (another seed or learning rate) or wait for each other forever (another
    ``train.steps``)."""
    if not active():
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, what)
    changed = [f"{key}: rank 0 {a!r}, rank {rank} {b!r}" for rank, other in enumerate(every)
               for key, a, b in differences(every[0], other) if key not in ignore]
    if changed:
        err = ConfigError(f"the ranks differ: {'; '.join(changed)}; launch every rank with the same command, config "
                          "files and environment")
        err.every_rank = True       # type: ignore[attr-defined]
        raise err


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


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if active():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------
# DDP / FSDP2


def parallelize(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """The module to run forward on: ``DistributedDataParallel(model)`` (``ddp``), or ``model`` itself sharded
    in place with FSDP2 (``fsdp``: each of ``model.blocks``, then the root). Build optimizers afterwards:
    sharding replaces the parameters."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # FSDP2 shards no 0-d parameter (seed 000's U-net skip weights, a global or per-layer query-scaling multiplier):
    # those stay whole on every rank, their gradients averaged by `sync_replicated`
    scalars = {p for p in model.parameters() if p.ndim == 0} or None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=scalars)
    fully_shard(model, mesh=mesh, ignored_params=scalars)
    for method in ("features", "logits"):     # the evaluator's lm path calls these, not forward
        register_fsdp_forward_method(model, method)
    return model


def sync_replicated(model: nn.Module) -> None:
    """Average over ranks the gradients of the 0-d parameters FSDP2 leaves whole (see `parallelize`); call it
    after the backward of a step's last micro-batch."""
    for p in model.parameters():
        if p.ndim == 0 and p.grad is not None:
            all_reduce_mean(p.grad)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by `parallelize` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(module: nn.Module | None, enabled: bool) -> Iterator[None]:
    """Around a micro-batch's forward and backward: with ``enabled=False`` the gradients stay local (DDP
    ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``) until the last micro-batch synchronizes them."""
    if module is None or enabled:
        yield
    elif is_sharded(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        with module.no_sync():
            yield


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: collective (every rank calls it) for a tensor FSDP2 shards (a DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (e.g. a gradient from a checkpoint) split across ranks as ``param`` is when FSDP2 shards it (a
    DTensor; collective), else ``full`` itself; the inverse of `full_tensor`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements) if isinstance(param, DTensor) else full


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_full(model: nn.Module, optimizers: list[torch.optim.Optimizer], empty: Callable[[], nn.Module]
                ) -> tuple[nn.Module | None, list[dict] | None]:
    """Collective (every rank calls it): on rank 0, ``empty()`` (a CPU model of the same config) loaded with
    the full weights of sharded ``model``, and the optimizers' full states keyed like ``Optimizer.state_dict``
    (parameter indices), so a checkpoint does not depend on the world size or the parallel mode; (None, None)
    on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_options(cpu_offload=True))
    states = [get_optimizer_state_dict(model, o, options=_options(cpu_offload=True)) for o in optimizers]
    if dist.get_rank() != 0:
        return None, None
    with torch.random.fork_rng(devices=[]):      # building the copy must not move the run's RNG
        full = empty()
    full.load_state_dict(weights)
    return full, [_by_index(s) for s in states]


def load_full(model: nn.Module, optimizers: list[torch.optim.Optimizer], weights: dict[str, torch.Tensor],
              states: list[dict]) -> None:
    """Shard full ``weights`` (a state dict) and optimizer ``states`` (`gather_full`'s layout) into the sharded
    ``model`` and its optimizers; every rank passes the same full states. An optimizer saved before its first step
    (no state: AdamW with ``train.adam_every`` > 1) stays as built: torch's ``set_optimizer_state_dict`` would
    first step it on zero gradients to create its state, leaving it one step (bias correction) ahead."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if len(states) != len(optimizers):
        raise RuntimeError(f"the checkpoint has {len(states)} optimizer states, the run has {len(optimizers)}")
    set_model_state_dict(model, weights, options=_options())
    for opt, state in zip(optimizers, states):
        if not state["state"]:
            continue
        names = [n for g in _param_names(model, opt) for n in g]
        set_optimizer_state_dict(model, opt, _by_name(state, names), options=_options())


def _param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each of ``opt``'s parameter groups, in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in opt.param_groups]


def _by_index(state: dict) -> dict:
    """An optimizer state keyed by parameter name -> keyed by index in group order (`Optimizer.state_dict`)."""
    index: dict[str, int] = {}
    groups = [{**g, "params": [index.setdefault(n, len(index)) for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def _by_name(state: dict, names: list[str]) -> dict:
    """The inverse of `_by_index` for the parameter ``names`` in group order."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def on_main(decide: Callable[[], T]) -> T:
    """Rank 0 runs ``decide()``; every rank returns its result or raises the exception it raised (so the other
    ranks stop with rank 0 instead of waiting for it in a collective), marked ``every_rank`` (`reported_by_rank0`)."""
    outcome: list = [None, None]
    if not active() or dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except Exception as err:  # noqa: BLE001 - handed to every rank, raised below
            outcome[1] = err
    if active():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        outcome[1].every_rank = True
        raise outcome[1]
    return outcome[0]


def reported_by_rank0(err: BaseException) -> bool:
    """Whether this rank may leave ``err`` to another to report, in a torchrun launch where every rank raised
    ``err`` alike: before joining the process group (reading the arguments and config, as every rank of a node
    does: local rank 0 of each node reports it, so a file missing on one node is still named) or marked
    ``every_rank`` (`on_main` hands rank 0's error on; `NonFiniteLossError`: the loss is averaged over ranks; rank
    0 reports it), or Ctrl-C (a `KeyboardInterrupt`: torchrun hands its SIGINT to every rank of its node; local
    rank 0 reports it). An error of this rank's own (out of memory, a crash) is its own to report."""
    try:
        rank, world, local_rank = env_world()
    except ConfigError:         # the environment is the error: every process names it
        return False
    if world == 1:
        return False
    if isinstance(err, KeyboardInterrupt) or not dist.is_initialized():
        return local_rank != 0
    return rank != 0 and getattr(err, "every_rank", False)


def lost_peer(err: BaseException) -> str | None:
    """In a torchrun launch, the gist of ``err`` when it is a collective's failure because another rank is gone (it
    crashed, was killed, or stopped on an error of its own: gloo's "Connection closed by peer ... a remote worker",
    a `torch.distributed.DistError`); else None."""
    text = str(err).strip()
    if not isinstance(err, RuntimeError) or not (isinstance(err, dist.DistError) or "remote worker" in text):
        return None
    with contextlib.suppress(ConfigError):
        if env_world()[1] > 1:
            return re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(err).__name__).split(". ")[0]
    return None


def leave_report() -> None:
    """Mark this process, whose failure another rank reports (`reported_by_rank0`), to `linger` before it exits."""
    global _linger
    _linger = True


def linger() -> None:
    """At the exit of a process marked by `leave_report`: wait (at most `LINGER_SECONDS`) for torchrun to stop it.
    Torchrun stops every rank once one has exited: a rank that exits at once could have the reporting rank stopped
    before it prints its line (a failed run without a word of why), and would be named the run's first failure."""
    if _linger:
        time.sleep(LINGER_SECONDS)


def cleanup() -> None:
    """Leave the process group (call once at the end of a torchrun launch)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["TIMEOUT", "active", "all_reduce_max", "all_reduce_mean", "barrier", "check_same", "cleanup", "env_world",
           "full_tensor", "gather_full", "gradient_sync", "is_sharded", "leave_report", "linger", "load_full",
           "lost_peer", "on_main", "parallelize", "reported_by_rank0", "setup", "shard_like"]
