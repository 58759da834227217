"""The score and mask mods (`lengthgen.attention.mods`) against their formulas, the visibility helpers against
the mask mods, the explicit-mask path of `attend`, and the one meaning of ``return_lse`` across backends."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthgen.attention import AttentionSpec, attend, backends
from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.backends import cpu_flash, dense, flex, tiled
from lengthgen.attention.spec import Distance

F64 = dict(rtol=1e-10, atol=1e-10)
#: every distance term: a new choice of `AttentionSpec.distance` is held to the score-mod contract below untold
DISTANCES = [d for d in typing.get_args(Distance) if d != "none"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def runs_of(ids: list[int]) -> list[int]:
    """Run index of each position: documents are contiguous runs of equal ids."""
    run = [0]
    for a, b in zip(ids, ids[1:]):
        run.append(run[-1] + (a != b))
    return run


def random_docs(b: int, length: int, seed: int) -> torch.Tensor:
    """(b, length) ids in runs of random lengths; ids repeat between non-adjacent runs."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, length, generator=g) < 0.3).long().cumsum(-1) % 3


# ---------------------------------------------------------------------------------------------------
# mods = formulas


def test_mask_mods_are_their_formulas():
    i, j = torch.arange(12).view(-1, 1), torch.arange(12).view(1, -1)
    b = torch.zeros(1, 1, dtype=torch.long)
    assert torch.equal(mods.causal(b, 0, i, j), j <= i)
    assert torch.equal(mods.sliding_window(3)(b, 0, i, j), i - j < 3)
    ids = [4, 4, 4, 1, 1, 4, 4, 2, 2, 2, 2, 4]                   # id 4 in three separate runs
    run = runs_of(ids)
    starts, ends = mods.document_bounds(torch.tensor([ids]))
    assert starts[0].tolist() == [run.index(r) for r in run]
    assert ends[0].tolist() == [len(run) - run[::-1].index(r) for r in run]
    same_run = torch.tensor([[run[x] == run[y] for y in range(12)] for x in range(12)])
    visible = mods.and_masks(mods.causal, mods.document(starts))(b, 0, i, j)
    assert torch.equal(visible, same_run & (j <= i))
    explicit = torch.rand(1, 1, 5, 12, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(mods.explicit(explicit)(b, 0, i[-5:], j), explicit[0, 0])   # rows: the last 5 positions


def test_and_masks_is_named_for_logs():
    mod = mods.mask_mod_for(AttentionSpec(window=64, doc_masking=True), 8, 8, torch.zeros(1, 8, dtype=torch.long))
    assert mod.__name__ == "causal & sliding_window(64) & document"
    assert mods.mask_mod_for(AttentionSpec(), 8, 8).__name__ == "causal"
    assert mods.score_mod_for(AttentionSpec(distance="log_bias", tau=2.0), 4, 8, 8).__name__ == \
        "log_bias(lam=1, tau=2)"


def test_score_mods_are_their_formulas():
    i, j = torch.tensor([9, 9, 9, 4]), torch.tensor([9, 5, 0, 4])
    t = (i - j).double()
    s = randn(4, seed=1)
    h = torch.tensor([0, 1, 2, 1])
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    torch.testing.assert_close(mods.alibi(slopes)(s, 0, h, i, j), s - slopes[h] * t, **F64)
    torch.testing.assert_close(mods.log_bias(1.7, 3.0)(s, 0, h, i, j), s - 1.7 * torch.log(1 + t / 3.0), **F64)
    log_t = torch.log(1 + t / 4.0)
    torch.testing.assert_close(mods.scale_invariant(4.0)(s, 0, h, i, j), s * torch.sqrt(1 + 2 * log_t) - 2 * log_t,
                               **F64)


@pytest.mark.parametrize("distance", DISTANCES)
def test_score_mods_stay_finite_on_masked_pairs(distance):
    """Masked pairs (t < 0) are clamped to t = 0: finite logits and a finite (zero) gradient through the mask."""
    spec = AttentionSpec(distance=distance, tau=0.5, softmax_p=2.0)
    q, k, v = (randn(1, 2, 40, 4, seed=s).requires_grad_() for s in (1, 2, 3))
    out = attend(q, k, v, spec, backend="dense")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_builders_add_the_query_offset_once():
    """Row r of Lq queries is absolute position Lk - Lq + r: the built mods equal the absolute ones there."""
    spec = AttentionSpec(window=4, doc_masking=True, distance="alibi")
    docs = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2, 2]])
    starts = mods.document_starts(spec, docs)
    full = mods.dense_mask(mods.mask_mod_for(spec, 10, 10, starts), 1, 10, 10)
    last = mods.dense_mask(mods.mask_mod_for(spec, 3, 10, starts), 1, 3, 10)
    assert torch.equal(last, full[:, :, -3:])
    s = randn(1, 4, 3, 10, seed=4)
    b, h, q_idx, kv_idx = mods.grids(1, 4, torch.arange(3), torch.arange(10))
    rows = mods.score_mod_for(spec, 4, 3, 10, dtype=torch.float64)(s, b, h, q_idx, kv_idx)
    b, h, q_idx, kv_idx = mods.grids(1, 4, torch.arange(7, 10), torch.arange(10))
    absolute = mods.alibi(mods.alibi_slopes(4, dtype=torch.float64))(s, b, h, q_idx, kv_idx)
    torch.testing.assert_close(rows, absolute, **F64)


@pytest.mark.parametrize("distance", DISTANCES)
def test_affine_terms_are_the_mod_and_depend_on_distance_only(distance):
    """What tiled and cpu_flash rely on: each score mod is ``a_t s + bias_t`` (a_t None when it is 1; cpu_flash,
    which only adds, supports exactly those), and the terms depend on the head and on t = i - j only (blocks at the
    same distances share them)."""
    spec = AttentionSpec(distance=distance, tau=3.0, log_bias_lambda=0.7)
    score = mods.score_mod_for(spec, 4, 12, 12, dtype=torch.float64)
    a, bias = mods.affine_terms(score, 4, torch.arange(12), torch.arange(12), torch.float64)
    assert (a is None) == (cpu_flash.unsupported(spec, torch.empty(1), False) is None) and bias.shape[-2:] == (12, 12)
    s = randn(1, 4, 12, 12, seed=5) * 10
    grid = mods.grids(1, 4, torch.arange(12), torch.arange(12))
    torch.testing.assert_close(score(s, *grid), s * (1 if a is None else a) + bias, **F64)
    shifted = mods.affine_terms(score, 4, torch.arange(12) + 5, torch.arange(12) + 5, torch.float64)
    for x, y in zip((a, bias), shifted):
        assert (x is None and y is None) or torch.equal(x, y)
    a32, bias32 = mods.affine_terms(score, 4, torch.arange(12), torch.arange(12), torch.float32)
    assert bias32.dtype == torch.float32 and (a32 is None) == (a is None)     # rounded once, from float64


# ---------------------------------------------------------------------------------------------------
# one visibility: first_visible and n_i agree with the mask mods


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.one_of(st.none(), st.integers(1, 9)), doc=st.booleans(), lq=st.integers(1, 12),
       seed=st.integers(0, 1000))
def test_counts_and_first_visible_are_the_mask_row_sums(window, doc, lq, seed):
    spec = AttentionSpec(window=window, doc_masking=doc)
    docs = random_docs(2, 12, seed)
    starts = mods.document_starts(spec, docs)
    visible = mods.dense_mask(mods.mask_mod_for(spec, lq, 12, starts), 2, lq, 12)[:, 0]       # (B|1, Lq, Lk)
    n = mods.visible_counts(spec, lq, 12, docs)
    assert torch.equal(n.expand(2, lq), visible.sum(-1).float().expand(2, lq))
    first = mods.first_visible(spec, lq, 12, starts).expand(2, lq)
    i = torch.arange(12 - lq, 12)
    keys = torch.arange(12)
    interval = (keys >= first[..., None]) & (keys <= i[:, None])                              # [first_i, i]
    assert torch.equal(interval, visible.expand(2, lq, 12))
    # an explicit mask equal to the spec's own gives the same counts
    explicit = visible.expand(2, lq, 12)[:, None].clone()
    assert torch.equal(mods.visible_counts(spec, lq, 12, docs, mask=explicit), n.expand(2, lq))


# ---------------------------------------------------------------------------------------------------
# the explicit-mask path of attend


FULL = AttentionSpec(softmax_p=2.0, query_scaling="log_n", distance="alibi", base_scale=0.3)
MASKED_BACKENDS = ["dense", "tiled", "sdpa", "cpu_flash"]


def masked_spec(backend: str, spec: AttentionSpec, sdpa_spec: AttentionSpec) -> AttentionSpec:
    """``spec``, with p = 1 on cpu_flash (softmax only); ``sdpa_spec`` on sdpa (no distance terms either)."""
    if backend == "sdpa":
        return sdpa_spec
    return spec.replace(softmax_p=1.0) if backend == "cpu_flash" else spec


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L): causal and same contiguous run, written from the definition."""
    run = torch.tensor([runs_of(row) for row in doc_ids.tolist()])
    length = doc_ids.shape[1]
    return (torch.ones(length, length).tril().bool() & (run[:, :, None] == run[:, None, :]))[:, None]


@pytest.mark.parametrize("backend", MASKED_BACKENDS)
@pytest.mark.parametrize("window", [None, 2])
def test_explicit_mask_equals_documents(backend, window):
    """A mask that is a document layout gives what ``doc_ids`` give (n_i, window included), values and grads."""
    spec = masked_spec(backend, FULL.replace(window=window), AttentionSpec(query_scaling="log_n", window=window))
    q = randn(2, 4, 9, 8, seed=0).requires_grad_()
    k, v = randn(2, 2, 9, 8, seed=1).requires_grad_(), randn(2, 2, 9, 8, seed=2).requires_grad_()
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 2, 2]])
    mult = torch.tensor(0.7, dtype=torch.float64)
    want = attend(q, k, v, spec.replace(doc_masking=True), doc_ids=doc_ids, multipliers=mult, backend="dense")
    got = attend(q, k, v, spec, mask=document_mask(doc_ids), multipliers=mult, backend=backend)
    torch.testing.assert_close(got, want, **F64)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **F64)


def row_reference(q, k, v, spec, i, keys):
    """Query i (Lq = Lk) attending to ``keys`` only, from the formulas: n_i = len(keys), p-softmax."""
    n = torch.tensor([[float(len(keys))]], dtype=torch.float64)
    g = fn.query_gain(n, spec)                      # the default multiplier: one gain for every head
    g = 1.0 if g is None else float(g.flatten()[0])
    base = spec.base_scale if spec.base_scale is not None else 1 / math.sqrt(q.shape[-1])
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = []
    for h in range(heads):
        s = torch.stack([q[0, h, i] @ k[0, h // groups, j] for j in keys]) * base * g
        if spec.distance == "alibi":
            s = s - mods.alibi_slopes(heads, dtype=torch.float64)[h] * torch.tensor([i - j for j in keys]).double()
        w = torch.exp(s) / torch.exp(spec.softmax_p * s).sum() ** (1 / spec.softmax_p)
        out.append(sum(w[x] * v[0, h // groups, j] for x, j in enumerate(keys)))
    return torch.stack(out)


@pytest.mark.parametrize("backend", MASKED_BACKENDS)
def test_explicit_mask_rows_that_see_nothing_output_zero(backend):
    spec = masked_spec(backend, FULL, AttentionSpec(query_scaling="sqrt_log_n"))
    q, k, v = (randn(1, 2, 6, 4, seed=s).requires_grad_() for s in (3, 4, 5))
    mask = torch.ones(6, 6).tril().bool()[None, None].clone()
    mask[0, 0, 2] = False                                     # row 2 sees nothing
    mask[0, 0, 4, 1:3] = False                                # row 4 sees keys 0, 3, 4: n_4 = 3
    out = attend(q, k, v, spec, mask=mask, backend=backend)
    assert (out[0, :, 2] == 0).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads) and (grads[0][0, :, 2] == 0).all()
    torch.testing.assert_close(out[0, :, 4], row_reference(q.detach(), k.detach(), v.detach(), spec, 4, [0, 3, 4]),
                               **F64)


def test_explicit_mask_errors_and_backends():
    q = randn(2, 2, 5, 4)
    with pytest.raises(ValueError, match=r"mask must be a boolean \(batch, 1, queries, keys\) = \(2, 1, 5, 5\)"):
        attend(q, q, q, mask=torch.ones(2, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a boolean"):
        attend(q, q, q, mask=torch.ones(2, 1, 5, 5))
    for name in ("flex", "triton"):
        reason = backends.unsupported(name, AttentionSpec(), q, False, masked=True)
        assert reason is not None and ("mask" in reason or "triton" in reason), (name, reason)
    with pytest.raises(ValueError, match="explicit mask"):
        with torch.no_grad():
            attend(q.float(), q.float(), q.float(), mask=torch.ones(2, 1, 5, 5, dtype=torch.bool), backend="flex")
    for training in (True, False):
        for length in (16, 4096):
            name = backends.choose(AttentionSpec(softmax_p=2.0), q, length, training, masked=True)
            assert name in ("dense", "tiled")
        assert backends.choose(AttentionSpec(), q, 16, training, masked=True) == "sdpa"
        long = torch.empty(2, 2, 4096, 4)
        assert backends.choose(AttentionSpec(), long, 4096, training, masked=True) == "cpu_flash"


# ---------------------------------------------------------------------------------------------------
# return_lse: one shape and one meaning


def lse_case(spec: AttentionSpec, dtype: torch.dtype):
    """Scaled queries (B=2, H=4, Lq=7), grouped keys and values (2 heads, Lk=11), two documents per row, the
    float64 logits of the mods' reference and the dtype's tolerance."""
    q = randn(2, 4, 7, 16, seed=6).to(dtype).requires_grad_()
    k, v = randn(2, 2, 11, 16, seed=7).to(dtype), randn(2, 2, 11, 16, seed=8).to(dtype)
    docs = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 9])
    qs = fn.scale_queries(q, spec, 11, docs)
    visible = mods.mask_mod_for(spec, 7, 11, mods.document_starts(spec, docs))
    score = mods.score_mod_for(spec, 4, 7, 11, dtype=torch.float64)
    logit = fn.logits(qs.double(), fn.repeat_kv(k, 2).double(), score, visible, torch.arange(7), torch.arange(11))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    return qs, k, v, docs, logit, tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_return_lse_is_the_same_on_every_backend(dtype):
    """(out, LSE_1, LSE_p): (B, H, Lq) natural-log logsumexps of the logits and of p times them, no gradient."""
    spec = AttentionSpec(softmax_p=3.0, distance="scale_invariant", window=6, doc_masking=True)
    qs, k, v, docs, logit, tol = lse_case(spec, dtype)
    want_1, want_p = torch.logsumexp(logit, -1), torch.logsumexp(3.0 * logit, -1)
    runs = {"dense": dense.attention, "tiled": lambda *a, **kw: tiled.attention(*a, q_block=3, k_block=4, **kw)}
    if dtype == torch.float32:
        runs["flex"] = flex.attention
    for name, run in runs.items():
        with torch.set_grad_enabled(name != "flex"):
            out, lse_1, lse_p = run(qs, k, v, spec, docs, return_lse=True)
        assert lse_1.shape == lse_p.shape == (2, 4, 7) and lse_1.dtype == lse_p.dtype == dtype, name
        assert not lse_1.requires_grad and not lse_p.requires_grad and (out.requires_grad or name == "flex"), name
        torch.testing.assert_close(lse_1.double(), want_1, **tol, msg=name)
        torch.testing.assert_close(lse_p.double(), want_p, **tol, msg=name)
    # a row that sees nothing (explicit mask) has LSE -inf
    mask = torch.ones(2, 1, 7, 11, dtype=torch.bool)
    mask[1, 0, 3] = False
    for run in (dense.attention, tiled.attention):
        _, lse_1, lse_p = run(qs, k, v, spec, docs, mask=mask, return_lse=True)
        assert torch.isinf(lse_1[1, :, 3]).all() and torch.isinf(lse_p[1, :, 3]).all()
        assert torch.isfinite(lse_1[0]).all() and torch.isfinite(lse_p[1, :, :3]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_flash_return_lse(dtype):
    """cpu_flash (p = 1 only): LSE_1 = LSE_p = logsumexp of the logits, -inf for a row that sees nothing."""
    spec = AttentionSpec(distance="alibi", window=6, doc_masking=True)
    qs, k, v, docs, logit, tol = lse_case(spec, dtype)
    want = torch.logsumexp(logit, -1)
    out, lse_1, lse_p = cpu_flash.attention(qs, k, v, spec, docs, q_block=3, return_lse=True)
    assert lse_1.shape == (2, 4, 7) and lse_1.dtype == dtype and not lse_1.requires_grad and out.requires_grad
    torch.testing.assert_close(lse_1.double(), want, **tol)
    torch.testing.assert_close(lse_p, lse_1)
    mask = torch.ones(2, 1, 7, 11, dtype=torch.bool)
    mask[1, 0, 3] = False
    _, lse_1, lse_p = cpu_flash.attention(qs, k, v, spec, docs, mask=mask, q_block=3, return_lse=True)
    assert torch.isinf(lse_1[1, :, 3]).all() and torch.isinf(lse_p[1, :, 3]).all()
    assert torch.isfinite(lse_1[0]).all() and torch.isfinite(lse_1[1, :, :3]).all()


def test_additive_mask():
    visible = torch.tensor([[True, False, True]])
    assert torch.equal(mods.additive(visible, torch.float32), torch.tensor([[0.0, float("-inf"), 0.0]]))
    ones = visible.double()
    expected = torch.tensor([[0.0, float("-inf"), 0.0]], dtype=torch.float64)
    assert torch.equal(mods.additive(ones, torch.float64), expected)
    assert torch.equal(ones, visible.double())                                 # the 0 / 1 input is kept
