"""NorMuon and cautious weight decay: seed 000's optimizers (its modded-nanogpt fork), on torch's AdamW and `Muon`.

NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491) is Muon whose
orthogonalized update O is normalized per neuron: one running second moment ``v`` per entry of the longer side
of the matrix (the mean of O**2 over the shorter side, an EMA with ``beta2``), ``O / sqrt(v)``, then rescaled to
O's Frobenius norm. The statistic is per row for a matrix with at least as many rows as columns, else per
column, as seed 000 does.

Cautious weight decay (Chen et al. 2025, "Cautious Weight Decay", arXiv 2510.12402) decays only the entries
whose update moves them towards zero (update and weight of the same sign). Seed 000's rates, per step, with the
learning rate entering twice as a decay schedule:

- NorMuon: ``wd * lr_base * lr_update``, ``lr_base`` the scheduled ``train.muon_lr`` and ``lr_update`` the
  matrix's own update lr (its ``muon_lr_mul`` multiplier and torch Muon's shape adjustment); entries with
  update * weight >= 0 decay.
- AdamW: ``wd * lr**2`` with ``lr`` the tensor's scheduled lr (its ``adam_lr_mul`` multiplier included) and
  ``wd`` its group's decay (``weight_decay`` times its ``weight_decay_mul``); entries with update * weight > 0
  decay. Adam's update has the sign of its first moment, known before the step, so the decay is applied first,
  to the weights the update starts from, as the seed does.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr

from lengthgen.train.muon import Muon


class NorMuon(Muon):
    """`Muon` (torch's Muon: Nesterov momentum, Newton-Schulz, its ``adjust_lr_fn``; batched by shape) plus
    NorMuon's per-neuron normalization with ``beta2``. ``cautious``: cautious weight decay at
    ``wd * (lr / lr_mul) * lr_update`` (each group's ``lr_mul`` is its multiplier of the base lr); else torch Muon's
    ``lr * wd`` on every entry."""

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 beta2: float = 0.95, cautious: bool = False, adjust_lr_fn: str | None = None) -> None:
        if not 0 <= beta2 < 1:
            raise ValueError(f"NorMuon beta2 must be in [0, 1), got {beta2}")
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
                         adjust_lr_fn=adjust_lr_fn)
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("cautious", cautious)
            group.setdefault("lr_mul", 1.0)

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """Each orthogonalized update normalized per neuron (`normalize_per_neuron`), then the (cautious) decay
        and the step."""
        lr, wd, beta2 = group["lr"], group["weight_decay"], group["beta2"]
        for p, update in zip(params, updates):
            state = self.state[p]
            if "second_moment" not in state:
                rows, cols = p.shape
                state["second_moment"] = p.new_zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float32)
            update = normalize_per_neuron(update.float(), state["second_moment"], beta2)
            lr_update = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
            if wd and group["cautious"]:
                decay_rate = wd * (lr / group["lr_mul"]) * lr_update
                p.sub_(p * (update * p >= 0) * decay_rate)
            elif wd:
                p.mul_(1 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr_update)


def normalize_per_neuron(update: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon's step: ``second_moment`` (rows x 1 or 1 x cols) <- EMA of the mean of update**2 over the shorter
    side; returns ``update / sqrt(second_moment)`` rescaled to ``update``'s Frobenius norm."""
    reduce = -1 if second_moment.shape[-1] == 1 else -2
    second_moment.lerp_(update.square().mean(dim=reduce, keepdim=True), 1 - beta2)
    scaled = update * second_moment.clamp_min(1e-10).rsqrt()
    return scaled * (update.norm() / scaled.norm().clamp_min(1e-10))


class CautiousAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose groups may carry ``cautious_decay`` (and then ``weight_decay`` 0): before each
    step, the entries whose update will have their sign (the sign of the new first moment) decay by
    ``cautious_decay * lr**2`` (seed 000's DistAdam)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            decay = group.get("cautious_decay", 0.0)
            if not decay:
                continue
            beta1, rate = group["betas"][0], decay * group["lr"] ** 2
            for p in group["params"]:
                if p.grad is None:
                    continue
                first = self.state[p].get("exp_avg")
                moment = p.grad if first is None else torch.lerp(first, p.grad.to(first.dtype), 1 - beta1)
                p.sub_(p * (moment * p > 0) * rate)
        return super().step(closure)
