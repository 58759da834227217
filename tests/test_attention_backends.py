"""Backends against the dense oracle, and the oracle against an explicit-loop reference (issue "attention core").

`tiled` and `cpu_flash` run with small query/key blocks so that several blocks, windows crossing blocks and
documents crossing blocks are exercised; `sdpa` and `cpu_flash` run wherever they support the spec.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lengthgen.attention import AttentionSpec, attend
from lengthgen.attention import functional as fn
from lengthgen.attention import mods
from lengthgen.attention.backends import cpu_flash, sdpa, tiled
from lengthgen.attention.spec import Distance

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=1e-5, atol=1e-5)

# Every attention-core option of AttentionSpec on its own (module-level options are in test_attention_module.py).
OPTIONS = {
    "baseline": {},
    "p0.5": dict(softmax_p=0.5),
    "p2": dict(softmax_p=2.0),
    "p3": dict(softmax_p=3.0),
    "log_n": dict(query_scaling="log_n"),
    "log_n_s": dict(query_scaling="log_n", scaling_init=0.6),
    "log_bn": dict(query_scaling="log_bn", scaling_a=0.3, scaling_b=0.4, scaling_c=0.8, scaling_init=1.2),
    "sqrt_log_n": dict(query_scaling="sqrt_log_n"),
    "sqrt_log_n_abc": dict(query_scaling="sqrt_log_n", scaling_a=0.4, scaling_b=0.5, scaling_c=1.2, scaling_init=1.5),
    "scale_invariant": dict(distance="scale_invariant"),
    "scale_invariant_tau": dict(distance="scale_invariant", tau=2.0),
    "alibi": dict(distance="alibi"),
    "log_bias": dict(distance="log_bias"),
    "log_bias_lambda": dict(distance="log_bias", tau=3.0, log_bias_lambda=2.5),
    "window": dict(window=5),
    "window1": dict(window=1),
    "doc": dict(doc_masking=True),
    "base_scale": dict(base_scale=0.9),
}


def make_inputs(b=2, h=4, hkv=2, lq=13, lk=13, d=8, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def make_docs(b: int, length: int, seed: int = 0, max_len: int = 6) -> torch.Tensor:
    """(b, length) ids in contiguous runs of random lengths 1..max_len (ids not sorted, repeats allowed
    between non-adjacent runs: documents are runs, not id values)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], int(torch.randint(0, 3, (1,), generator=g))
        while len(ids) < length:
            run = int(torch.randint(1, max_len + 1, (1,), generator=g))
            ids += [doc] * run
            doc = (doc + 1 + int(torch.randint(0, 2, (1,), generator=g))) % 3
        rows.append(ids[:length])
    return torch.tensor(rows)


def run_tiled(q, k, v, spec, doc_ids=None, multipliers=None, q_block=4, k_block=3, **kw):
    qs = fn.scale_queries(q, spec, k.shape[-2], doc_ids, multipliers)
    return tiled.attention(qs, k, v, spec, doc_ids, q_block=q_block, k_block=k_block, **kw)


def run_cpu_flash(q, k, v, spec, doc_ids=None, q_block=4, **kw):
    qs = fn.scale_queries(q, spec, k.shape[-2], doc_ids, kw.get("multipliers"))
    return cpu_flash.attention(qs, k, v, spec, doc_ids, q_block=q_block)


def run_sdpa(q, k, v, spec, doc_ids=None):
    return sdpa.attention(fn.scale_queries(q, spec, k.shape[-2], doc_ids), k, v, spec, doc_ids)


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


def assert_like_dense(got, want, tol, inputs=None, want_grads=None):
    """``got`` close to the dense ``want``; with ``want_grads`` (float64), its gradients wrt ``inputs`` too."""
    torch.testing.assert_close(got, want, **tol)
    if want_grads is not None:
        for g_got, g_want in zip(grads(got, inputs), want_grads):
            torch.testing.assert_close(g_got, g_want, **F64)


def test_make_docs_has_several_documents_crossing_blocks():
    docs = make_docs(2, 13)
    start, _ = mods.document_bounds(docs)
    assert int((start == torch.arange(13)).sum(-1).max()) >= 3  # several documents per row
    assert (start % 4 != 0).any()                               # documents start inside query blocks of 4


# ---------------------------------------------------------------------------------------------------
# every option, tiled and sdpa vs dense


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_tiled_forward_matches_dense(name, dtype, tol):
    spec = AttentionSpec(**OPTIONS[name])
    q, k, v = make_inputs(dtype=dtype)
    docs = make_docs(2, 13)
    want = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    torch.testing.assert_close(run_tiled(q, k, v, spec, docs), want, **tol)
    # the public entry point with its default blocks too
    torch.testing.assert_close(attend(q, k, v, spec, doc_ids=docs, backend="tiled"), want, **tol)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_tiled_gradients_match_dense(name):
    spec = AttentionSpec(**OPTIONS[name])
    q, k, v = make_inputs(requires_grad=True)
    docs = make_docs(2, 13, seed=3)
    want = grads(attend(q, k, v, spec, doc_ids=docs, backend="dense"), (q, k, v))
    got = grads(run_tiled(q, k, v, spec, docs), (q, k, v))
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, **F64)


SDPA_OPTIONS = [n for n in OPTIONS if sdpa.unsupported(AttentionSpec(**OPTIONS[n])) is None]


def test_sdpa_support_is_what_it_claims():
    assert set(SDPA_OPTIONS) == {"baseline", "log_n", "log_n_s", "log_bn", "sqrt_log_n", "sqrt_log_n_abc", "window",
                                 "window1", "doc", "base_scale"}
    q, k, v = make_inputs()
    with pytest.raises(ValueError, match="softmax_p"):
        attend(q, k, v, AttentionSpec(softmax_p=2.0), backend="sdpa")
    with pytest.raises(ValueError, match="distance"):
        attend(q, k, v, AttentionSpec(distance="alibi"), backend="sdpa")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)], ids=["f64", "f32"])
@pytest.mark.parametrize("name", SDPA_OPTIONS)
def test_sdpa_matches_dense(name, dtype, tol):
    spec = AttentionSpec(**OPTIONS[name])
    q, k, v = make_inputs(dtype=dtype, requires_grad=dtype == torch.float64)
    docs = make_docs(2, 13, seed=5)
    want = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    gw = grads(want, (q, k, v)) if dtype == torch.float64 else None
    assert_like_dense(run_sdpa(q, k, v, spec, docs), want, tol, (q, k, v), gw)


CPU_FLASH_OPTIONS = [n for n in OPTIONS if cpu_flash.unsupported(AttentionSpec(**OPTIONS[n]), torch.empty(1), True)
                     is None]


def test_cpu_flash_support_is_what_it_claims():
    """p = 1 and distance terms that only add to the logits: the score mod's a_t is 1 (`mods.affine_terms`)."""
    def additive(spec):
        score = mods.score_mod_for(spec, 4, 9, 9, dtype=torch.float64)
        return score is None or mods.affine_terms(score, 4, torch.arange(9), torch.arange(9), torch.float64)[0] is None

    assert set(CPU_FLASH_OPTIONS) == {n for n in OPTIONS if (spec := AttentionSpec(**OPTIONS[n])).softmax_p == 1
                                      and additive(spec)}
    assert {"alibi", "log_bias", "log_bias_lambda"} <= set(CPU_FLASH_OPTIONS) - set(SDPA_OPTIONS)
    q, k, v = make_inputs()
    with pytest.raises(ValueError, match="softmax_p=2.0"):
        attend(q, k, v, AttentionSpec(softmax_p=2.0), backend="cpu_flash")
    with pytest.raises(ValueError, match="scale_invariant"):
        attend(q, k, v, AttentionSpec(distance="scale_invariant"), backend="cpu_flash")
    assert "CPU only" in cpu_flash.unsupported(AttentionSpec(), torch.empty(1, device="meta"), False)


def test_cpu_flash_refuses_a_score_mod_that_multiplies(monkeypatch):
    """A distance term that scales the score (a_t != 1) but that `cpu_flash.unsupported` does not name (a new
    mechanism) was run with its bias only, a_t dropped: plain softmax attention, silently. It is refused."""
    spec = AttentionSpec(distance="log_bias")           # supported by name; its mod replaced by a multiplying one
    assert cpu_flash.unsupported(spec, torch.empty(1), False) is None
    monkeypatch.setattr(mods, "score_mod_for", lambda *args, **kwargs: mods.scale_invariant(2.0))
    q, k, v = make_inputs()
    with pytest.raises(ValueError, match=r"cpu_flash' cannot run distance='log_bias': its score mod multiplies"):
        run_cpu_flash(q, k, v, spec)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)], ids=["f64", "f32"])
@pytest.mark.parametrize("name", CPU_FLASH_OPTIONS)
def test_cpu_flash_matches_dense(name, dtype, tol):
    """Values (float64 and float32) and float64 gradients, for query blocks of 4 and 5 rows and one block."""
    spec = AttentionSpec(**OPTIONS[name])
    q, k, v = make_inputs(dtype=dtype, requires_grad=dtype == torch.float64)
    docs = make_docs(2, 13, seed=6)
    want = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    gw = grads(want, (q, k, v)) if dtype == torch.float64 else None
    for q_block in (4, 5, 64):
        assert_like_dense(run_cpu_flash(q, k, v, spec, docs, q_block=q_block), want, tol, (q, k, v), gw)


@pytest.mark.parametrize("backend, spec", [
    (backend, spec) for backend in ("tiled", "sdpa", "cpu_flash", "flex")
    for spec in (AttentionSpec(), AttentionSpec(distance="alibi", window=5))
    if (backend, spec.distance) != ("sdpa", "alibi")     # sdpa has no score modifier
], ids=lambda x: x if isinstance(x, str) else x.distance)
def test_inputs_of_any_last_dimension_stride_match_dense(backend, spec):
    """cpu_flash called SDPA's CPU kernel directly, which reads each row's channels as contiguous: a q, k or v
    transposed in memory (stride(-1) != 1) gave outputs off by up to 24 and wrong gradients, and auto picks
    cpu_flash for ALiBi, windows or documents at length. Flex runs without gradients on CPU."""
    train = backend != "flex"
    q, k, v = make_inputs(lq=40, lk=40, requires_grad=train)
    strided = [t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(train) for t in (q, k, v)]
    assert all(t.stride(-1) != 1 for t in strided)
    want = attend(q, k, v, spec, backend="dense")
    got = attend(*strided, spec, backend=backend)
    torch.testing.assert_close(got, want, **F64)
    if train:
        for g_got, g_want in zip(grads(got, strided), grads(want, (q, k, v))):
            torch.testing.assert_close(g_got, g_want, **F64)


@pytest.mark.parametrize("args, kwargs, message", [
    ((torch.ones(1, 2, 4, 8, dtype=torch.long),) * 3, {}, "floating-point q, k, v, got torch.int64"),
    ((torch.ones(1, 2, 4, 0),) * 3, {}, r"no channels \(head_dim 0\), got q\(1, 2, 4, 0\)"),
    ((torch.ones(1, 2, 4, 8), torch.ones(1, 0, 4, 8), torch.ones(1, 0, 4, 8)), {},    # was a ZeroDivisionError
     r"^attend: 2 query heads are not a multiple of 0 key/value heads$"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"multipliers": torch.ones(3)}, r"one per query head \(2,\), got shape \(3,\)"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"multipliers": 2.0, "spec": "baseline"}, "query_scaling is 'none'"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"multipliers": [1.0, 2.0]}, r"one per query head \(2,\), got list"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"doc_ids": torch.tensor([[0.0, 0.0, 1.0, 1.0]]), "spec": {"doc_masking": True}},
     r"^attend: doc_ids must be integer document ids \(a long tensor\), got torch.float32$"),
    ((torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8, device="meta"), torch.ones(1, 2, 4, 8)), {},
     r"^attend: k is on meta but q on cpu; give every tensor on q's device$"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"doc_ids": torch.zeros(1, 4, dtype=torch.long, device="meta")},
     "doc_ids is on meta but q on cpu"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"mask": torch.ones(1, 1, 4, 4, dtype=torch.bool, device="meta")},
     "mask is on meta but q on cpu"),
    ((torch.ones(1, 2, 4, 8),) * 3, {"multipliers": torch.ones(2, device="meta")},
     "multipliers is on meta but q on cpu"),
])
def test_attend_refuses_inputs_it_cannot_compute(args, kwargs, message):
    """Integer inputs were truncated (p = 1) or failed inside torch (p = 2), a wrong-sized multiplier failed on a
    broadcast, and multipliers without query scaling were ignored. Float document ids were taken (NaN ids, or ids
    above 2^24 in float32, silently split or merged documents); a tensor on another device than q failed inside
    torch."""
    kwargs = {"spec": "sqrt_log_n", **kwargs}
    with pytest.raises(ValueError, match=message):
        attend(*args, kwargs.pop("spec"), **kwargs)


@pytest.mark.parametrize("backend", ["auto", "dense", "tiled", "sdpa", "cpu_flash"])
@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (1, 2, 0, 8), (1, 0, 5, 8)], ids=["no_sequences", "no_queries",
                                                                                   "no_heads"])
def test_empty_input_gives_an_empty_output(backend, shape):
    """No sequences or no queries crashed the process (SIGFPE in cpu_flash) or raised from inside a backend; no
    heads (none for keys and values either) was a ZeroDivisionError."""
    q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(shape[0], shape[1], 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = attend(q, k, v, "baseline", backend=backend)
    assert out.shape == (*shape[:3], 8)
    out.sum().backward()
    assert k.grad is not None and not k.grad.any()


# ---------------------------------------------------------------------------------------------------
# shapes: GQA, Lq < Lk, several documents, p values


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_gqa_and_p_values(hkv, p):
    spec = AttentionSpec(softmax_p=p, distance="alibi")       # alibi: a per-query-head term, sensitive to head order
    q, k, v = make_inputs(hkv=hkv, requires_grad=True)
    want = attend(q, k, v, spec, backend="dense")
    got = run_tiled(q, k, v, spec)
    assert_like_dense(got, want, F64, (q, k, v), grads(want, (q, k, v)))
    # GQA means query head h uses key/value head h // (H / Hkv): compare with explicitly expanded k, v
    groups = 4 // hkv
    expanded = attend(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), spec, backend="dense")
    torch.testing.assert_close(want, expanded, **F64)


@pytest.mark.parametrize("changes", [{}, dict(window=4, softmax_p=2.0), dict(doc_masking=True, query_scaling="log_n"),
                                     dict(distance="scale_invariant", query_scaling="sqrt_log_n", window=6),
                                     dict(distance="alibi", window=6, doc_masking=True)],
                         ids=["plain", "window_p2", "doc_log_n", "si_sqrt_window", "alibi_window_doc"])
def test_fewer_queries_are_the_last_positions(changes):
    """Lq < Lk (decoding with a cache) equals the last Lq rows of the full Lq == Lk attention."""
    spec = AttentionSpec(**changes)
    q, k, v = make_inputs(lq=13, lk=13, requires_grad=True)
    docs = make_docs(2, 13, seed=7)
    full = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    for lq in (1, 5):
        q_last = q[:, :, -lq:]
        want = attend(q_last, k, v, spec, doc_ids=docs, backend="dense")
        torch.testing.assert_close(want, full[:, :, -lq:], **F64)
        gw = grads(want, (q, k, v))
        assert_like_dense(run_tiled(q_last, k, v, spec, docs), want, F64, (q, k, v), gw)
        if sdpa.unsupported(spec) is None:
            torch.testing.assert_close(run_sdpa(q_last, k, v, spec, docs), want, **F64)
        if cpu_flash.unsupported(spec, q, True) is None:
            got = run_cpu_flash(q_last, k, v, spec, docs, q_block=2)
            assert_like_dense(got, want, F64, (q, k, v), gw)


def test_many_documents_and_blocks():
    """Long-ish input, many documents of varied lengths, window, blocks of several sizes."""
    spec = AttentionSpec(doc_masking=True, window=9, softmax_p=2.0, distance="log_bias", query_scaling="log_n")
    q, k, v = make_inputs(b=3, h=2, hkv=1, lq=70, lk=70, d=4, seed=11, requires_grad=True)
    docs = make_docs(3, 70, seed=12, max_len=20)
    want = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    gw = grads(want, (q, k, v))
    for qb, kb in [(1, 1), (7, 5), (16, 32), (70, 70)]:
        got = run_tiled(q, k, v, spec, docs, q_block=qb, k_block=kb)
        assert_like_dense(got, want, F64, (q, k, v), gw)


@pytest.mark.parametrize("changes", [{}, dict(window=7), dict(doc_masking=True), dict(doc_masking=True, window=5)],
                         ids=["causal", "window", "doc", "doc_window"])
@pytest.mark.parametrize("lq,q_block,k_block", [(30, 4, 3), (30, 5, 8), (12, 7, 7), (30, 16, 64)])
def test_plan_covers_each_visible_pair_once(changes, lq, q_block, k_block):
    """Every (row, key) pair the mask mods show lies in exactly one block; unmasked blocks show all their pairs;
    each band's grid columns are its keys' distances."""
    spec, lk = AttentionSpec(**changes), 30
    docs = make_docs(2, lk, seed=lq)
    starts = mods.document_starts(spec, docs)
    visible = mods.dense_mask(mods.mask_mod_for(spec, lq, lk, starts), 2, lq, lk)[:, 0]
    plan = tiled._plan(mods.first_visible(spec, lq, lk, starts), lq, lk, q_block, k_block, explicit=False)
    count = torch.zeros(lq, lk, dtype=torch.long)
    for n, band in plan:
        for blk in band:
            count[blk.rows, blk.keys] += 1
            if not blk.masked:
                assert visible[:, blk.rows, blk.keys].all(), (n, blk)
            rows, cols = blk.grid                     # distance of (row r, column c) is r - c - Q + nK
            r0, c0 = blk.rows.start, blk.keys.start
            assert (lk - lq + r0) - c0 == rows.start - cols.start - q_block + n * k_block
    assert (count <= 1).all() and (count[visible.any(0)] == 1).all()


def test_default_blocks_long_input_matches_dense():
    """Several default-size blocks and bands: p=2 with a window crossing blocks."""
    spec = AttentionSpec(softmax_p=2.0, window=1100, distance="alibi")
    q, k, v = make_inputs(b=1, h=1, hkv=1, lq=1300, lk=1300, d=4, seed=21, requires_grad=True)
    want = attend(q, k, v, spec, backend="dense")
    got = attend(q, k, v, spec, backend="tiled")
    assert_like_dense(got, want, F64, (q, k, v), grads(want, (q, k, v)))


# ---------------------------------------------------------------------------------------------------
# random combinations


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.sampled_from([0.5, 1.0, 2.0, 3.0]), scaling=st.sampled_from(["none", "log_n", "sqrt_log_n"]),
       distance=st.sampled_from(typing.get_args(Distance)),
       window=st.one_of(st.none(), st.integers(1, 12)), doc=st.booleans(), hkv=st.sampled_from([1, 2, 4]),
       lq=st.integers(1, 11), q_block=st.integers(1, 6), k_block=st.integers(1, 6), seed=st.integers(0, 1000))
def test_random_combinations(p, scaling, distance, window, doc, hkv, lq, q_block, k_block, seed):
    spec = AttentionSpec(softmax_p=p, query_scaling=scaling, distance=distance, window=window, doc_masking=doc)
    q, k, v = make_inputs(b=2, h=4, hkv=hkv, lq=lq, lk=11, d=4, seed=seed, requires_grad=True)
    docs = make_docs(2, 11, seed=seed)
    want = attend(q, k, v, spec, doc_ids=docs, backend="dense")
    gw = grads(want, (q, k, v))
    assert_like_dense(run_tiled(q, k, v, spec, docs, q_block=q_block, k_block=k_block), want, F64, (q, k, v), gw)
    if sdpa.unsupported(spec) is None:
        torch.testing.assert_close(run_sdpa(q, k, v, spec, docs), want, **F64)
    if cpu_flash.unsupported(spec, q, True) is None:
        got = run_cpu_flash(q, k, v, spec, docs, q_block=q_block)
        assert_like_dense(got, want, F64, (q, k, v), gw)


# ---------------------------------------------------------------------------------------------------
# gradcheck (float64, tiny shapes)

GRADCHECK = {
    "p1": dict(softmax_p=1.0),
    "p0.5_alibi_window": dict(softmax_p=0.5, distance="alibi", window=3),
    "p2_si_doc": dict(softmax_p=2.0, distance="scale_invariant", doc_masking=True),
    "p3_log_bias_log_n": dict(softmax_p=3.0, distance="log_bias", query_scaling="log_n", window=4),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_tiled_gradcheck(name):
    spec = AttentionSpec(**GRADCHECK[name])
    q, k, v = make_inputs(b=1, h=2, hkv=1, lq=6, lk=6, d=3, seed=2, requires_grad=True)
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert torch.autograd.gradcheck(lambda q, k, v: run_tiled(q, k, v, spec, docs, q_block=2, k_block=3),
                                    (q, k, v))


@pytest.mark.parametrize("changes", [{}, dict(distance="alibi", window=3), dict(distance="log_bias", doc_masking=True)],
                         ids=["plain", "alibi_window", "log_bias_doc"])
def test_cpu_flash_gradcheck(changes):
    spec = AttentionSpec(**changes)
    q, k, v = make_inputs(b=1, h=2, hkv=1, lq=6, lk=6, d=3, seed=2, requires_grad=True)
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert torch.autograd.gradcheck(lambda q, k, v: run_cpu_flash(q, k, v, spec, docs, q_block=4), (q, k, v))


@pytest.mark.parametrize("scaling", ["log_n", "log_bn", "sqrt_log_n"])
def test_gradcheck_multipliers_through_attend(scaling):
    spec = AttentionSpec(query_scaling=scaling, softmax_p=2.0, window=4, distance="alibi")
    q, k, v = make_inputs(b=1, h=2, hkv=1, lq=5, lk=6, d=3, seed=4, requires_grad=True)
    head_mult = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    global_mult = torch.tensor(1.1, dtype=torch.float64, requires_grad=True)
    for mult in (head_mult, global_mult):
        assert torch.autograd.gradcheck(
            lambda q, k, v, m: attend(q, k, v, spec, multipliers=m, backend="tiled"), (q, k, v, mult))
    # the multiplier gradient through tiled equals the oracle's, with small blocks too
    want = torch.autograd.grad(attend(q, k, v, spec, multipliers=head_mult, backend="dense").sum(), head_mult)[0]
    got = torch.autograd.grad(run_tiled(q, k, v, spec, multipliers=head_mult, q_block=2, k_block=2).sum(),
                              head_mult)[0]
    assert want.abs().min() > 1e-6
    torch.testing.assert_close(got, want, **F64)


# ---------------------------------------------------------------------------------------------------
# the oracle against an explicit-loop reference


def naive_attention(q, k, v, spec, doc_ids, multipliers):
    """Loops over (b, h, i, j) in plain Python floats, written from the design doc's formulas only."""
    b_sz, heads, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    base = spec.base_scale if spec.base_scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(b_sz, heads, lq, v.shape[-1], dtype=torch.float64)
    for b in range(b_sz):
        docs = [int(x) for x in doc_ids[b]]
        for h in range(heads):
            kh = h // (heads // hkv)
            mult = float(multipliers[h])
            slope = 2.0 ** (-8.0 * (h + 1) / heads)
            for qi in range(lq):
                i = lk - lq + qi                     # absolute position of the query
                visible = []
                for j in range(lk):
                    same_doc = all(docs[x] == docs[i] for x in range(j, i + 1)) if spec.doc_masking else True
                    inside = spec.window is None or i - j < spec.window
                    if j <= i and same_doc and inside:
                        visible.append(j)
                n = len(visible)
                if spec.query_scaling == "log_n":
                    g = mult * math.log(n)
                elif spec.query_scaling == "log_bn":
                    g = spec.scaling_a + mult * math.log(spec.scaling_b * n + spec.scaling_c)
                elif spec.query_scaling == "sqrt_log_n":
                    g = spec.scaling_a + mult * math.sqrt(2 * math.log(spec.scaling_b * n + spec.scaling_c))
                elif spec.query_scaling == "none":
                    g = 1.0
                else:
                    raise NotImplementedError(f"naive_attention has no formula for {spec.query_scaling=}")
                logit = {}
                for j in visible:
                    t = i - j
                    s = sum(float(q[b, h, qi, c]) * float(k[b, kh, j, c]) for c in range(d)) * base
                    a, bias = 1.0, 0.0
                    if spec.distance == "scale_invariant":
                        a = math.sqrt(1 + 2 * math.log(1 + t / spec.tau))
                        bias = -2 * math.log(1 + t / spec.tau)
                    elif spec.distance == "alibi":
                        bias = -slope * t
                    elif spec.distance == "log_bias":
                        bias = -spec.log_bias_lambda * math.log(1 + t / spec.tau)
                    elif spec.distance != "none":
                        raise NotImplementedError(f"naive_attention has no formula for distance={spec.distance!r}")
                    logit[j] = g * a * s + bias
                p = spec.softmax_p
                norm = sum(math.exp(p * x) for x in logit.values()) ** (1 / p)
                for j, x in logit.items():
                    out[b, h, qi] += math.exp(x) / norm * v[b, kh, j]
    return out


@pytest.mark.parametrize("distance", [d for d in typing.get_args(Distance) if d != "none"])
@pytest.mark.parametrize("scaling,p", [("log_n", 2.0), ("log_bn", 1.0), ("sqrt_log_n", 3.0), ("sqrt_log_n", 0.5)])
def test_dense_oracle_matches_explicit_loops(distance, scaling, p):
    spec = AttentionSpec(softmax_p=p, query_scaling=scaling, distance=distance, window=4, doc_masking=True,
                         tau=2.5, log_bias_lambda=1.7, scaling_a=0.2, base_scale=0.8)
    q, k, v = make_inputs(b=2, h=4, hkv=2, lq=6, lk=8, d=3, seed=9)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 3, 3, 3, 3, 2, 2]])   # second row: id 2 twice, 3 runs
    mult = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    want = naive_attention(q, k, v, spec, docs, mult)
    torch.testing.assert_close(attend(q, k, v, spec, doc_ids=docs, multipliers=mult, backend="dense"), want, **F64)
    torch.testing.assert_close(attend(q, k, v, spec, doc_ids=docs, multipliers=mult, backend="tiled"), want, **F64)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_dense_oracle_matches_explicit_loops_for_every_option(name):
    """Each option alone, with the default multiplier (scaling_init): the combinations above always set a query
    scaling, a distance term, a window and documents, so that no query_scaling or distance 'none', window or
    documents alone, or log_bn's b and c, ran against the loops. OPTIONS uses every choice of the spec
    (test_attention_matrix.test_the_options_use_every_choice), and the loops raise for one they have no formula for."""
    spec = AttentionSpec(**OPTIONS[name])
    q, k, v = make_inputs(b=2, h=4, hkv=2, lq=6, lk=8, d=3, seed=10)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 3, 3, 3, 3, 2, 2]])
    want = naive_attention(q, k, v, spec, docs, torch.full((4,), spec.scaling_init, dtype=torch.float64))
    torch.testing.assert_close(attend(q, k, v, spec, doc_ids=docs, backend="dense"), want, **F64)


def test_explicit_loops_reference_is_sensitive():
    """The reference itself distinguishes the mechanisms it is used to check (not a constant function)."""
    q, k, v = make_inputs(b=1, h=4, hkv=2, lq=6, lk=8, d=3, seed=9)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    mult = torch.ones(4, dtype=torch.float64)
    outs = [naive_attention(q, k, v, AttentionSpec(**c), docs, mult) for c in
            ({}, dict(window=3), dict(doc_masking=True), dict(distance="alibi"), dict(softmax_p=2.0))]
    for i in range(len(outs)):
        for j in range(i):
            assert (outs[i] - outs[j]).abs().max() > 1e-3
