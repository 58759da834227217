"""Identities of the attention math, each checked numerically."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lengthgen.attention import Attention, AttentionSpec, attend
from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.backends import tiled

F64 = dict(rtol=1e-10, atol=1e-10)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", ["dense", "tiled", "sdpa", "cpu_flash"])
def test_p1_equals_torch_causal_sdpa(backend):
    q, k, v = randn(2, 3, 17, 8, seed=1), randn(2, 3, 17, 8, seed=2), randn(2, 3, 17, 8, seed=3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attend(q, k, v, AttentionSpec(softmax_p=1.0), backend=backend)
    torch.testing.assert_close(got, want, **F64)


def test_p_softmax_normalizes_the_p_norm():
    x = randn(5, 9, seed=4)
    x[:, 6:] = float("-inf")
    for p in (0.5, 1.0, 2.0, 3.0):
        w = fn.p_softmax(x, p)
        torch.testing.assert_close(w.pow(p).sum(-1), torch.ones(5, dtype=torch.float64), **F64)
        assert (w[:, 6:] == 0).all()
    torch.testing.assert_close(fn.p_softmax(x, 1.0), torch.softmax(x, -1), **F64)


@pytest.mark.parametrize("p", [0.5, 1.0, 1.5, 3.0])
def test_p_softmax_gradient_is_finite_on_a_row_of_only_minus_inf(p):
    """A row that sees nothing has weights 0 and gradient 0 (logsumexp of an all -inf row has a NaN gradient, 0 *
    exp(-inf + inf), even where its value is not used); the other rows' gradients are unchanged."""
    x = randn(3, 5, seed=6)
    x[0] = float("-inf")
    x[1, :2] = float("-inf")
    x.requires_grad_()
    w, (lse_1, lse_p) = fn.p_softmax(x, p), fn._p_softmax(x, p, lse=True)[1:]
    assert (w[0] == 0).all() and (lse_1[0] == float("-inf")).all() and (lse_p[0] == float("-inf")).all()
    gout = randn(3, 5, seed=7)
    (grad,) = torch.autograd.grad(w, x, gout)
    assert torch.isfinite(grad).all() and (grad[0] == 0).all() and (grad[1, :2] == 0).all()
    rest = x.detach()[1:].clone().requires_grad_()
    (want,) = torch.autograd.grad(fn.p_softmax(rest, p), rest, gout[1:])
    torch.testing.assert_close(grad[1:], want, **F64)


@pytest.mark.parametrize("kind", ["head_layer", "global_layer", "head_rms", "global_rms"])
def test_out_norm_matches_torch_norms(kind):
    b, h, length, d = 2, 4, 5, 6
    y = randn(b, h, length, d, seed=5) * 3 + 1.5
    flat = y.transpose(1, 2).reshape(b * length, h * d)      # (tokens, heads*head_dim)
    got = fn.out_norm(y, kind, 1e-5).transpose(1, 2).reshape(b * length, h * d)
    if kind == "head_layer":
        want = torch.nn.GroupNorm(h, h * d, eps=1e-5, affine=False).double()(flat)
    elif kind == "global_layer":
        want = F.layer_norm(flat, (h * d,), eps=1e-5)
    elif kind == "head_rms":
        want = F.rms_norm(flat.view(-1, h, d), (d,), eps=1e-5).reshape(-1, h * d)
    else:
        want = F.rms_norm(flat, (h * d,), eps=1e-5)
    torch.testing.assert_close(got, want, **F64)
    torch.testing.assert_close(fn.out_norm(y, "none", 1e-5), y)


def test_scale_invariant_leaves_distance_zero_unchanged():
    spec = AttentionSpec(distance="scale_invariant", tau=4.0)
    mod = mods.scale_invariant(4.0)
    i, j = torch.tensor([12, 12, 12]), torch.tensor([12, 8, 0])                      # t = 0, 4, 12
    zero, one = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    bias = mod(zero, 0, 0, i, j)
    a = mod(one, 0, 0, i, j) - bias                                                  # the score mod is a_t s + bias_t
    torch.testing.assert_close(a, torch.tensor([1.0, math.sqrt(1 + 2 * math.log(2)), math.sqrt(1 + 2 * math.log(4))],
                                               dtype=torch.float64), **F64)
    torch.testing.assert_close(bias, torch.tensor([0.0, -2 * math.log(2), -2 * math.log(4)], dtype=torch.float64),
                               **F64)
    # in the logits: the diagonal (t = 0) equals the plain scores, off-diagonal entries do not
    qs, k = randn(1, 2, 6, 4, seed=6), randn(1, 2, 6, 4, seed=7)
    pos, visible = torch.arange(6), mods.mask_mod_for(spec, 6, 6)
    with_si = fn.logits(qs, k, mods.score_mod_for(spec, 2, 6, 6, dtype=torch.float64), visible, pos, pos)
    plain = fn.logits(qs, k, None, visible, pos, pos)
    torch.testing.assert_close(with_si.diagonal(dim1=-2, dim2=-1), plain.diagonal(dim1=-2, dim2=-1), **F64)
    below = torch.tril(torch.ones(6, 6, dtype=torch.bool), -1)
    assert ((with_si - plain)[..., below].abs() > 1e-6).all()


DOC_CASES = {"plain": {}, "log_n_alibi_p2": dict(query_scaling="log_n", distance="alibi", softmax_p=2.0),
             "sqrt_window_si": dict(query_scaling="sqrt_log_n", window=3, distance="scale_invariant"),
             "sqrt_window": dict(query_scaling="sqrt_log_n", window=3)}


@pytest.mark.parametrize("name,backend", [(n, b) for n in DOC_CASES for b in ("dense", "tiled", "sdpa", "cpu_flash")
                                          if b not in ("sdpa", "cpu_flash") or n in ("plain", "sqrt_window")])
def test_document_masking_equals_each_document_alone(name, backend):
    spec = AttentionSpec(doc_masking=True, **DOC_CASES[name])
    lengths = [4, 1, 7, 3]
    length = sum(lengths)
    q, k, v = randn(1, 2, length, 4, seed=8), randn(1, 2, length, 4, seed=9), randn(1, 2, length, 4, seed=10)
    docs = torch.cat([torch.full((n,), i % 2) for i, n in enumerate(lengths)])[None]   # ids 0,1,0,1: runs
    packed = attend(q, k, v, spec, doc_ids=docs, backend=backend)
    alone, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        alone.append(attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], spec.replace(doc_masking=False), backend="dense"))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, dim=2), **F64)
    # and without doc masking the result differs (the documents do interact)
    assert (attend(q, k, v, spec.replace(doc_masking=False), backend="dense") - packed).abs().max() > 1e-3


def test_p2_keeps_output_variance_p1_shrinks_it():
    """Seed 001: with uniform attention (q = 0) over n i.i.d. unit-variance values, p=1 averages them
    (variance 1/n) while p=2 weights each by 1/sqrt(n) (variance 1)."""
    torch.manual_seed(0)
    b, h, length, d = 8, 4, 256, 64
    q = torch.zeros(b, h, length, d)
    k, v = torch.randn(b, h, length, d), torch.randn(b, h, length, d)
    out1 = attend(q, k, v, AttentionSpec(softmax_p=1.0), backend="tiled")
    out2 = attend(q, k, v, AttentionSpec(softmax_p=2.0), backend="tiled")
    for n in (1, 4, 16, 64, 256):
        var1 = out1[:, :, n - 1].var().item()
        var2 = out2[:, :, n - 1].var().item()
        assert var2 == pytest.approx(1.0, rel=0.15), (n, var2)
        assert var1 * n == pytest.approx(1.0, rel=0.15), (n, var1)


@pytest.mark.parametrize("p", [0.5, 2.0, 3.0])
def test_fast_backend_lse_identity(p):
    """out_p = out_1 * exp(LSE_1 - LSE_p / p), and the LSEs are the logsumexps of the oracle's logits."""
    spec = AttentionSpec(softmax_p=p, distance="log_bias", window=7, doc_masking=True)
    q, k, v = randn(2, 2, 15, 4, seed=11), randn(2, 2, 15, 4, seed=12), randn(2, 2, 15, 4, seed=13)
    docs = torch.tensor([[0] * 6 + [1] * 9, [0] * 2 + [1] * 11 + [2] * 2])
    qs = fn.scale_queries(q, spec, 15, docs)
    out_p, lse_1, lse_p = tiled.attention(qs, k, v, spec, docs, q_block=4, k_block=3, return_lse=True)
    out_1 = tiled.attention(qs, k, v, spec.replace(softmax_p=1.0), docs, q_block=4, k_block=3)
    assert lse_1.shape == lse_p.shape == (2, 2, 15)
    torch.testing.assert_close(out_p, out_1 * torch.exp(lse_1 - lse_p / p).unsqueeze(-1), **F64)
    pos = torch.arange(15)
    visible = mods.mask_mod_for(spec, 15, 15, mods.document_starts(spec, docs))
    logit = fn.logits(qs, k, mods.score_mod_for(spec, 2, 15, 15, dtype=torch.float64), visible, pos, pos)
    torch.testing.assert_close(lse_1, torch.logsumexp(logit, -1), **F64)
    torch.testing.assert_close(lse_p, torch.logsumexp(p * logit, -1), **F64)
    assert (out_p - out_1).abs().max() > 1e-3
    _, lse_1_of_p1, lse_p_of_p1 = tiled.attention(qs, k, v, spec.replace(softmax_p=1.0), docs, q_block=4, k_block=3,
                                                  return_lse=True)
    torch.testing.assert_close(lse_1_of_p1, lse_1, **F64)
    torch.testing.assert_close(lse_p_of_p1, lse_1, **F64)


def test_visible_counts():
    spec = AttentionSpec(doc_masking=True)
    docs = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]])
    assert mods.visible_counts(spec, 8, 8, docs).tolist() == [[1, 2, 3, 1, 2, 1, 2, 3]]
    assert mods.visible_counts(spec, 3, 8, docs).tolist() == [[1, 2, 3]]
    assert mods.visible_counts(AttentionSpec(window=2), 8, 8, docs).tolist() == [[1, 2, 2, 2, 2, 2, 2, 2]]
    assert mods.visible_counts(spec.replace(window=2), 8, 8, docs).tolist() == [[1, 2, 2, 1, 2, 1, 2, 2]]


@pytest.mark.parametrize("scaling", ["log_n", "log_bn", "sqrt_log_n"])
def test_query_gains_equal_their_formulas(scaling):
    spec = AttentionSpec(query_scaling=scaling, scaling_a=0.3, scaling_b=0.25, scaling_c=1.1, window=9)
    n = torch.tensor([[1.0, 2.0, 5.0, 9.0]], dtype=torch.float64)
    mult = torch.tensor([0.5, 2.0], dtype=torch.float64)
    g = fn.query_gain(n, spec, mult)
    assert g.shape == (1, 2, 4, 1)
    for h in range(2):
        for i, ni in enumerate(n[0].tolist()):
            if scaling == "log_n":
                want = mult[h].item() * math.log(ni)
            elif scaling == "log_bn":
                want = 0.3 + mult[h].item() * math.log(0.25 * ni + 1.1)
            else:
                want = 0.3 + mult[h].item() * math.sqrt(2 * math.log(0.25 * ni + 1.1))
            assert g[0, h, i, 0].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert fn.query_gain(n, AttentionSpec()) is None
    # in attend(): the gain multiplies the query of position i by g(n_i), with n_i = min(i + 1, window)
    q, k, v = randn(1, 2, 12, 4, seed=14), randn(1, 2, 12, 4, seed=15), randn(1, 2, 12, 4, seed=16)
    n_i = torch.arange(1, 13, dtype=torch.float64).clamp(max=9)[None]
    scaled_q = q * fn.query_gain(n_i, spec, mult)
    want = attend(scaled_q, k, v, spec.replace(query_scaling="none"), backend="dense")
    torch.testing.assert_close(attend(q, k, v, spec, multipliers=mult, backend="dense"), want, **F64)
    torch.testing.assert_close(attend(q, k, v, spec, multipliers=mult, backend="tiled"), want, **F64)


class _AtenOps(TorchDispatchMode):
    """Records the aten ops dispatched inside the block (each is a kernel launch on a GPU)."""

    def __enter__(self):
        self.ops, self.sizes = [], []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.__name__)
        self.sizes.append(out.numel() if isinstance(out, torch.Tensor) else 0)
        return out

    def passes(self, numel: int) -> list[str]:
        """The ops that wrote ``numel`` elements or more (a pass over a tensor that large), allocations aside."""
        return [op for op, n in zip(self.ops, self.sizes) if n >= numel and not op.startswith("empty")]


@pytest.mark.parametrize("scaling", ["log_n", "log_bn", "sqrt_log_n"])
def test_query_scaling_is_one_cached_factor(scaling):
    """Without documents or an explicit mask the gain is a cached per-position constant: after the first call,
    query scaling adds at most 4 small ops to the baseline's (upcast, multiply) and creates no tensor from Python
    values (a host-to-device copy on CUDA). It equals the uncached gain, and a first call under inference
    mode (an evaluation) does not poison later training."""
    spec = AttentionSpec(query_scaling=scaling, scaling_a=0.3, window=9)
    q = randn(2, 2, 12, 4, seed=17)
    with torch.inference_mode():
        fn.scale_queries(q, spec, 12)
    with _AtenOps() as base_ops:
        fn.scale_queries(q, AttentionSpec(), 12)
    for mult in (None, torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)):
        with _AtenOps() as ops:
            scaled = fn.scale_queries(q.requires_grad_(), spec, 12, multiplier=mult)
        assert len(ops.ops) <= len(base_ops.ops) + 4 and "lift_fresh" not in ops.ops, ops.ops
        one_doc = torch.zeros(2, 12, dtype=torch.long)        # the uncached path: per-row counts of one document
        uncached = fn.scale_queries(q, spec.replace(doc_masking=True), 12, one_doc, multiplier=mult)
        torch.testing.assert_close(scaled, uncached, rtol=1e-15, atol=0)
        scaled.sum().backward()                           # the cached constant can be saved for backward
    n = torch.arange(1, 13, dtype=torch.float64).clamp(max=9)[None]
    gains = fn.query_gain(n, spec) + fn.query_gain(n, spec, mult.detach())       # both calls' d(sum q')/dq / base
    torch.testing.assert_close(q.grad, (gains * 0.5).expand(2, 2, 12, 4), rtol=1e-12, atol=0)


@pytest.mark.parametrize("scaling, learned", [("none", False), ("sqrt_log_n", False), ("sqrt_log_n", True)])
def test_queries_for_a_half_precision_kernel_are_one_pass_each_way(scaling, learned):
    """q' for a fused kernel that takes it in bf16 (`backends.query_dtype` on CUDA) is the float32 product rounded
    once, as the upcast, multiply and downcast it replaces (bitwise, values and dq; d multiplier to float32
    rounding), in one op over q forward and one backward, where those were three each (a learned multiplier's
    gradient adds its float32 product of grad and q, as before)."""
    spec = AttentionSpec(query_scaling=scaling, window=9)
    mult = torch.tensor([0.5, 2.0], requires_grad=learned) if scaling != "none" else None
    wrt = lambda: [q] + ([mult] if learned else [])      # noqa: E731
    q = randn(2, 2, 12, 64, seed=5, dtype=torch.float32).mul(30).bfloat16().requires_grad_()
    grad = randn(2, 2, 12, 64, seed=6, dtype=torch.float32).bfloat16()
    with _AtenOps() as old_ops:
        plain = fn.scale_queries(q, spec, 12, multiplier=mult).to(torch.bfloat16)     # the ops it replaces
        want = torch.autograd.grad(plain, wrt(), grad)
    with _AtenOps() as forward:
        got = fn.scale_queries(q, spec, 12, multiplier=mult, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, plain)
    with _AtenOps() as backward:
        grads = torch.autograd.grad(got, wrt(), grad)
    assert torch.equal(grads[0], want[0])
    if learned:
        torch.testing.assert_close(grads[1], want[1], rtol=1e-6, atol=0)
    assert forward.passes(q.numel()) == ["mul.out"], forward.ops
    assert backward.passes(q.numel())[0] == "mul.out", backward.ops
    assert len(backward.passes(q.numel())) == (4 if learned else 1), backward.ops
    assert len(old_ops.passes(q.numel())) == (7 if learned else 6), old_ops.ops


@pytest.mark.parametrize("scaling", ["none", "sqrt_log_n"])
def test_kernel_scale_backends_take_base_scale_in_the_kernel(scaling):
    """The backends of `backends.KERNEL_SCALE` multiply their dot products by base_scale themselves: through SDPA,
    `attend` makes no pass over the queries without query scaling (forward or backward), one multiply each way
    with it (q * g_i), and matches the dense oracle."""
    from lengthgen.attention import backends

    assert set(backends.KERNEL_SCALE) == {"sdpa", "flex", "triton"}
    spec = AttentionSpec(query_scaling=scaling, base_scale=0.3)
    q, k, v = (randn(2, 2, 24, 8, seed=s, dtype=torch.float32).requires_grad_() for s in (1, 2, 3))
    muls = lambda ops: [op for op in ops.passes(q.numel()) if op.startswith("mul")]      # noqa: E731
    with _AtenOps() as forward:
        out = attend(q, k, v, spec, backend="sdpa")
    with _AtenOps() as backward:
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert len(muls(forward)) == len(muls(backward)) == (0 if scaling == "none" else 1), (forward.ops, backward.ops)
    want = attend(q, k, v, spec, backend="dense")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, ref in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("scaling", ["none", "sqrt_log_n"])
def test_cuda_fused_kernels_take_base_scale_in_the_kernel(backend, scaling):
    """On CUDA `attend` hands SDPA and FlexAttention q (or q * g_i rounded once to bf16) and base_scale, the Triton
    kernel q, base_scale and the gains g_i, which they apply to the float32 dot products: the output and gradients
    are those of the path before (q' = q * g_i * base_scale rounded to bf16, scale 1) to bf16 rounding, one
    logit's rounding apart."""
    from lengthgen.attention import backends

    spec = AttentionSpec(query_scaling=scaling)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    got = attend(q, k, v, spec, backend=backend)
    want = backends.attention(backend, q.device)(fn.scale_queries(q, spec, 256), k, v, spec)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_alibi_slopes():
    torch.testing.assert_close(mods.alibi_slopes(8, dtype=torch.float64),
                               torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=torch.float64), **F64)
    torch.testing.assert_close(mods.alibi_slopes(4, dtype=torch.float64),
                               torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(4)], dtype=torch.float64), **F64)
    # not a power of two (Press et al.'s get_slopes): the slopes for 4 heads, then every other one of 8 heads'
    want6 = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    torch.testing.assert_close(mods.alibi_slopes(6, dtype=torch.float64), torch.tensor(want6, dtype=torch.float64),
                               **F64)
    # 12 heads: the 8-head slopes 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the 16-head ones
    want12 = [2 ** -(i + 1) for i in range(8)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    torch.testing.assert_close(mods.alibi_slopes(12, dtype=torch.float64),
                               torch.tensor(want12, dtype=torch.float64), **F64)
    assert mods.alibi_slopes(1).tolist() == [2 ** -8]


def test_rope_frequencies_and_fraction():
    full = fn.rope_frequencies(16, 10000.0, 1.0)
    torch.testing.assert_close(full, torch.tensor([10000.0 ** (-i / 8) for i in range(8)]))
    half = fn.rope_frequencies(16, 10000.0, 0.5)
    torch.testing.assert_close(half[:4], full[:4])          # the highest frequencies are kept
    assert (half[4:] == 0).all()
    assert (fn.rope_frequencies(16, 10000.0, 0.0) == 0).all()
    # Gemma's count, int(fraction * head_dim // 2), rounds down: 7.5 of 10 pairs rotate 7, not 8
    assert [int((fn.rope_frequencies(20, 10000.0, f) > 0).sum()) for f in (0.75, 0.25, 0.1, 0.95)] == [7, 2, 1, 9]


def test_prope_fraction_0_is_nope_and_1_is_rope():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32, dtype=torch.float64)

    def output(**changes):
        torch.manual_seed(1)                                   # same weights for every variant
        return Attention(32, 4, AttentionSpec(**changes), backend="dense").double()(x)

    nope, rope = output(position="nope"), output(position="rope")
    torch.testing.assert_close(output(position="prope", prope_fraction=0.0), nope, **F64)
    torch.testing.assert_close(output(position="prope", prope_fraction=1.0), rope, **F64)
    half = output(position="prope", prope_fraction=0.5)
    assert (half - nope).abs().max() > 1e-4 and (half - rope).abs().max() > 1e-4
    assert (rope - nope).abs().max() > 1e-4


@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_rope_logit_depends_only_on_relative_position(fraction):
    d = 16
    freqs = fn.rope_frequencies(d, 10000.0, fraction)
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64), torch.randn(1, 1, 1, d, dtype=torch.float64)

    def score(i, j):
        qi = fn.apply_rope(q, torch.tensor([i]), freqs)
        kj = fn.apply_rope(k, torch.tensor([j]), freqs)
        return (qi * kj).sum().item()

    for i, j in [(5, 2), (9, 9), (40, 3)]:
        for shift in (1, 17, 100):
            assert score(i + shift, j + shift) == pytest.approx(score(i, j), rel=1e-4, abs=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3               # and it does depend on i - j
    # rotation preserves norms
    rotated = fn.apply_rope(q.expand(1, 1, 7, d), torch.arange(7), freqs)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 7))
