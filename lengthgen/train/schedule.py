"""Learning-rate and Muon-momentum schedules as pure functions of the step (the lr as a multiplier of its peak).

``step`` counts optimizer updates from 0 (the multiplier used for update ``step``), ``total`` is the number
of updates. Warmup (every lr schedule): ``(step + 1) / warmup`` for ``step < warmup``.

* cosine (Loshchilov and Hutter 2017, SGDR): ``min + (1 - min) * (1 + cos(pi * progress)) / 2`` with
  ``progress = (step - warmup) / max(1, total - warmup)``;
* wsd (warmup, stable, decay; Hu et al. 2024, MiniCPM): 1 until
  ``decay_start = total - round(cooldown_frac * total)``, then linear
  ``1 - (1 - min) * (step - decay_start) / (total - decay_start)``;
* constant: 1 after warmup.

Muon's momentum (`momentum_at`, seed 000's modded-nanogpt ``get_muon_momentum``): linear from ``low`` to ``peak``
over the first ``warmup`` updates (``low + (peak - low) step / warmup``), ``peak``, then linear back towards ``low``
over the last ``cooldown`` updates (``peak - (peak - low) (step - (total - cooldown)) / cooldown`` after
``total - cooldown``).

Re-warming (``restart``, seed 001 re-creates its optimizer with a fresh warmup at every stage): for ``warmup``
updates from step ``restart`` on, the multiplier is scaled by ``(step - restart + 1) / warmup``.
"""

from __future__ import annotations

import math


def warmup_multiplier(step: int, warmup: int) -> float | None:
    """The warmup multiplier, or None after warmup."""
    return (step + 1) / warmup if step < warmup else None


def cosine_multiplier(step: int, total: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    w = warmup_multiplier(step, warmup)
    if w is not None:
        return w
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd_multiplier(step: int, total: int, warmup: int = 0, cooldown_frac: float = 0.2,
                   min_ratio: float = 0.0) -> float:
    w = warmup_multiplier(step, warmup)
    if w is not None:
        return w
    cooldown = round(cooldown_frac * total)
    decay_start = total - cooldown
    if step < decay_start or cooldown == 0:
        return 1.0
    return 1 - (1 - min_ratio) * min(1.0, (step - decay_start) / cooldown)


def lr_multiplier(step: int, *, total: int, schedule: str = "cosine", warmup: int = 0,
                  cooldown_frac: float = 0.2, min_ratio: float = 0.0, restart: int = 0) -> float:
    """The multiplier of the peak learning rate at update ``step`` (see the module docstring)."""
    if schedule == "cosine":
        base = cosine_multiplier(step, total, warmup, min_ratio)
    elif schedule == "wsd":
        base = wsd_multiplier(step, total, warmup, cooldown_frac, min_ratio)
    elif schedule == "constant":
        w = warmup_multiplier(step, warmup)
        base = 1.0 if w is None else w
    else:
        raise ValueError(f"schedule={schedule!r} is not valid; choose one of cosine, wsd, constant")
    ramp = warmup_multiplier(step - restart, warmup) if 0 < restart <= step else None
    return base if ramp is None else base * ramp


def momentum_at(step: int, *, total: int, peak: float, low: float, warmup: int = 0, cooldown: int = 0) -> float:
    """Muon's momentum at update ``step`` (see the module docstring); ``peak`` without warmup or cooldown."""
    if step < warmup:
        return low + (peak - low) * step / warmup
    if cooldown and step > total - cooldown:
        return peak - (peak - low) * (step - (total - cooldown)) / cooldown
    return peak
