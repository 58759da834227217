"""BEMA: bias-corrected exponential moving average of the weights (Block and Zhang 2025, "EMA Without the Lag").

With ``step`` = number of optimizer updates so far, BEMA starts at step ``tau`` (``theta_0 = ema = theta``) and
is updated there and every ``update_every`` steps after::

    t      = max(step - tau + rho, 1)
    beta   = (1 + gamma t)^-kappa          # EMA weight of the new iterate
    alpha  = (1 + t)^-eta                  # bias-correction weight
    ema    = (1 - beta) ema + beta theta
    theta_bema = alpha (theta - theta_0) + ema

Between updates ``theta_bema`` is that of the last update; before ``tau`` it is ``theta``. This is the form of
the authors' code (abblock/bema, its offline stabilizer, with which the paper's results were computed;
``update_every`` is its ``update_freq``): gamma scales time in the EMA weight only. The paper writes both weights
as ``(rho + gamma t)^-kappa`` and ``(rho + gamma t)^-eta`` (the same for gamma = 1, the default, up to one step
of lag); the repository's online training callback uses a third form, ``gamma (1 + t')^-kappa`` and
``gamma (1 + t')^-eta`` with ``t' = max(step - rho, 0)``. The state (``theta_0``, ``ema`` and the last
``theta_bema`` per parameter) lives beside the weights (float32, same device) and is saved in checkpoints.
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
    return (1.0 + gamma * t) ** -kappa, (1.0 + t) ** -eta


class BEMA:
    """Tracks BEMA weights of ``model``'s parameters. Call `update(step)` after every optimizer step (and once
    with ``step=0`` before training when ``tau=0``); it updates at ``tau`` and every ``update_every`` steps after."""

    def __init__(self, model: nn.Module, *, kappa: float = 0.5, eta: float = 0.2, rho: int = 10,
                 gamma: float = 1.0, tau: int = 0, update_every: int = 1) -> None:
        self.model = model
        self.kappa, self.eta, self.rho, self.gamma, self.tau = kappa, eta, rho, gamma, tau
        self.update_every = update_every
        self.params = dict(model.named_parameters())
        self.theta0: dict[str, torch.Tensor] = {}
        self.ema: dict[str, torch.Tensor] = {}
        self.bema: dict[str, torch.Tensor] = {}   # theta_bema at the last update
        self.step: int | None = None   # last step seen by `update`

    @property
    def started(self) -> bool:
        return bool(self.ema)

    @torch.no_grad()
    def update(self, step: int) -> None:
        self.step = step
        if step < self.tau or (step - self.tau) % self.update_every:
            return
        if not self.started:
            for name, p in self.params.items():
                self.theta0[name] = p.detach().float().clone()
                self.ema[name] = p.detach().float().clone()
        beta, alpha = bema_coefficients(step, kappa=self.kappa, eta=self.eta, rho=self.rho, gamma=self.gamma,
                                        tau=self.tau)
        for name, p in self.params.items():
            theta = p.detach().float()
            self.ema[name].lerp_(theta, beta)
            self.bema[name] = alpha * (theta - self.theta0[name]) + self.ema[name]

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """theta_bema per parameter name (the current weights before ``tau``), in each parameter's dtype."""
        if not self.started:
            return {name: p.detach().clone() for name, p in self.params.items()}
        return {name: self.bema[name].to(p.dtype) for name, p in self.params.items()}

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
    STATE = ("theta0", "ema", "bema")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{part}.{k}": v for part in self.STATE for k, v in getattr(self, part).items()}

    def meta(self) -> dict:
        return {"step": self.step, "kappa": self.kappa, "eta": self.eta, "rho": self.rho, "gamma": self.gamma,
                "tau": self.tau, "update_every": self.update_every}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.step = meta.get("step")
        device = next(iter(self.params.values())).device
        for part in self.STATE:
            setattr(self, part, {k[len(part) + 1:]: v.to(device) for k, v in tensors.items()
                                 if k.startswith(part + ".")})
