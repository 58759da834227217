"""Seed 001's optimizer: heavyball's ``AdamW(palm=True)``, AdamW whose second-moment decay grows with the step.

PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", sec. 5) decays the second moment
with ``beta2_t = 1 - t**-0.8`` at update ``t`` (counted from 1), so early updates average few squared gradients
and late ones many. Seed 001 trains with heavyball's AdamW (github.com/HomebrewML/HeavyBall, as of December 2025)
with that schedule, whose update of a parameter ``p`` with gradient ``g`` is::

    debias(beta, t) = 1 - (1 - beta) / (1 - beta**t)
    m = lerp(m, g,    1 - debias(beta1, t))            # the bias-corrected first moment
    v = lerp(v, g**2, 1 - debias(beta2_t, t))          # and second moment, each kept corrected
    p = p * (1 - lr * weight_decay) - lr * m / max(sqrt(v), eps)

For a constant ``beta`` the corrected moments equal Adam's ``m / (1 - beta**t)``; unlike torch's AdamW, ``eps``
is a floor of ``sqrt(v)``, not added to it. ``lr`` is the scheduled learning rate (heavyball's own warmup,
``t / (warmup + 1)``, is ``train.warmup_steps = warmup + 1`` of lengthgen's schedule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def debias(beta: float, t: int) -> float:
    """heavyball's ``beta_debias``: the decay at update ``t`` that keeps an EMA bias-corrected."""
    return 1 - (1 - beta) / (1 - beta ** t)


def _check(name: str, value: Any, valid: str, ok: Callable[[Any], bool]) -> None:
    """A ValueError naming PaLMAdamW's argument ``name`` unless ``ok(value)``."""
    try:
        good = bool(ok(value))
    except TypeError:       # not a number
        good = False
    if not good:
        raise ValueError(f"PaLMAdamW {name} must be {valid}, got {value!r}")


class PaLMAdamW(torch.optim.Optimizer):
    """AdamW with PaLM's ``beta2_t = 1 - t**-beta2_power`` (see the module docstring). ``betas``: only the first,
    ``beta1``, is used (the second is ignored; it is in the signature so groups can carry torch AdamW's betas).
    A bad value, in the defaults or in a parameter group, is a ValueError naming it."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.0, beta2_power: float = 0.8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      beta2_power=beta2_power))

    def add_param_group(self, param_group: dict) -> None:
        """Check the group's settings (its own, else the defaults), then add it."""
        group = {**self.defaults, **param_group}
        betas = group["betas"]
        _check("betas", betas, "a pair (beta1, beta2)", lambda b: isinstance(b, (tuple, list)) and len(b) == 2)
        _check("beta1", betas[0], "in [0, 1)", lambda x: 0 <= x < 1)
        _check("lr", group["lr"], "a finite number >= 0", lambda x: 0 <= x < math.inf)
        _check("eps", group["eps"], "a finite number > 0 (the floor of sqrt(v): with 0, an entry whose gradients "
               "have all been 0 divides 0 by 0)", lambda x: 0 < x < math.inf)
        _check("weight_decay", group["weight_decay"], "a finite number >= 0", lambda x: 0 <= x < math.inf)
        _check("beta2_power", group["beta2_power"], "a finite number > 0", lambda x: 0 < x < math.inf)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"].item())
                beta1 = debias(group["betas"][0], t)
                beta2 = debias(1 - t ** -group["beta2_power"], t)
                grad = p.grad
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.mul_(1 - lr * decay)
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().clamp_min(eps), value=-lr)
        return loss
