"""The `triton` backend (fused p-softmax kernels) against the dense oracle.

CPU: the kernels run under the Triton interpreter at tiny shapes. ``TRITON_INTERPRET=1`` must be set before
triton builds the kernels, so each group of cases runs in a subprocess (this file run as a script): nothing
leaks into other test modules sharing the pytest(-xdist) worker. Every kernel is also compiled ahead of time
for sm_80 and sm_90 (CPU; triton ships ptxas; `benchmarks/triton_code.py`). CUDA (skipped without it):
forward and backward in float32 and bfloat16 at head dims 64 and 128.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_docs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))                  # triton_code: the kernels compiled for CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def distance_for(p: float, regime: str) -> str:
    """As test_numerics.spec_for: none for p = 1, scale_invariant on spread logits, ALiBi on offset ones."""
    return "none" if p == 1 else ("scale_invariant" if regime == "spread" else "alibi")


# name -> case: spec fields, shapes (b, h, hkv, lq, lk, d, dv), dtype, documents?, logits (regime, size)?, the
# kernel's scale of the dot products (q is divided by it, so that the logits keep their size)? query gains
# g_i (`gain`: one per row, per head and row, or per batch and row; differentiable, checked as ``dgain``)?
# tolerances are on max |error| / max(|reference|, 1) for out, dq, dk, dv (with large logits, the gradients'
# errors are over the size of the terms they sum, as in test_numerics.py)
INTERPRETER_GROUPS: dict[str, dict[str, dict]] = {
    "p_values": {
        f"{kind}_p{p}": dict(spec=dict(softmax_p=p, doc_masking=docs), shape=shape, docs=docs)
        for p in (1.0, 2.0, 0.5)
        for kind, docs, shape in (("plain", False, (1, 2, 2, 48, 48, 16, 16)),
                                  ("docs_gqa", True, (1, 4, 2, 64, 64, 16, 16)))
    },
    "terms": {
        "scale_invariant_window_p2": dict(spec=dict(distance="scale_invariant", tau=4.0, window=9, softmax_p=2.0),
                                          shape=(1, 2, 2, 40, 40, 16, 16), scale=0.25),
        "alibi_gqa_p2": dict(spec=dict(distance="alibi", softmax_p=2.0), shape=(1, 4, 1, 33, 33, 16, 16),
                             scale=0.125),
        "log_bias_docs_window_p1.5": dict(spec=dict(distance="log_bias", log_bias_lambda=0.8, tau=3.0, softmax_p=1.5,
                                                    doc_masking=True, window=20), shape=(2, 2, 2, 40, 40, 16, 16),
                                          docs=True, scale=0.3),
        "window_p1": dict(spec=dict(window=5), shape=(1, 2, 2, 37, 37, 16, 16)),
        "alibi_6_heads_p2": dict(spec=dict(distance="alibi", softmax_p=2.0), shape=(1, 6, 3, 24, 24, 16, 16)),
        "gain_rows_alibi_gqa_p2": dict(spec=dict(distance="alibi", softmax_p=2.0), shape=(1, 4, 2, 40, 40, 16, 16),
                                       gain="rows", scale=0.25),
        "gain_heads_scale_invariant_window_p1": dict(spec=dict(distance="scale_invariant", window=11),
                                                     shape=(1, 2, 1, 36, 36, 16, 16), gain="heads"),
        # through attend, which gives the kernel the query gains and the raw queries: learned per-head multipliers
        "attend_sqrt_log_n_heads_docs_p2": dict(spec=dict(query_scaling="sqrt_log_n", softmax_p=2.0, doc_masking=True),
                                                shape=(2, 4, 2, 40, 40, 16, 16), docs=True, attend="heads"),
        "attend_ssmax_window_fewer_queries": dict(spec=dict(query_scaling="log_n", window=9),
                                                  shape=(1, 2, 2, 20, 36, 16, 16), attend="default"),
        # the other query-scaling options (a != 0, log_bn), a global multiplier, a base_scale, p = 3
        "attend_log_bn_global_base_scale_p3": dict(spec=dict(query_scaling="log_bn", scaling_a=0.3, scaling_b=0.4,
                                                             scaling_c=0.8, base_scale=0.2, softmax_p=3.0),
                                                   shape=(1, 2, 1, 24, 24, 16, 16), attend="global"),
        "attend_sqrt_log_n_abc_window3_alibi": dict(spec=dict(query_scaling="sqrt_log_n", scaling_a=0.4, scaling_b=0.5,
                                                              scaling_c=1.2, scaling_init=1.5, window=3,
                                                              distance="alibi"),
                                                    shape=(1, 2, 2, 20, 20, 16, 16), attend="default"),
        "window1_p2": dict(spec=dict(window=1, softmax_p=2.0), shape=(1, 2, 1, 17, 17, 16, 16)),   # out = v
        "attend_log_n_s_scale_invariant_tau_docs": dict(spec=dict(query_scaling="log_n", scaling_init=0.6, tau=2.0,
                                                                  distance="scale_invariant", doc_masking=True),
                                                        shape=(2, 2, 1, 24, 24, 16, 16), docs=True, attend="heads"),
    },
    "shapes": {
        "fewer_queries_docs_p2": dict(spec=dict(softmax_p=2.0, doc_masking=True), shape=(1, 2, 1, 24, 50, 16, 16),
                                      docs=True, scale=0.5),
        "decode_one_p0.5": dict(spec=dict(softmax_p=0.5, window=17), shape=(1, 2, 2, 1, 40, 16, 16)),
        "padded_dims_8_4": dict(spec=dict(softmax_p=2.0), shape=(1, 2, 1, 20, 20, 8, 4)),
        # float32 inputs under float16 autocast (QK-norm's q and k are float32 there): the kernel runs in float16
        "autocast_fp16_p2_gains": dict(spec=dict(softmax_p=2.0), shape=(1, 2, 2, 24, 24, 16, 16), autocast="float16",
                                       gain="heads"),
        "gain_batch_fewer_queries_docs_fp16_p0.5": dict(spec=dict(softmax_p=0.5, doc_masking=True), docs=True,
                                                        shape=(2, 2, 2, 20, 44, 16, 16), dtype="float16",
                                                        gain="batch", scale=0.5),
        "fp16_docs_p2": dict(spec=dict(softmax_p=2.0, doc_masking=True), shape=(1, 2, 2, 32, 32, 16, 16),
                             docs=True, dtype="float16", scale=0.25),
        # the other distance terms and the window in half precision (bfloat16 runs on CUDA only: see unsupported)
        "fp16_scale_invariant_window_p3": dict(spec=dict(distance="scale_invariant", tau=2.0, window=7, softmax_p=3.0),
                                               shape=(1, 2, 1, 24, 24, 16, 16), dtype="float16", scale=0.5),
        "fp16_log_bias_window_p1": dict(spec=dict(distance="log_bias", tau=3.0, log_bias_lambda=2.5, window=9),
                                        shape=(1, 2, 2, 24, 24, 16, 16), dtype="float16"),
        "strided_layout_p1": dict(spec=dict(), shape=(1, 2, 2, 32, 32, 32, 32), strided=True),
        # logits up to 1e4 (see test_numerics.py): each p once, float32 and float16, both regimes
        **{f"{regime}_1e4_p{p}_{dtype}": dict(spec=dict(softmax_p=p, distance=distance_for(p, regime)),
                                             shape=(1, 2, 1, 32, 32, 16, 16), logits=(regime, 1e4), dtype=dtype)
           for p, regime, dtype in ((0.1, "spread", "float32"), (0.5, "offset", "float16"),
                                    (1.0, "spread", "float16"), (2.0, "offset", "float32"),
                                    (8.0, "spread", "float32"), (100.0, "offset", "float16"))},
    },
}
#: measured at most 2.6e-6 (float32: 22 float32 epsilons, dmult) and 2.2e-3 (float16: 2.2 epsilons, dgain under
#: autocast) over every case; the former 1e-4 and 2e-2 were 40 and 9 times that
TOL = {"float32": 1e-5, "float16": 5e-3}


def tolerance(case: dict, name: str) -> float:
    """TOL, or for large logits the dtype's epsilon plus float32's times the logit size (test_numerics.py); for
    dq and dk times p too: they go through pi = softmax(p l), whose relative error is p times the logits' error.
    Under the interpreter tl.dot is NumPy's float32 matmul (OpenBLAS), whose logits of 1e4 are off by up to
    3.4e-3 with its AVX-512 kernels and 2.5e-3 with its AVX2 ones: at p = 100, dk was off by 2.5e-2 and 2.7e-3."""
    dtype = case.get("autocast") or case.get("dtype", "float32")
    if "logits" not in case:
        return TOL[dtype]
    p = case["spec"].get("softmax_p", 1.0) if name in ("dq", "dk") else 1.0
    return torch.finfo(getattr(torch, dtype)).eps + 4 * torch.finfo(torch.float32).eps * case["logits"][1] * max(1, p)


def compare(case: dict, device: str = "cpu", dtype: str | None = None, seed: int = 0) -> dict[str, float]:
    """Relative max errors of the triton backend's out, dq, dk, dv (and dgain) and returned LSE_1, LSE_p against the
    float64 dense oracle (on q times the case's ``scale`` and gains, which the kernel applies to its dot products)."""
    from lengthgen.attention import AttentionSpec
    from lengthgen.attention import functional as fn
    from lengthgen.attention.backends import triton_psoftmax as tp

    spec = AttentionSpec(**case["spec"])
    b, h, hkv, lq, lk, d, dv = case["shape"]
    dtype = getattr(torch, dtype or case.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(seed)
    if case.get("strided"):          # (B, L, H, D) memory, viewed as (B, H, L, D) like the Attention layer
        q = torch.randn(b, lq, h, d, generator=gen).transpose(1, 2) * 0.7
        k = torch.randn(b, lk, hkv, d, generator=gen).transpose(1, 2)
        v = torch.randn(b, lk, hkv, dv, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(b, h, lq, d, generator=gen) * 0.7
        k = torch.randn(b, hkv, lk, d, generator=gen)
        v = torch.randn(b, hkv, lk, dv, generator=gen)
    if "logits" in case:                               # logits q.k up to about the given size (test_numerics.py)
        regime, size = case["logits"]
        if regime == "spread":
            q, k = q / 0.7 * math.sqrt(size / (3 * math.sqrt(d))), k * math.sqrt(size / (3 * math.sqrt(d)))
        else:
            q[..., 0] = k[..., 0] = math.sqrt(size)
    scale = case.get("scale", 1.0)
    q = q / scale
    grad = torch.randn(b, h, lq, dv, generator=gen)
    docs = make_docs(b, lk, seed=lk, max_len=12) if case.get("docs") else None
    gain = torch.ones(1, 1, lq, 1)
    if case.get("gain"):                               # positive gains around 1, as sqrt_log_n's
        gb, gh = {"rows": (1, 1), "heads": (1, h), "batch": (b, 1)}[case["gain"]]
        gain = 0.5 + torch.rand(gb, gh, lq, 1, generator=gen)
    inputs = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    q, k, v = inputs
    kernel_gain = gain.to(device).requires_grad_() if case.get("gain") else None
    assert tp.unsupported(spec, q, True) is None, tp.unsupported(spec, q, True)
    autocast = case.get("autocast")
    with torch.autocast(device, dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext():
        out, lse_1, lse_p = tp.attention(q, k, v, spec, None if docs is None else docs.to(device), return_lse=True,
                                         scale=scale, gain=kernel_gain)
    assert out.dtype == (getattr(torch, autocast) if autocast else dtype), out.dtype
    inputs += [kernel_gain] if case.get("gain") else []
    grads = torch.autograd.grad(out, inputs, grad.to(device=device, dtype=dtype))
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, gain)]
    ref, ref_lse_1, ref_lse_p = fn.dense_attention(ref_in[0] * scale * ref_in[3], *ref_in[1:3], spec, docs,
                                                   return_lse=True)
    ref_grads = torch.autograd.grad(ref, ref_in[:len(inputs)], grad.double())
    scales = [1.0] * 4
    if "logits" in case:                              # |dO| |v| |k| a_t for dq, |dO| |v| |q| a_t for dk, |dO| for dv
        term = float(grad.abs().max() * v.detach().abs().max()) * (2.0 if spec.distance == "scale_invariant" else 1.0)
        scales[1:] = term * float(k.detach().abs().max()), term * float(q.detach().abs().max()), float(grad.abs().max())
    errors = {}
    scales.append(1.0)
    for name, got, want, scale in zip(("out", "dq", "dk", "dv", "dgain"), (out, *grads), (ref, *ref_grads), scales):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        errors[name] = ((got.detach().cpu().double() - want).abs().max() / want.abs().max().clamp(min=scale)).item()
    for name, got, want in (("lse_1", lse_1, ref_lse_1), ("lse_p", lse_p, ref_lse_p)):
        assert got.shape == want.shape and got.dtype == torch.float32 and not got.requires_grad, name
        errors[name] = ((got.cpu().double() - want).abs().max() / want.abs().max().clamp(min=1)).item()
    return errors


def compare_attend(case: dict, seed: int = 0) -> dict[str, float]:
    """Relative max errors of ``attend(..., backend="triton")``'s out and gradients (of q, k, v and, for ``attend =
    "heads"`` or ``"global"``, the learned query-scaling multiplier, one per head or one: ``dmult``) against
    ``backend="dense"`` in float64."""
    from lengthgen.attention import AttentionSpec, attend

    spec = AttentionSpec(**case["spec"])
    b, h, hkv, lq, lk, d, dv = case["shape"]
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(b, h, lq, d, generator=gen), torch.randn(b, hkv, lk, d, generator=gen),
              torch.randn(b, hkv, lk, dv, generator=gen)]
    if case["attend"] in ("heads", "global"):
        inputs.append(0.5 + torch.rand(h if case["attend"] == "heads" else (), generator=gen))
    grad = torch.randn(b, h, lq, dv, generator=gen)
    docs = make_docs(b, lk, seed=lk, max_len=12) if case.get("docs") else None
    results = []
    for backend, dtype in (("triton", torch.float32), ("dense", torch.float64)):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        out = attend(*x[:3], spec, doc_ids=docs, multipliers=x[3] if len(x) > 3 else None, backend=backend)
        results.append((out, *torch.autograd.grad(out, x, grad.to(dtype))))
    return {name: ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()
            for name, got, want in zip(("out", "dq", "dk", "dv", "dmult"), *results)}


def _run_group(group: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpret", group], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreter_defect() -> str | None:
    """Why this triton's interpreter cannot run the kernels, or None. Triton 3.6's interpreter turns a scalar
    into a loop bound with ``int(ndarray of shape (1,))``, which NumPy 2.4 rejects; triton 3.7 squeezes first.
    The kernels compiled for CUDA never take this path."""
    import numpy
    import triton

    try:
        int(numpy.zeros(1))
    except TypeError:
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
            return (f"triton {triton.__version__}'s interpreter cannot cast loop bounds under numpy "
                    f"{numpy.__version__} (fixed in triton 3.7)")
    return None


@pytest.mark.parametrize("group", list(INTERPRETER_GROUPS))
def test_interpreter_matches_dense(group):
    pytest.importorskip("triton")
    if reason := interpreter_defect():
        pytest.skip(reason)
    results = _run_group(group)
    failures = []
    for name, case in INTERPRETER_GROUPS[group].items():
        errors = results[name]
        if "error" in errors:
            failures.append(f"{name}: {errors['error']}")
            continue
        failures += [f"{name} {k}: {e:.2e} > {tolerance(case, k):.0e}" for k, e in errors.items()
                     if not e <= tolerance(case, k)]
    assert not failures, "\n".join(failures)


#: the fields the kernel never sees: `attend` turns them into the query gains and the scale it hands the kernel
ATTEND_FIELDS = ("query_scaling", "scaling_a", "scaling_b", "scaling_c", "scaling_init", "base_scale")


def test_interpreter_cases_cover_every_option():
    """Every option of the coverage matrix (test_attention_backends.OPTIONS, which uses every choice of the spec) runs
    on the kernel under the interpreter: one case sets each of its fields to the same value, or a float knob away from
    its default (``attend`` cases for what `attend` reads, `ATTEND_FIELDS`; scaling_init: also a learned multiplier,
    which replaces it); a distance the kernel refuses (not in ``DISTANCE_CODES``) is exempt. log_bias had run only at
    the default tau, which the kernel reads as ``tau_inv``."""
    from test_attention_backends import OPTIONS

    from lengthgen.attention import AttentionSpec
    from lengthgen.attention.backends.triton_psoftmax import DISTANCE_CODES

    base = AttentionSpec()
    cases = [case for group in INTERPRETER_GROUPS.values() for case in group.values()]

    def sets(case: dict, field: str, value) -> bool:
        if field in ATTEND_FIELDS and "attend" not in case:
            return False
        if field == "scaling_init" and case["attend"] in ("heads", "global"):
            return True
        got = case["spec"].get(field, getattr(base, field))
        return got != getattr(base, field) if isinstance(value, float) and field != "softmax_p" else got == value

    missing = [name for name, changes in OPTIONS.items() if changes.get("distance", "none") in DISTANCE_CODES
               and not any(all(sets(case, f, v) for f, v in changes.items()) for case in cases)]
    assert not missing, f"no interpreter case runs the options {missing}"


# ---------------------------------------------------------------------------------------------------
# unsupported (in this process: the kernels here were built without the interpreter)


def test_unsupported_on_cpu_without_interpreter():
    from lengthgen.attention import AttentionSpec, backends
    from lengthgen.attention.backends import triton_psoftmax as tp

    q = torch.empty(1, 2, 16, 64)
    reason = tp.unsupported(AttentionSpec(), q, False)
    if tp.INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs under TRITON_INTERPRET=1")
    assert reason is not None and "CUDA" in reason
    assert backends.unsupported("triton", AttentionSpec(softmax_p=2.0), q, True) == \
        tp.unsupported(AttentionSpec(softmax_p=2.0), q, True)
    for training in (True, False):
        assert backends.choose(AttentionSpec(softmax_p=2.0), q, 16, training) != "triton"


def test_unsupported_reasons(monkeypatch):
    from lengthgen.attention import AttentionSpec
    from lengthgen.attention.backends import triton_psoftmax as tp

    spec = AttentionSpec(softmax_p=2.0, distance="alibi", doc_masking=True, window=8)
    monkeypatch.setattr(tp, "INTERPRETED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if tp.triton is not None:
        assert tp.unsupported(spec, torch.empty(1, 2, 8, 64), True) is None
        assert "head_dim" in tp.unsupported(spec, torch.empty(1, 2, 8, 256), True)
        assert "dtype" in tp.unsupported(spec, torch.empty(1, 2, 8, 64, dtype=torch.float64), True)
        assert "interpreter" in tp.unsupported(spec, torch.empty(1, 2, 8, 64, dtype=torch.bfloat16), True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tp.unsupported(spec, torch.empty(1, 2, 8, 64), False) is not None
    monkeypatch.setattr(tp, "triton", None)
    assert "not importable" in tp.unsupported(spec, torch.empty(1, 2, 8, 64), False)


# ---------------------------------------------------------------------------------------------------
# ahead-of-time compilation for CUDA targets (no GPU needed: triton ships ptxas)

#: opt-in shared memory per block, bytes (CUDA C++ Programming Guide, compute capabilities table)
SHARED_LIMIT = {80: 166912, 90: 232448}
# (arch, dtype, head_dim, distance, window, documents, p, gains: True with their gradient, "no grad" without):
# each distance, dtype, flag and p case at least once
AOT_CASES = [(90, "bf16", 128, "none", False, False, 1.0, False),
             (90, "bf16", 128, "scale_invariant", True, True, 2.0, True),      # with query gains (sqrt_log_n)
             (90, "fp16", 64, "alibi", True, True, 0.5, False), (90, "bf16", 64, "log_bias", False, True, 2.0, False),
             (80, "bf16", 128, "log_bias", True, True, 1.5, False),   # 16-bit tiles (swept on an H100) on an A100
             (80, "fp32", 128, "log_bias", True, True, 2.0, True),    # the most shared memory, A100's limit
             (90, "bf16", 64, "none", False, True, 1.0, "no grad")]    # fixed gains (inference, sqrt_log_n unlearned)


@pytest.fixture
def compiler(monkeypatch):
    pytest.importorskip("triton")
    from lengthgen.attention.backends import triton_psoftmax as tp

    if tp.INTERPRETED:
        pytest.skip("this process built the kernels for TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")       # triton 3.9's default, without its warning
    from triton_code import compile_for_cuda

    return compile_for_cuda


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_kernels_compile_for_cuda(kernel, compiler):
    """Every kernel compiles for sm_80 and sm_90 with the launch configuration the backend uses, and fits the
    architecture's shared memory. The interpreter accepts code the compiler rejects (plain Python globals, for
    one), so this is the CPU check that the CUDA build works."""
    for arch, dtype, head_dim, distance, window, docs, p, gain in AOT_CASES:
        compiled = compiler(kernel, arch, dtype, head_dim, distance, window, docs, p, bool(gain), gain is True)
        assert 0 < compiled.metadata.shared <= SHARED_LIMIT[arch], (arch, dtype, head_dim, compiled.metadata.shared)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_distance_logs_are_one_hardware_instruction(kernel, compiler):
    """log(1 + t / tau) of scale-invariant attention and log-bias is the hardware ``lg2.approx`` per score, not
    libdevice's IEEE ``logf`` (about 35 instructions per score, which nearly doubled the forward kernel's code:
    its cost per score exceeds the tensor cores' at head_dim 64). Measured as the kernels' sm_90 PTX lines."""
    def ptx(distance):
        return compiler(kernel, 90, "bf16", 64, distance, False, False, 1.0).asm["ptx"]

    plain = ptx("none").count("\n")
    for distance in ("scale_invariant", "log_bias"):
        code = ptx(distance)
        assert "lg2.approx" in code and code.count("\n") < 1.25 * plain, (distance, code.count("\n"), plain)



def test_a_distance_code_without_its_kernel_branch_does_not_compile(compiler, monkeypatch):
    """`_logits`' last branch is log-bias: a distance code added without its own branch compiled as log-bias."""
    from lengthgen.attention.backends import triton_psoftmax as tp

    monkeypatch.setitem(tp.DISTANCE_CODES, "future", max(tp.DISTANCE_CODES.values()) + 1)
    with pytest.raises(Exception) as err:          # triton's CompilationError, raised from each calling frame
        compiler("fwd", 90, "bf16", 64, "future", False, False, 1.0)
    chain, cause = [], err.value
    while cause is not None:
        chain, cause = chain + [str(cause)], cause.__cause__
    assert "a DISTANCE_CODES code without its branch in _logits" in "\n".join(chain)
    assert compiler("fwd", 90, "bf16", 64, "log_bias", False, False, 1.0).asm["ptx"]


def test_triton_code_counts_the_compiled_kernels(tmp_path, capsys, compiler):
    """`benchmarks/triton_code.py` compiles each kernel for sm_90 without a GPU and lists its PTX lines and SASS
    opcodes: the tensor-core MMAs (HGMMA on Hopper) and the exponentials (MUFU) are there, and ALiBi's distance
    term adds code."""
    import triton_code

    out = tmp_path / "code.md"
    triton_code.main(["--head-dims", "64", "--distances", "none,alibi", "--out", str(out)])
    lines = out.read_text().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| fwd")]
    assert [row[2] for row in rows] == ["none", "alibi"] and capsys.readouterr().out == out.read_text()
    header = lines[2].split(" | ")
    cell = lambda row, name: int(row[header.index(name)])      # noqa: E731
    for row in rows:
        assert cell(row, "HGMMA") > 0 and cell(row, "MUFU") > 0 and cell(row, "SASS") > cell(row, "PTX lines") / 4
    assert cell(rows[1], "PTX lines") > cell(rows[0], "PTX lines")


_SWEEP_ON_CPU = """
import sys
import torch, triton.testing
torch.Tensor.cuda = lambda self, *a, **k: self               # CPU tensors, for the interpreter
torch.Tensor.bfloat16 = lambda self: self.half()              # the interpreter's tl.dot mishandles bfloat16
torch.cuda.get_device_name = lambda *a: "cpu"
triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]     # one call, no CUDA events
import triton_configs
triton_configs.CANDIDATES = ((16, 16, 4, 2),)
sys.exit(triton_configs.main(["--length", "32", "--batch-heads", "1", "2", "--head-dims", "16", "--ps", "2",
                              "--out", sys.argv[1]]))
"""


def test_triton_configs_sweeps_every_kernel(tmp_path):
    """`benchmarks/triton_configs.py` end to end under the interpreter, its CUDA calls stood in for: one candidate
    of each kernel runs and matches the current configuration. The dK/dV rows crashed the sweep: `backward` returns
    the gains' gradient too (None without gains), which the sweep concatenated with dK and dV."""
    pytest.importorskip("triton")
    if reason := interpreter_defect():
        pytest.skip(reason)
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "benchmarks")))}
    proc = subprocess.run([sys.executable, "-c", _SWEEP_ON_CPU, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r.get("error"), r["matches"]) for r in rows] == [(kind, None, True)
                                                                       for kind in ("fwd", "dq", "dkdv")]

# ---------------------------------------------------------------------------------------------------
# CUDA


CUDA_CASES = {
    "softmax": dict(spec=dict()),
    "p2": dict(spec=dict(softmax_p=2.0)),
    "p0.5_gqa": dict(spec=dict(softmax_p=0.5), hkv=2),
    "docs_p2_gqa": dict(spec=dict(softmax_p=2.0, doc_masking=True), hkv=1, docs=True),
    "window_docs": dict(spec=dict(window=200, doc_masking=True), docs=True),
    "scale_invariant_p2": dict(spec=dict(distance="scale_invariant", softmax_p=2.0)),
    "alibi": dict(spec=dict(distance="alibi")),
    "log_bias_docs": dict(spec=dict(distance="log_bias", doc_masking=True, softmax_p=1.5), docs=True),
    "fewer_queries": dict(spec=dict(softmax_p=2.0, window=300), lq=333),
    "gains_p2_gqa": dict(spec=dict(softmax_p=2.0), hkv=2, gain="heads"),
}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_matches_dense(name, head_dim, dtype):
    c = CUDA_CASES[name]
    lk = 1000
    case = dict(spec=c["spec"], docs=c.get("docs", False), gain=c.get("gain"),
                shape=(2, 4, c.get("hkv", 4), c.get("lq", lk), lk, head_dim, head_dim))
    errors = compare(case, device="cuda", dtype=dtype)
    tol = 2e-3 if dtype == "float32" else 3e-2
    assert all(e <= tol for e in errors.values()), errors


@needs_cuda
@pytest.mark.gpu
def test_cuda_auto_picks_triton_and_trains():
    from lengthgen.attention import AttentionSpec, attend, backends

    spec = AttentionSpec(softmax_p=2.0, doc_masking=True)
    q = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert backends.choose(spec, q, 512, True) == "triton"
    assert backends.choose(AttentionSpec(distance="scale_invariant"), q, 512, True) == "triton"
    assert backends.choose(AttentionSpec(distance="alibi", doc_masking=True), q, 512, True) == "flex"
    assert backends.choose(AttentionSpec(), q, 512, True) == "sdpa"
    docs = make_docs(2, 512, max_len=100).cuda()
    out = attend(q, q, q, spec, doc_ids=docs)
    out.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---------------------------------------------------------------------------------------------------
# subprocess entry point


def _interpret_main(group: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, case in INTERPRETER_GROUPS[group].items():
        try:
            results[name] = compare_attend(case) if "attend" in case else compare(case)
        except Exception as err:  # noqa: BLE001 - reported per case by the parent test
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interpret":
    _interpret_main(sys.argv[2])
