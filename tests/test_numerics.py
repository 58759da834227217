"""Numerics: every CPU backend against the float64 dense oracle in float32 and bfloat16, at logits up to 1e4 and
p from 0.1 to 100 -- no inf or NaN, errors within the dtype's tolerance (the Triton kernel's cases run under
the interpreter in test_triton.py).

The oracle runs on the same rounded inputs, so the tolerance is the computation's, not the input rounding's:
the dtype's epsilon (the output is rounded to it) plus float32's epsilon times the largest logit (a float32
logit of size 1e4 is known to about 1e-3). Gradient errors are measured against the size of the terms each
gradient sums (|dO| |v| |k| for dq, |dO| |v| |q'| for dk, |dO| for dv).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lengthgen.attention import AttentionSpec, attend, backends
from lengthgen.attention import functional as fn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

P_VALUES = (0.1, 0.5, 1.0, 2.0, 8.0, 100.0)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# spread: logits spread over [-scale, scale] (near one-hot rows); offset: every logit near +scale, O(1) apart
# (weights spread over many keys while exp(logit) overflows any dtype)
REGIMES = list(itertools.product(("spread", "offset"), (10.0, 1e4)))


def stress_inputs(regime: str, scale: float, seed: int = 0, b: int = 2, h: int = 2, length: int = 24, d: int = 8):
    """float64 q, k, v whose logits q.k / sqrt(d) reach about ``scale``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, length, d, generator=g, dtype=torch.float64) for _ in range(3))
    if regime == "spread":
        return q * math.sqrt(scale / 3), k * math.sqrt(scale / 3), v
    if regime == "offset":
        q[..., 0] = k[..., 0] = math.sqrt(scale * math.sqrt(d))
        return q, k, v
    return q * 1e4 / math.sqrt(d), k * 1e4 / math.sqrt(d), v        # |q|, |k| ~ 1e4: logits ~ 1e7


def tolerance(dtype: torch.dtype, max_logit: float) -> float:
    return torch.finfo(dtype).eps + 4 * torch.finfo(torch.float32).eps * max(1.0, max_logit)


def spec_for(p: float, regime: str = "spread") -> AttentionSpec:
    """Plain softmax, or p with a distance term: scale-invariant (a_t s + bias_t) on spread logits, ALiBi on
    offset ones (a_t > 1 on logits all near +1e4 would leave only the farthest key)."""
    if p == 1:
        return AttentionSpec()
    return AttentionSpec(softmax_p=p, distance="scale_invariant" if regime == "spread" else "alibi")


def oracle(q, k, v, spec, gout=None):
    """float64 dense output (and gradients for upstream ``gout``) on the same rounded inputs."""
    ins = [t.detach().double().requires_grad_(gout is not None) for t in (q, k, v)]
    out = attend(*ins, spec, backend="dense")
    return out.detach(), (torch.autograd.grad(out, ins, gout.double()) if gout is not None else None)


def max_logit(q, k, spec) -> float:
    qs = fn.scale_queries(q.double(), spec, k.shape[-2])
    return float((qs @ k.double().transpose(-1, -2)).abs().max())


def cases(training: bool):
    for name in ("dense", "tiled", "sdpa", "cpu_flash", "flex"):
        for p, dtype in itertools.product(P_VALUES, DTYPES):
            q = torch.empty(1, 2, 8, 8, dtype=DTYPES[dtype])
            if backends.unsupported(name, spec_for(p), q, training) is None:
                yield name, p, dtype


@pytest.mark.parametrize("backend,p,dtype", list(cases(training=False)))
def test_forward_against_float64_oracle(backend, p, dtype):
    dt = DTYPES[dtype]
    for regime, scale in REGIMES:
        spec = spec_for(p, regime)
        q, k, v = (t.to(dt) for t in stress_inputs(regime, scale))
        with torch.no_grad():
            out = attend(q, k, v, spec, backend=backend)
        want, _ = oracle(q, k, v, spec)
        assert out.dtype == dt and torch.isfinite(out).all(), (regime, scale)
        err = float((out.double() - want).abs().max() / want.abs().max())
        assert err <= tolerance(dt, max_logit(q, k, spec)), (regime, scale, err)


def gradient_errors(q, k, v, spec, backend, gout_seed=1) -> list[float]:
    """max |grad - oracle| of q, k, v, each over the size of the terms it sums (see the module doc) or of the
    gradient itself, whichever is larger."""
    out = attend(q, k, v, spec, backend=backend)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(gout_seed)).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), gout)
    assert all(torch.isfinite(g).all() for g in got)
    q, k, v = q.detach(), k.detach(), v.detach()
    _, want = oracle(q, k, v, spec, gout)
    term = float(gout.abs().max() * v.abs().max()) * (2.0 if spec.distance == "scale_invariant" else 1.0)
    qs = fn.scale_queries(q.double(), spec, k.shape[-2])                    # (a_t <= 2 at these lengths)
    scales = (term * float(k.abs().max()) / math.sqrt(q.shape[-1]), term * float(qs.abs().max()),
              float(gout.abs().max()))
    return [float((g.double() - w).abs().max()) / max(s, float(w.abs().max())) for g, w, s in zip(got, want, scales)]


@pytest.mark.parametrize("backend,p,dtype", list(cases(training=True)))
def test_gradients_against_float64_oracle(backend, p, dtype):
    dt = DTYPES[dtype]
    for regime, scale in REGIMES:
        spec = spec_for(p, regime)
        q, k, v = (t.to(dt).requires_grad_() for t in stress_inputs(regime, scale))
        tol = tolerance(dt, max_logit(q.detach(), k.detach(), spec))
        errors = gradient_errors(q, k, v, spec, backend)
        assert max(errors) <= tol, (regime, scale, errors)


@pytest.mark.parametrize("backend", ["dense", "tiled", "cpu_flash"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_huge_queries_and_keys(backend, dtype):
    """|q|, |k| ~ 1e4 (logits ~ 1e7, one-hot rows): the dense backend used to return 1e14 at p=100 in float32
    and inf/NaN in bfloat16. Values and gradients stay exact up to the dtype's rounding (every p the backend runs)."""
    dt = DTYPES[dtype]
    eps = torch.finfo(dt).eps
    for p in P_VALUES:
        spec = spec_for(p)
        if backends.unsupported(backend, spec, torch.empty(1), True) is not None:
            continue
        q, k, v = (t.to(dt).requires_grad_() for t in stress_inputs("huge", 0.0))
        with torch.no_grad():
            out = attend(q, k, v, spec, backend=backend)
        want, _ = oracle(q, k, v, spec)
        assert torch.isfinite(out).all(), p
        assert float((out.double() - want).abs().max() / want.abs().max()) <= eps, p
        errors = gradient_errors(q, k, v, spec, backend, gout_seed=2)
        assert max(errors) <= 4 * eps, (p, errors)
