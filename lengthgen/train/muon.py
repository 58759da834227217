"""Muon (Jordan et al. 2024) whose Newton-Schulz iteration runs once per matrix shape, on the stack of that shape's
updates.

`torch.optim.Muon` orthogonalizes one matrix at a time: the ~124M benchmark GPT's 72 hidden matrices cost
5 iterations x 3 matmuls each, about a thousand small kernels, and its optimizer steps took 28 of 139 ms of a
compiled training step on an H100 (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22-1715). `Muon` runs the
same iteration as torch's (`torch.optim._muon._zeropower_via_newtonschulz`: bf16, the wide orientation, division
by the Frobenius norm, the quintic with coefficients ``(a, b, c)``) on each shape's stacked updates, as
modded-nanogpt does, so the 124M model takes 2 batched iterations instead of 72. Same hyperparameters, state
(``momentum_buffer``) and update as torch's Muon, so each loads the other's state dict.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr


def orthogonalize(updates: list[torch.Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> list[torch.Tensor]:
    """The bf16 Newton-Schulz orthogonalization of each 2-D update (torch Muon's, Jordan et al. 2024): with X the
    update (transposed when taller than wide) over its Frobenius norm, ``ns_steps`` times
    ``A = X X^T; X <- a X + (b A + c A^2) X``. Batched over the updates of one shape and device."""
    a, b, c = ns_coefficients
    out: list[torch.Tensor | None] = [None] * len(updates)
    shapes: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        shapes.setdefault((tuple(update.shape), update.device), []).append(i)
    for ((rows, cols), _), index in shapes.items():
        x = torch.stack([updates[i] for i in index]).bfloat16()
        if rows > cols:
            x = x.mT
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if rows > cols:
            x = x.mT
        for i, orthogonal in zip(index, x.unbind()):
            out[i] = orthogonal
    return out


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` (its momentum, Nesterov option, Newton-Schulz, ``adjust_lr_fn`` and decoupled weight
    decay ``p <- p (1 - lr wd)``) with the orthogonalization batched by shape (`orthogonalize`)."""

    def _orthogonalized(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The group's parameters with a gradient and their orthogonalized momentum updates (bf16); the momentum
        buffers are updated: ``buf <- lerp(buf, grad, 1 - momentum)``, the update ``lerp(grad, buf, momentum)``
        with Nesterov, else ``buf``."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return [], []
        if any(p.grad.ndim != 2 or p.grad.is_sparse or p.is_complex() for p in params):
            raise ValueError("Muon takes dense real 2-D parameters only")
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grads = [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        # one lerp per matrix: torch 2.11's DTensor (FSDP2) has no out-of-place _foreach_lerp
        updates = [g.lerp(b, momentum) for g, b in zip(grads, bufs)] if group["nesterov"] else bufs
        return params, orthogonalize(updates, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """torch Muon's step with the orthogonalized updates: ``p <- p (1 - lr wd) - lr' update``, lr' the
        ``adjust_lr_fn`` of p's shape."""
        lr, wd = float(group["lr"]), group["weight_decay"]
        if wd and params:
            torch._foreach_mul_(params, 1 - lr * wd)
        for p, update in zip(params, updates):
            p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._apply(group, *self._orthogonalized(group))
        return loss


__all__ = ["Muon", "orthogonalize"]
