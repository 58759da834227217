"""BEMA: bias-corrected exponential moving average of the weights (Block et al. 2025).

With ``step`` = number of optimizer updates so far, and from step ``tau`` on (at ``tau``: ``theta_0 = ema =
theta``)::

    t      = max(step - tau + rho, 1)
    beta   = (1 + gamma t)^-kappa          # EMA weight of the new iterate
    alpha  = (1 + gamma t)^-eta            # bias-correction weight
    ema    = (1 - beta) ema + beta theta
    theta_bema = alpha (theta - theta_0) + ema

Before ``tau``, ``theta_bema = theta``. The state (``theta_0``, ``ema`` per parameter) lives beside the
weights (float32, same device) and is saved in checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


def bema_coefficients(step: int, *, kappa: float = 0.5, eta: float = 0.2, rho: int = 10, gamma: float = 1.0,
                      tau: int = 0) -> tuple[float, float]:
    """(beta, alpha) at ``step`` (see the module docstring)."""
    t = max(step - tau + rho, 1)
    base = 1.0 + gamma * t
    return base ** -kappa, base ** -eta


class BEMA:
    """Tracks BEMA weights of ``model``'s parameters. Call `update(step)` after every optimizer step (and once
    with ``step=0`` before training when ``tau=0``)."""

    def __init__(self, model: nn.Module, *, kappa: float = 0.5, eta: float = 0.2, rho: int = 10,
                 gamma: float = 1.0, tau: int = 0) -> None:
        self.model = model
        self.kappa, self.eta, self.rho, self.gamma, self.tau = kappa, eta, rho, gamma, tau
        self.params = dict(model.named_parameters())
        self.theta0: dict[str, torch.Tensor] = {}
        self.ema: dict[str, torch.Tensor] = {}
        self.step: int | None = None   # last step seen by `update`

    @property
    def started(self) -> bool:
        return bool(self.ema)

    @torch.no_grad()
    def update(self, step: int) -> None:
        self.step = step
        if step < self.tau:
            return
        if not self.started:
            for name, p in self.params.items():
                self.theta0[name] = p.detach().float().clone()
                self.ema[name] = p.detach().float().clone()
        beta, _ = bema_coefficients(step, kappa=self.kappa, eta=self.eta, rho=self.rho,
                                             gamma=self.gamma, tau=self.tau)
        for name, p in self.params.items():
            self.ema[name].lerp_(p.detach().float(), beta)

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """theta_bema per parameter name (the current weights before ``tau``), in each parameter's dtype."""
        if not self.started:
            return {name: p.detach().clone() for name, p in self.params.items()}
        alpha = bema_coefficients(self.step, kappa=self.kappa, eta=self.eta, rho=self.rho, gamma=self.gamma,
                                  tau=self.tau)[1]
        return {name: (alpha * (p.detach().float() - self.theta0[name]) + self.ema[name]).to(p.dtype)
                for name, p in self.params.items()}

    def state_dict_for_model(self) -> dict[str, torch.Tensor]:
        """The model's state dict with BEMA weights in place of the parameters (buffers as they are)."""
        weights = self.weights()
        state = self.model.state_dict()
        # tied / shared parameters appear under several keys: map each alias to its parameter's BEMA weight
        by_id = {id(p): weights[name] for name, p in self.params.items()}
        for module_name, module in self.model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                key = f"{module_name}.{pname}" if module_name else pname
                if id(p) in by_id:
                    state[key] = by_id[id(p)]
        return state

    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """Temporarily load the BEMA weights into the model (restored on exit)."""
        weights = self.weights()
        saved = {name: p.detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(weights[name])
            yield self.model
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])

    # -- checkpointing -------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"theta0.{k}": v for k, v in self.theta0.items()}
        out.update({f"ema.{k}": v for k, v in self.ema.items()})
        return out

    def meta(self) -> dict:
        return {"step": self.step, "kappa": self.kappa, "eta": self.eta, "rho": self.rho, "gamma": self.gamma,
                "tau": self.tau}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.step = meta.get("step")
        self.theta0 = {k[len("theta0."):]: v for k, v in tensors.items() if k.startswith("theta0.")}
        self.ema = {k[len("ema."):]: v for k, v in tensors.items() if k.startswith("ema.")}
        device = next(iter(self.params.values())).device
        self.theta0 = {k: v.to(device) for k, v in self.theta0.items()}
        self.ema = {k: v.to(device) for k, v in self.ema.items()}
