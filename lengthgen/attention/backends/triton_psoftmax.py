"""`triton`: one fused causal flash-style Triton kernel for p-softmax attention (seed 001), forward and backward:
FlashAttention-2's tiling (Dao 2023) with p-softmax's running sums.

For queries q (B, H, Lq, D) and keys/values (B, Hkv, Lk, D) (GQA: H a multiple of Hkv; queries are the last Lq of
Lk positions) with ``l_ij = a_t c (q'_i . k_j) + bias_t``, q'_i = g_i q_i, t = i - j, c the ``scale`` of the dot
products (`attend` gives ``base_scale``), g_i the optional ``gain`` of each query row (`attend` gives the query
gains of `functional.row_gains`; else 1), and masks causal, same document, ``i - j < W``::

    forward  (per query block, over visible key blocks; running max m of l)
        S_p   <- S_p exp(p (m_old - m)) + sum_j exp(p (l_j - m))
        acc   <- acc exp(m_old - m)     + sum_j exp(l_j - m) v_j
        S_1   <- S_1 exp(m_old - m)     + sum_j exp(l_j - m)            (p != 1; S_1 = S_p for p = 1)
        out    = acc S_p^(-1/p)            LSE_p = p m + log S_p      LSE_1 = m + log S_1
        (m and log S_p are saved apart for the backward: no large logit is ever multiplied by p)

    backward (w_j = exp((l_j - m) - log S_p / p), pi_j = exp(p (l_j - m) - log S_p) = softmax(p l)_j,
              delta_i = dO_i . out_i)
        w_j = exp(l_j) Z_p^(-1/p)  =>  dw_j/dl_k = delta_jk w_j - w_j pi_k
        dl_ij = w_ij (dO_i . v_j) - pi_ij delta_i          dS_ij = a_t dl_ij
        dq = c g dS k    dk = c dS^T q'    dv = w^T dO    dg_i = c q_i . (dS k)_i   (q' = g q)

The kernels hold the logits in log2 units, z = l log2(e) (c g_i log2(e) multiplies the dot products, the distance
terms' coefficients carry the log2(e)), so that every exponential is one ``exp2`` of a difference, c and g cost
nothing (as FlashAttention's ``softmax_scale * log2(e)``; g is a per-row column of it, so the queries take no
scaling pass), and m and log S_p are saved in log2 units.
p is a runtime argument; a compile-time case (`p_kind`) takes one exponential per score for p = 1 and p = 2
(``exp(2 x) = exp(x)^2`` in the forward, ``pi = w^2`` in the backward) and two for any other p. Inputs fp16 / bf16
(fp32 too, as IEEE fp32 dots), fp32 accumulation, head dims up to 128 (query/key and value dims are padded with
zeros to powers of two >= 16, which changes no dot product; 64 and 128 need no padding). Documents come as
per-position run starts (a query sees keys from its document's start on) and run ends (the backward's
key-block-major pass stops at the document's end), from `mods.document_bounds`; the sliding window and every
distance term (scale_invariant, ALiBi with the slopes of `mods.alibi_slopes` passed in, log_bias) are written
inline (Triton cannot call the Python mods of `lengthgen.attention.mods`; the tests hold the kernel to them
through the dense oracle). Explicit masks are not taken. Backward: one kernel for dK/dV per key block
(looping over the query heads of its KV group, so GQA needs no atomics) and, launched first, one for dQ per
query block, which also computes delta (FlashAttention's preprocess, before: eager float32 ops over out and dO);
both recompute the logits and use the saved m and log S_p. With causal masks only, the tiles that every query row
sees whole (below the diagonal band) skip the mask and its bounds checks, as the Triton tutorial's fused attention
splits its causal loop (`_whole_before`, and the dK/dV kernel's ``q_mid``); the band and the edges are masked.

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (set before this module is imported), for tests.
"""

from __future__ import annotations

import math
import os

import torch

from lengthgen.attention import mods
from lengthgen.attention.spec import AttentionSpec

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as err:  # pragma: no cover - triton is optional
    triton = None
    _IMPORT_ERROR = err
else:
    _IMPORT_ERROR = None

MAX_HEAD_DIM = 128        # larger tiles do not fit shared memory with these block sizes
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DISTANCE_CODES = {"none": 0, "scale_invariant": 1, "alibi": 2, "log_bias": 3}
INTERPRET_BLOCK = 16      # block size under TRITON_INTERPRET=1


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


#: whether the kernels below were built for the interpreter (TRITON_INTERPRET=1 when this module was imported)
INTERPRETED = triton is not None and _interpret_env()


def unsupported(spec: AttentionSpec, q: torch.Tensor, training: bool, masked: bool = False) -> str | None:
    """Why this backend cannot run ``spec`` on ``q``, or None."""
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if masked:
        return "an explicit mask (the kernel masks causal, window and documents only)"
    if q.device.type == "cpu":
        if not (_interpret_env() and INTERPRETED):
            return "Triton kernels need CUDA (CPU tensors only under TRITON_INTERPRET=1 set before import)"
    elif q.device.type != "cuda":
        return f"Triton kernels run on cuda, not {q.device.type}"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (supported: float16, bfloat16, float32)"
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return "bfloat16 under the Triton interpreter (its tl.dot mishandles bfloat16; use float32 or float16)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim={q.shape[-1]} (the kernels take head_dim <= {MAX_HEAD_DIM})"
    if spec.distance not in DISTANCE_CODES:
        return f"distance={spec.distance!r} has no Triton score term"
    return None


# ---------------------------------------------------------------------------------------------------
# kernels

if triton is not None:
    # compiled kernels read only constexpr globals (the interpreter takes any)
    LOG2E = tl.constexpr(1.4426950408889634)
    LN2 = tl.constexpr(0.6931471805599453)
    FAST_LOG = tl.constexpr(not INTERPRETED)      # the interpreter has no libdevice

    @triton.jit
    def _slope(SLOPES, h, DIST: tl.constexpr):
        """ALiBi slope m_h of head h in log2 units, m_h log2(e) (0 for the other distance terms)."""
        slope = 0.0
        if DIST == 2:
            slope = tl.load(SLOPES + h) * LOG2E
        return slope

    @triton.jit
    def _logits(s, t, qk_scale, slope, tau_inv, lam, DIST: tl.constexpr):
        """(z, a_t) for dot products s and distances t (int, any sign; only t >= 0 is ever visible): the logits
        l = a_t c s + bias_t of the score mods `mods.scale_invariant`, `mods.alibi`, `mods.log_bias` (written
        inline) in log2 units, z = l log2(e), with ``qk_scale`` = c log2(e) and ``slope``, ``lam`` in log2 units.
        One return per compile-time branch: the compiler rejects a function whose reachable returns differ in
        type."""
        tf = tl.maximum(t, 0).to(tl.float32)
        if DIST == 0:
            return s * qk_scale, 1.0
        elif DIST == 1:                                 # scale_invariant: a_t c s - 2 log(1 + t / tau)
            log_t = _log(1.0 + tf * tau_inv)
            a = tl.sqrt(1.0 + 2.0 * log_t)
            return s * (a * qk_scale) - (2.0 * LOG2E) * log_t, a
        elif DIST == 2:                                 # ALiBi: -m_h t
            return s * qk_scale - slope * tf, 1.0
        else:                                           # log_bias: -lambda log(1 + t / tau)
            tl.static_assert(DIST == 3, "a DISTANCE_CODES code without its branch in _logits")
            return s * qk_scale - lam * _log(1.0 + tf * tau_inv), 1.0

    @triton.jit
    def _log(x):
        """ln x (x >= 1 here) with libdevice's ``fast_logf``: one hardware ``lg2.approx`` times ln 2 (absolute
        error about 2^-21.4 on [0.5, 2], relative about 2^-22 elsewhere: CUDA C Programming Guide, ``__logf``),
        where ``tl.log`` inlines libdevice's IEEE ``logf``, about 35 instructions per score (the sm_90 forward
        kernel had 1.7x the PTX of the plain kernel, now 1.1x: `tests/test_triton.py`). ``tl.log`` under the
        interpreter."""
        if FAST_LOG:
            return libdevice.fast_logf(x)
        else:
            return tl.log(x)

    @triton.jit
    def _gain(GAIN, offs, LIMIT, HAS_GAIN: tl.constexpr, MASKED: tl.constexpr):
        """The query gains g_i (`functional.row_gains`) of rows ``offs`` from ``GAIN`` (this head's rows) as an
        (M, 1) column (0 from ``LIMIT`` on where ``MASKED``), or 1 without ``HAS_GAIN``."""
        if HAS_GAIN:
            return _load_vec(GAIN, offs, LIMIT, MASKED)[:, None]
        else:
            return 1.0

    @triton.jit
    def _visible(pos_q, pos_k, start_q, LK, WINDOW, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
        """(M, N) mask for absolute query positions pos_q (M,), key positions pos_k (N,), run starts (M,):
        `mods.mask_mod_for` (causal & sliding_window & document) written inline."""
        t = pos_q[:, None] - pos_k[None, :]
        ok = (t >= 0) & (pos_k[None, :] < LK)
        if HAS_WINDOW:
            ok = ok & (t < WINDOW)
        if HAS_DOCS:
            ok = ok & (pos_k[None, :] >= start_q[:, None])
        return ok, t

    @triton.jit
    def _whole_before(first, lo, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
        """The end of the key blocks from ``lo`` on that every query of a block whose first position is ``first``
        sees whole (causal masks only: keys ``<= first``); those blocks skip the mask. With a window or documents
        every block is masked (returns ``lo``)."""
        if HAS_WINDOW or HAS_DOCS:
            return lo
        else:
            return tl.maximum((first + 1) // BLOCK_N * BLOCK_N, lo)

    @triton.jit
    def _scores(q, k, pos_q, offs_n, start_q, LK, WINDOW, qk_scale, slope, tau_inv, lam, DIST: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
        """(z, a_t) of query rows ``q`` against keys ``k`` (`_logits`): -inf where `_visible` hides a key
        (``MASKED``), or without the mask for a block every row sees whole."""
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            ok, t = _visible(pos_q, offs_n, start_q, LK, WINDOW, HAS_WINDOW, HAS_DOCS)
            logit, a = _logits(s, t, qk_scale, slope, tau_inv, lam, DIST)
            logit = tl.where(ok, logit, float("-inf"))
        else:
            logit, a = _logits(s, pos_q[:, None] - offs_n[None, :], qk_scale, slope, tau_inv, lam, DIST)
        return logit, a

    @triton.jit
    def _load_rows(ptr, offs, stride, cols, LIMIT, MASKED: tl.constexpr):
        """Rows ``offs`` (zeros from ``LIMIT`` on where ``MASKED``; a whole block needs no bound) of a
        row-major tile."""
        if MASKED:
            return tl.load(ptr + offs[:, None] * stride + cols[None, :], mask=(offs < LIMIT)[:, None], other=0.0)
        else:
            return tl.load(ptr + offs[:, None] * stride + cols[None, :])

    @triton.jit
    def _fwd_block(q, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, s_p, s_1, acc, skl, svl, LK, WINDOW, p, qk_scale,
                   slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N: tl.constexpr, DIST: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, P_KIND: tl.constexpr, PREC: tl.constexpr,
                   MASKED: tl.constexpr):
        """One key block of the forward: the running max m, S_p, S_1 and the output accumulator updated."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, offs_n, skl, offs_d, LK, MASKED)
        logit, _a = _scores(q, k, pos_q, offs_n, start_q, LK, WINDOW, qk_scale, slope, tau_inv, lam, DIST, HAS_WINDOW,
                            HAS_DOCS, PREC, MASKED)
        m_new = tl.maximum(m_i, tl.max(logit, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        e = tl.exp2(logit - m_safe[:, None])
        if P_KIND == 1:
            s_p = s_p * alpha + tl.sum(e, 1)
        else:
            s_1 = s_1 * alpha + tl.sum(e, 1)
            if P_KIND == 2:                              # exp(2 x) = exp(x)^2: no second exponential
                s_p = s_p * (alpha * alpha) + tl.sum(e * e, 1)
            else:
                s_p = s_p * tl.exp2(p * (m_i - m_safe)) + tl.sum(tl.exp2(p * (logit - m_safe[:, None])), 1)
        v = _load_rows(v_ptr, offs_n, svl, offs_dv, LK, MASKED)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=PREC)
        return m_new, s_p, s_1, acc

    @triton.jit
    def _fwd_kernel(Q, K, V, O, M, LSP, LSE1, STARTS, SLOPES, GAIN,
                    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, s_starts, sgb, sgh,
                    H, GROUPS, LQ, LK, OFF, WINDOW, p, inv_p, scale, tau_inv, lam,
                    D: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DIST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, P_KIND: tl.constexpr,
                    HAS_GAIN: tl.constexpr, PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUPS
        qk_scale, lam = scale * LOG2E, lam * LOG2E       # the logits in log2 units (`_logits`)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, D_V)
        row_ok = offs_m < LQ
        pos_q = offs_m + OFF
        q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        k_ptr = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_ptr = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        q = tl.load(q_ptr + offs_m[:, None] * sql + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        gain = _gain(GAIN + b.to(tl.int64) * sgb + h.to(tl.int64) * sgh, offs_m, LQ, HAS_GAIN, True)
        qk_scale = qk_scale * gain                       # c g_i log2(e): a scalar, or a column with gains
        slope = _slope(SLOPES, h, DIST)

        first = pid_m * BLOCK_M + OFF
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first - WINDOW + 1, 0)
        start_q = offs_m
        if HAS_DOCS:
            st_ptr = STARTS + b.to(tl.int64) * s_starts
            start_q = tl.load(st_ptr + pos_q, mask=row_ok, other=LK)
            lo = tl.maximum(lo, tl.load(st_ptr + first))   # run starts never decrease along a row
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.minimum(first + BLOCK_M, LK)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_p = tl.zeros([BLOCK_M], tl.float32)
        s_1 = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_V], tl.float32)
        mid = _whole_before(first, lo, BLOCK_N, HAS_WINDOW, HAS_DOCS)
        for start_n in range(lo, mid, BLOCK_N):
            m_i, s_p, s_1, acc = _fwd_block(q, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, s_p, s_1, acc, skl, svl,
                                            LK, WINDOW, p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N,
                                            DIST, HAS_WINDOW, HAS_DOCS, P_KIND, PREC, False)
        for start_n in range(mid, hi, BLOCK_N):
            m_i, s_p, s_1, acc = _fwd_block(q, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, s_p, s_1, acc, skl, svl,
                                            LK, WINDOW, p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N,
                                            DIST, HAS_WINDOW, HAS_DOCS, P_KIND, PREC, True)
        log2_sp = tl.log2(tl.where(row_ok, s_p, 1.0))    # padding rows: no log(0)
        out = acc * tl.exp2(-inv_p * log2_sp)[:, None]
        if P_KIND == 1:
            lse_1 = (m_i + log2_sp) * LN2
        else:
            lse_1 = (m_i + tl.log2(tl.where(row_ok, s_1, 1.0))) * LN2
        o_ptr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
        tl.store(o_ptr + offs_m[:, None] * sol + offs_dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(M + bh.to(tl.int64) * LQ + offs_m, m_i, mask=row_ok)
        tl.store(LSP + bh.to(tl.int64) * LQ + offs_m, log2_sp, mask=row_ok)
        tl.store(LSE1 + bh.to(tl.int64) * LQ + offs_m, lse_1, mask=row_ok)

    @triton.jit
    def _weights(logit, m_i, lsp, p, inv_p, P_KIND: tl.constexpr):
        """The backward's w = exp(l - m - log S_p / p) and pi = softmax(p l) = w^p of logits with the saved row max
        ``m_i`` and log S_p ``lsp`` (0 where a logit is -inf), all three in log2 units."""
        y = logit - m_i[:, None]
        w = tl.exp2(y - (lsp * inv_p)[:, None])
        if P_KIND == 1:
            pi = w
        elif P_KIND == 2:                                # exp(2 y - log S_2) = exp(y - log S_2 / 2)^2
            pi = w * w
        else:
            pi = tl.exp2(p * y - lsp[:, None])
        return w, pi

    @triton.jit
    def _dq_block(q, do, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, lsp, delta, dq, skl, svl, LK, WINDOW, p,
                  inv_p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N: tl.constexpr, DIST: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, P_KIND: tl.constexpr, PREC: tl.constexpr,
                  MASKED: tl.constexpr):
        """One key block of dQ: dq + dS k."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, offs_n, skl, offs_d, LK, MASKED)
        v = _load_rows(v_ptr, offs_n, svl, offs_dv, LK, MASKED)
        logit, a = _scores(q, k, pos_q, offs_n, start_q, LK, WINDOW, qk_scale, slope, tau_inv, lam, DIST, HAS_WINDOW,
                           HAS_DOCS, PREC, MASKED)
        w, pi = _weights(logit, m_i, lsp, p, inv_p, P_KIND)
        dpv = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = w * dpv - pi * delta[:, None]
        if DIST == 1:
            ds = ds * a
        return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, O, DO, DQ, M, LSP, DELTA, STARTS, SLOPES, GAIN, DGAIN,
                       sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, s_starts, sgb, sgh,
                       H, GROUPS, LQ, LK, OFF, WINDOW, p, inv_p, scale, tau_inv, lam,
                       D: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DIST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, P_KIND: tl.constexpr,
                       HAS_GAIN: tl.constexpr, GAIN_GRAD: tl.constexpr, PREC: tl.constexpr):
        """dQ for one query block, and first its rows' delta_i = dO_i . out_i, stored to DELTA for the dK/dV kernel
        (launched after this one); with ``GAIN_GRAD`` also the gains' gradient dg_i = q_i . (c dS k)_i, to DGAIN.
        O, DQ, DELTA and DGAIN are contiguous: (B, H, LQ, D_V), (B, H, LQ, D), (B, H, LQ), (B, H, LQ)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUPS
        qk_scale, lam = scale * LOG2E, lam * LOG2E       # the logits in log2 units (`_logits`)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, D_V)
        row_ok = offs_m < LQ
        pos_q = offs_m + OFF
        k_ptr = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_ptr = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sql + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdl + offs_dv[None, :],
                     mask=row_ok[:, None], other=0.0)
        m_i = tl.load(M + bh.to(tl.int64) * LQ + offs_m, mask=row_ok, other=0.0)
        lsp = tl.load(LSP + bh.to(tl.int64) * LQ + offs_m, mask=row_ok, other=0.0)
        o = tl.load(O + bh.to(tl.int64) * LQ * D_V + offs_m[:, None] * D_V + offs_dv[None, :], mask=row_ok[:, None],
                    other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh.to(tl.int64) * LQ + offs_m, delta, mask=row_ok)
        gain = _gain(GAIN + b.to(tl.int64) * sgb + h.to(tl.int64) * sgh, offs_m, LQ, HAS_GAIN, True)
        qk_scale = qk_scale * gain                       # c g_i log2(e): a scalar, or a column with gains
        slope = _slope(SLOPES, h, DIST)

        first = pid_m * BLOCK_M + OFF
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first - WINDOW + 1, 0)
        start_q = offs_m
        if HAS_DOCS:
            st_ptr = STARTS + b.to(tl.int64) * s_starts
            start_q = tl.load(st_ptr + pos_q, mask=row_ok, other=LK)
            lo = tl.maximum(lo, tl.load(st_ptr + first))
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.minimum(first + BLOCK_M, LK)

        dq = tl.zeros([BLOCK_M, D], tl.float32)
        mid = _whole_before(first, lo, BLOCK_N, HAS_WINDOW, HAS_DOCS)
        for start_n in range(lo, mid, BLOCK_N):
            dq = _dq_block(q, do, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, lsp, delta, dq, skl, svl, LK, WINDOW,
                           p, inv_p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N, DIST, HAS_WINDOW,
                           HAS_DOCS, P_KIND, PREC, False)
        for start_n in range(mid, hi, BLOCK_N):
            dq = _dq_block(q, do, k_ptr, v_ptr, start_n, pos_q, start_q, m_i, lsp, delta, dq, skl, svl, LK, WINDOW,
                           p, inv_p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_N, DIST, HAS_WINDOW,
                           HAS_DOCS, P_KIND, PREC, True)
        dq = dq * scale                                  # c dS k: the gradient of q' = g q
        if GAIN_GRAD:
            tl.store(DGAIN + bh.to(tl.int64) * LQ + offs_m, tl.sum(dq * q.to(tl.float32), 1), mask=row_ok)
        if HAS_GAIN:
            dq = dq * gain
        tl.store(DQ + bh.to(tl.int64) * LQ * D + offs_m[:, None] * D + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _load_vec(ptr, offs, LIMIT, MASKED: tl.constexpr):
        """``ptr[offs]`` (zeros from ``LIMIT`` on where ``MASKED``)."""
        if MASKED:
            return tl.load(ptr + offs, mask=offs < LIMIT, other=0.0)
        else:
            return tl.load(ptr + offs)

    @triton.jit
    def _dkdv_block(k, v, q_ptr, do_ptr, M, LSP, DELTA, GAIN, st_ptr, start_m, offs_n, dk, dv, sql, sdl, LQ, LK,
                    OFF, WINDOW, p, inv_p, qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_M: tl.constexpr,
                    DIST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, P_KIND: tl.constexpr,
                    HAS_GAIN: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
        """One query block of dK, dV (``M``, ``LSP``, ``DELTA``, ``GAIN``: this head's rows): dk + dS^T q' (q' = g q),
        dv + w^T dO. Masked, rows from LQ on are hidden too."""
        offs_m = start_m + tl.arange(0, BLOCK_M)
        pos_q = offs_m + OFF
        q = _load_rows(q_ptr, offs_m, sql, offs_d, LQ, MASKED)
        do = _load_rows(do_ptr, offs_m, sdl, offs_dv, LQ, MASKED)
        m_i = _load_vec(M, offs_m, LQ, MASKED)
        lsp = _load_vec(LSP, offs_m, LQ, MASKED)
        delta = _load_vec(DELTA, offs_m, LQ, MASKED)
        gain = _gain(GAIN, offs_m, LQ, HAS_GAIN, MASKED)
        start_q = offs_m
        if HAS_DOCS:
            start_q = tl.load(st_ptr + pos_q, mask=offs_m < LQ, other=LK)
        logit, a = _scores(q, k, pos_q, offs_n, start_q, LK, WINDOW, qk_scale * gain, slope, tau_inv, lam, DIST,
                           HAS_WINDOW, HAS_DOCS, PREC, MASKED)                             # (M, N)
        if MASKED:
            logit = tl.where((offs_m < LQ)[:, None], logit, float("-inf"))
        w, pi = _weights(logit, m_i, lsp, p, inv_p, P_KIND)
        dv += tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=PREC)
        dpv = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = w * dpv - pi * delta[:, None]
        if DIST == 1:
            ds = ds * a
        if HAS_GAIN:
            ds = ds * gain
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, M, LSP, DELTA, STARTS, ENDS, SLOPES, GAIN,
                         sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, s_starts, sgb, sgh,
                         H, HKV, GROUPS, LQ, LK, OFF, WINDOW, p, inv_p, scale, tau_inv, lam,
                         D: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DIST: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
                         P_KIND: tl.constexpr, HAS_GAIN: tl.constexpr, PREC: tl.constexpr):
        """dK, dV for one key block of one KV head, summed over the GROUPS query heads sharing it.
        Works transposed: (N keys, M queries) tiles. DK/DV are contiguous (B, HKV, LK, D / D_V)."""
        pid_n = tl.program_id(0)
        bhk = tl.program_id(1)
        b = bhk // HKV
        hk = bhk % HKV
        qk_scale, lam = scale * LOG2E, lam * LOG2E       # the logits in log2 units (`_logits`)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, D_V)
        col_ok = offs_n < LK
        k = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skl + offs_d[None, :],
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svl + offs_dv[None, :],
                    mask=col_ok[:, None], other=0.0)

        k_first = pid_n * BLOCK_N
        k_last = tl.minimum(k_first + BLOCK_N, LK) - 1
        q_hi = LK                                       # absolute positions of queries that may see the block
        if HAS_WINDOW:
            q_hi = tl.minimum(q_hi, k_last + WINDOW)
        st_ptr = STARTS + b.to(tl.int64) * s_starts
        if HAS_DOCS:
            q_hi = tl.minimum(q_hi, tl.load(ENDS + b.to(tl.int64) * s_starts + k_last))
        qi_lo = tl.maximum(k_first - OFF, 0)
        qi_hi = q_hi - OFF

        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D_V], tl.float32)
        # query blocks that see the whole key block (causal masks only, a key block without padding): rows from
        # the first whose position is >= the block's last key, through the last whole block of rows; the rest masked
        q_mid, q_full = qi_hi, qi_hi
        if not HAS_WINDOW and not HAS_DOCS:
            if k_first + BLOCK_N <= LK:
                q_mid = tl.minimum(qi_lo + (tl.maximum(k_last - OFF - qi_lo, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                                   qi_hi)
                q_full = q_mid + (qi_hi - q_mid) // BLOCK_M * BLOCK_M
        for g in range(0, GROUPS):
            h = hk * GROUPS + g
            bh = (b * H + h).to(tl.int64)
            q_ptr = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_ptr = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
            gain_ptr = GAIN + b.to(tl.int64) * sgb + h.to(tl.int64) * sgh
            slope = _slope(SLOPES, h, DIST)
            for start_m in range(qi_lo, q_mid, BLOCK_M):
                dk, dv = _dkdv_block(k, v, q_ptr, do_ptr, M + bh * LQ, LSP + bh * LQ, DELTA + bh * LQ, gain_ptr,
                                     st_ptr, start_m, offs_n, dk, dv, sql, sdl, LQ, LK, OFF, WINDOW, p, inv_p,
                                     qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_M, DIST, HAS_WINDOW,
                                     HAS_DOCS, P_KIND, HAS_GAIN, PREC, True)
            for start_m in range(q_mid, q_full, BLOCK_M):
                dk, dv = _dkdv_block(k, v, q_ptr, do_ptr, M + bh * LQ, LSP + bh * LQ, DELTA + bh * LQ, gain_ptr,
                                     st_ptr, start_m, offs_n, dk, dv, sql, sdl, LQ, LK, OFF, WINDOW, p, inv_p,
                                     qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_M, DIST, HAS_WINDOW,
                                     HAS_DOCS, P_KIND, HAS_GAIN, PREC, False)
            for start_m in range(q_full, qi_hi, BLOCK_M):
                dk, dv = _dkdv_block(k, v, q_ptr, do_ptr, M + bh * LQ, LSP + bh * LQ, DELTA + bh * LQ, gain_ptr,
                                     st_ptr, start_m, offs_n, dk, dv, sql, sdl, LQ, LK, OFF, WINDOW, p, inv_p,
                                     qk_scale, slope, tau_inv, lam, offs_d, offs_dv, BLOCK_M, DIST, HAS_WINDOW,
                                     HAS_DOCS, P_KIND, HAS_GAIN, PREC, True)
        tl.store(DK + bhk.to(tl.int64) * LK * D + offs_n[:, None] * D + offs_d[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + bhk.to(tl.int64) * LK * D_V + offs_n[:, None] * D_V + offs_dv[None, :],
                 dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


# ---------------------------------------------------------------------------------------------------
# launch configuration

def _configs(kind: str, head_dim: int, element_size: int = 2) -> dict:
    """Block sizes and launch options. Interpreter: 16 x 16. CUDA, 16-bit inputs: the fastest of
    `benchmarks/triton_configs.py`'s sweep on an H100 at L = 4096, p = 2 (benchmarks/results/*-triton-configs.json);
    float32 inputs keep FlashAttention-2-like 64-128 tiles with 2 stages, which fit their shared memory at D=128."""
    if INTERPRETED:
        return dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK)
    big = head_dim > 64
    if element_size > 2:
        if kind == "fwd":
            return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8 if big else 4, num_stages=2 if big else 3)
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8 if big else 4, num_stages=2)        # dq and dkdv
    if kind == "dkdv" and big:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def _padded_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    x = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


def _documents(doc_ids: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(run starts, run ends) as int32 (B, Lk) from `mods.document_bounds`, or 1-element dummies without
    documents."""
    if doc_ids is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy
    return tuple(x.to(device=device, dtype=torch.int32).contiguous() for x in mods.document_bounds(doc_ids))


def _slopes(spec: AttentionSpec, heads: int, device) -> torch.Tensor:
    """`mods.alibi_slopes` (float32) for ALiBi, else a 1-element dummy."""
    if spec.distance != "alibi":
        return torch.zeros(1, dtype=torch.float32, device=device)
    return mods.alibi_slopes(heads, device=device)


def p_kind(p: float) -> int:
    """The kernels' compile-time case of p: 1 (one exponential per score), 2 (the second is the first squared),
    0 (any other p: a second exponential)."""
    return 1 if p == 1.0 else 2 if p == 2.0 else 0


def _gains(gain: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(gains, batch stride, head stride) of the query gains g (B|1, H|1, Lq, 1) as float32 rows contiguous along
    Lq (stride 0 along a broadcast axis), or a 1-element dummy without gains."""
    if gain is None:
        return torch.zeros(1, dtype=torch.float32, device=q.device), 0, 0
    g = gain.detach().reshape(gain.shape[0], gain.shape[1], q.shape[2]).to(torch.float32).contiguous()
    return g, g.stride(0) if g.shape[0] > 1 else 0, g.stride(1) if g.shape[1] > 1 else 0


def _scalars(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_docs: bool,
             scale: float, has_gain: bool) -> dict:
    p = float(spec.softmax_p)
    return dict(H=q.shape[1], GROUPS=q.shape[1] // k.shape[1], LQ=q.shape[2], LK=k.shape[2],
                OFF=k.shape[2] - q.shape[2], WINDOW=spec.window or 0, p=p, inv_p=1.0 / p, scale=scale,
                tau_inv=1.0 / float(spec.tau), lam=float(spec.log_bias_lambda), D=q.shape[-1], D_V=v.shape[-1],
                DIST=DISTANCE_CODES[spec.distance], HAS_WINDOW=spec.window is not None, HAS_DOCS=has_docs,
                P_KIND=p_kind(p), HAS_GAIN=has_gain, PREC="ieee" if q.dtype == torch.float32 else "tf32")


def forward(q, k, v, spec: AttentionSpec, starts: torch.Tensor, slopes: torch.Tensor, has_docs: bool,
            scale: float = 1.0, gain: torch.Tensor | None = None):
    """Run the forward kernel on padded inputs (``scale``: the dot products' factor c; ``gain``: the query rows'
    factors g_i, (B|1, H|1, Lq, 1)). Returns (out (B, H, Lq, Dv) contiguous, LSE_1, row max m, log S_p), the last
    three (B, H, Lq) float32, m and log S_p in log2 units."""
    b, h, lq, _ = q.shape
    gains, sgb, sgh = _gains(gain, q)
    out = torch.empty((b, h, lq, v.shape[-1]), dtype=q.dtype, device=q.device)
    row_max = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    log_sp, lse_1 = torch.empty_like(row_max), torch.empty_like(row_max)
    cfg = _configs("fwd", max(q.shape[-1], v.shape[-1]), q.element_size())
    grid = (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](q, k, v, out, row_max, log_sp, lse_1, starts, slopes, gains, *q.stride()[:3], *k.stride()[:3],
                      *v.stride()[:3], *out.stride()[:3], starts.stride(0) if has_docs else 0, sgb, sgh,
                      **_scalars(spec, q, k, v, has_docs, scale, gain is not None), **cfg)
    return out, lse_1, row_max, log_sp


def backward(q, k, v, out, d_out, row_max, log_sp, spec: AttentionSpec, starts, ends, slopes, has_docs: bool,
             scale: float = 1.0, gain: torch.Tensor | None = None, gain_grad: bool = False):
    """dq, dk, dv (contiguous) from the saved forward tensors (row max m and log S_p), and with ``gain_grad`` the
    gains' gradient (B, H, Lq) float32 (else None)."""
    b, h, lq, d = q.shape
    gains, sgb, sgh = _gains(gain, q)
    d_gain = torch.empty_like(row_max) if gain_grad else gains
    hkv, lk = k.shape[1], k.shape[2]
    d_out = d_out if d_out.stride(-1) == 1 else d_out.contiguous()
    delta = torch.empty_like(row_max)             # dO_i . out_i (B, H, Lq), written by the dQ kernel
    dq = torch.empty((b, h, lq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, lk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, hkv, lk, v.shape[-1]), dtype=v.dtype, device=v.device)
    sc = _scalars(spec, q, k, v, has_docs, scale, gain is not None)
    s_starts = starts.stride(0) if has_docs else 0
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *d_out.stride()[:3], s_starts, sgb, sgh)
    cfg = _configs("dq", max(d, v.shape[-1]), q.element_size())
    _bwd_dq_kernel[(triton.cdiv(lq, cfg["BLOCK_M"]), b * h)](
        q, k, v, out, d_out, dq, row_max, log_sp, delta, starts, slopes, gains, d_gain, *strides,
        GAIN_GRAD=gain_grad, **sc, **cfg)
    cfg = _configs("dkdv", max(d, v.shape[-1]), q.element_size())
    _bwd_dkdv_kernel[(triton.cdiv(lk, cfg["BLOCK_N"]), b * hkv)](
        q, k, v, d_out, dk, dv, row_max, log_sp, delta, starts, ends, slopes, gains, *strides, HKV=hkv, **sc, **cfg)
    return dq, dk, dv, (d_gain if gain_grad else None)


class _TritonPSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gain, spec, starts, ends, slopes, has_docs, scale):
        out, lse_1, row_max, log_sp = forward(q, k, v, spec, starts, slopes, has_docs, scale, gain)
        ctx.save_for_backward(q, k, v, gain, out, row_max, log_sp, starts, ends, slopes)
        ctx.spec, ctx.has_docs, ctx.scale = spec, has_docs, scale
        lse_p = (spec.softmax_p * row_max + log_sp) * math.log(2)       # m, log S_p: log2 units
        ctx.mark_non_differentiable(lse_1, lse_p)
        return out, lse_1, lse_p

    @staticmethod
    def backward(ctx, d_out, _d_lse1, _d_lsep):
        q, k, v, gain, out, row_max, log_sp, starts, ends, slopes = ctx.saved_tensors
        gain_grad = ctx.needs_input_grad[3]
        dq, dk, dv, d_gain = backward(q, k, v, out, d_out, row_max, log_sp, ctx.spec, starts, ends, slopes,
                                      ctx.has_docs, ctx.scale, gain, gain_grad)
        if gain_grad:                               # summed over the axes the gains broadcast along
            d_gain = d_gain.sum_to_size(*gain.shape[:2], d_gain.shape[2]).reshape(gain.shape).to(gain.dtype)
        return dq, dk, dv, d_gain, None, None, None, None, None, None


def attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              doc_ids: torch.Tensor | None = None, *, mask: torch.Tensor | None = None, return_lse: bool = False,
              scale: float = 1.0, gain: torch.Tensor | None = None):
    """Fused p-softmax attention for scaled queries ``qs`` (B, H, Lq, D), keys/values (B, Hkv, Lk, D|Dv);
    ``scale`` multiplies the dot products in float32 (`attend` gives ``base_scale``: `backends.KERNEL_SCALE`), and
    ``gain`` (B|1, H|1, Lq, 1), differentiable, those of each query row (`attend` gives the query gains g_i of
    `functional.row_gains` and the raw queries: `backends.ROW_GAIN`). The kernel runs in the keys' dtype, or under
    autocast in its dtype (as autocast runs SDPA).

    Returns ``out`` or, with ``return_lse``, ``(out, LSE_1, LSE_p)`` (see `backends`).
    """
    if torch.amp.is_autocast_available(k.device.type) and torch.is_autocast_enabled(k.device.type):
        k = k.to(torch.get_autocast_dtype(k.device.type))   # as autocast runs SDPA: in its half precision (QK-norm
        #                                                     under autocast gives float32 q and k, bf16 v)
    reason = unsupported(spec, k, False, mask is not None)          # k: the kernel runs in the keys' dtype
    if reason is not None:
        raise ValueError(f"backend 'triton' cannot run this: {reason}")
    b, h, lq = qs.shape[:3]
    if gain is not None and (gain.dim() != 4 or gain.shape[0] not in (1, b) or gain.shape[1] not in (1, h)
                             or tuple(gain.shape[2:]) != (lq, 1)):
        raise ValueError(f"backend 'triton': gain must be (batch|1, heads|1, queries, 1) = ({b}|1, {h}|1, {lq}, 1), "
                         f"got {tuple(gain.shape)}")
    if v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"backend 'triton' takes value head_dim <= {MAX_HEAD_DIM}, got {v.shape[-1]}")
    dtype, dv = k.dtype, v.shape[-1]
    d_pad, dv_pad = _padded_dim(qs.shape[-1]), _padded_dim(dv)
    qs, k, v = _pad_last(qs.to(dtype), d_pad), _pad_last(k, d_pad), _pad_last(v.to(dtype), dv_pad)
    docs = doc_ids if spec.doc_masking else None
    starts, ends = _documents(docs, qs.device)
    slopes = _slopes(spec, qs.shape[1], qs.device)
    has_docs = docs is not None
    out, lse_1, lse_p = _TritonPSoftmax.apply(qs, k, v, gain, spec, starts, ends, slopes, has_docs, float(scale))
    out = out if dv == dv_pad else out[..., :dv]
    return (out, lse_1, lse_p) if return_lse else out


__all__ = ["attention", "unsupported", "forward", "backward", "INTERPRETED"]
