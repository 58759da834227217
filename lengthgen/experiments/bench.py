"""Attention benchmark: every backend x variant against ``F.scaled_dot_product_attention`` with p = 1.

For each (length, head_dim) group, every case is first checked against the dense oracle (forward and gradients, in
float32, where its weights fit in `CHECK_MAX_BYTES`; a mismatch is an ``error`` row, not a time), then the group's
cases and the two references are timed in the same interleaved rounds (`lengthgen.experiments.timing`:
`torch.utils.benchmark` timers): forward and forward+backward in each round, so the backward is their difference
within a round. One row per case: median times, TFLOP/s in the FlashAttention convention (causal forward
``4 b s^2 h d / 2``, backward 2.5x forward; masked and p != 1 variants are credited the same nominal FLOPs, so their
TFLOP/s is "causal-softmax-equivalent"), peak memory (``torch.cuda.max_memory_allocated`` during one
forward+backward, CUDA only), and the median and quartiles over rounds of the per-round time ratio to SDPA's flash
kernel (``sdpa_flash``, the kernel forced) and to SDPA as it dispatches by default (``sdpa_default``: cuDNN or
flash on an H100), in the same mode.

A backend that cannot train a variant on this device but can run inference (FlexAttention on CPU) is timed
forward only; its row says ``mode = fwd`` and the table marks it. The command line is `lengthgen.cli.bench`
(``lengthgen bench attention``; ``benchmarks/attention_gpu.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from lengthgen.attention import AttentionSpec, attend
from lengthgen.atomic import atomic_write_text
from lengthgen.attention import backends as attention_backends
from lengthgen.eval.results import Provenance
from lengthgen.experiments.timing import measure_interleaved
from lengthgen.memory import out_of_memory

#: benchmarked variants: name -> (spec, packed documents?). Only attend() is timed (query scaling, distance
#: terms, masks, p-softmax); QK-norm, RoPE and projections belong to the layer and are not part of it.
VARIANTS: dict[str, tuple[AttentionSpec, bool]] = {
    "baseline": (AttentionSpec.preset("baseline"), False),
    "l2": (AttentionSpec.preset("l2"), False),
    "sqrt_log_n": (AttentionSpec.preset("sqrt_log_n"), False),
    "ssmax": (AttentionSpec.preset("ssmax"), False),
    "scale_invariant": (AttentionSpec.preset("scale_invariant"), False),
    "alibi": (AttentionSpec.preset("alibi"), False),
    "log_bias": (AttentionSpec.preset("log_bias"), False),
    "doc_l2": (AttentionSpec.preset("l2", doc_masking=True), True),
}
REFERENCE, DEFAULT_SDPA = "sdpa_flash", "sdpa_default"
GPU_LENGTHS = (1024, 4096, 16384, 65536)
CPU_LENGTHS = (256, 512)
GPU_BACKENDS = ("triton", "flex", "sdpa")
CPU_BACKENDS = ("dense", "tiled", "sdpa", "cpu_flash", "flex")
DENSE_MAX_BYTES = 8 << 30          # skip the dense oracle when its (B, H, L, L) fp32 weights exceed this
CHECK_MAX_BYTES = 1 << 30          # check each case against the dense oracle when its fp32 weights fit in this
#: largest error of a case against the fp32 dense oracle, relative to the oracle's largest magnitude
CHECK_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}

COLUMNS = ("device", "backend", "variant", "length", "head_dim", "batch", "heads", "dtype", "mode", "status",
           "fwd_ms", "bwd_ms", "total_ms", "fwd_tflops", "bwd_tflops", "total_tflops", "peak_mem_mib",
           "rounds", "check_error", "ref_ms", "ratio_vs_sdpa_flash", "ratio_q1", "ratio_q3",
           "ratio_vs_sdpa_default")


# ---------------------------------------------------------------------------------------------------
# measurement


def causal_flops(batch: int, heads: int, length: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention, FlashAttention convention."""
    fwd = 4 * batch * length ** 2 * heads * head_dim / 2
    return fwd, 2.5 * fwd


def packed_doc_ids(batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """(B, L) document ids of packed rows: documents of random length in [L/16, L/4] (at least 1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    lo, hi = max(1, length // 16), max(1, length // 4)
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < length:
            ids.extend([doc] * int(torch.randint(lo, hi + 1, (1,), generator=gen)))
            doc += 1
        rows.append(ids[:length])
    return torch.tensor(rows, dtype=torch.long, device=device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _failed(err: Exception, device: torch.device) -> str:
    """The status of a case that raised ``err`` (``oom`` or the error), after freeing the device's cache."""
    _free(device)
    return "oom" if out_of_memory(err) else f"error: {type(err).__name__}: {err}"


def _dense_bytes(q: torch.Tensor) -> int:
    """Bytes of the dense oracle's (B, H, L, L) float32 weights for queries ``q``."""
    b, h, length, _ = q.shape
    return b * h * length * length * 4


def _inputs(batch, heads, length, head_dim, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, grad


def _peak(fn: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2 ** 20


def _sdpa(q, k, v, *, flash: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _check(forward: Callable[..., torch.Tensor], spec: AttentionSpec, doc_ids, q, k, v, grad, train: bool
           ) -> float | None:
    """The largest error of ``forward`` (and with ``train`` its gradients) against the dense oracle on the same
    inputs in float32, each relative to the oracle's largest magnitude in that tensor (in all of them for one that
    is exactly zero, e.g. dq when every query sees one key); None when the oracle's weights would not fit in
    `CHECK_MAX_BYTES`."""
    if _dense_bytes(q) > CHECK_MAX_BYTES:
        return None
    ref_inputs = [t.detach().float().requires_grad_(train) for t in (q, k, v)]
    want = [attend(*ref_inputs, spec, doc_ids=doc_ids, backend="dense")]
    inputs = [t.detach().requires_grad_(train) for t in (q, k, v)]
    got = [forward(*inputs)]
    if train:
        want += torch.autograd.grad(want[0], ref_inputs, grad.float())
        got += torch.autograd.grad(got[0], inputs, grad)
    sizes = [float(w.detach().abs().max()) for w in want]
    return max(float((g.detach().float() - w.detach()).abs().max()) / max(size or max(sizes), 1e-30)
               for g, w, size in zip(got, want, sizes))


def _with_tflops(row: dict, flops: tuple[float, float]) -> dict:
    fwd_f, bwd_f = flops
    tf = lambda f, ms: None if ms is None or ms <= 0 else f / (ms * 1e-3) / 1e12   # noqa: E731
    row["fwd_tflops"] = tf(fwd_f, row.get("fwd_ms"))
    row["bwd_tflops"] = tf(bwd_f, row.get("bwd_ms"))
    row["total_tflops"] = tf(fwd_f + (bwd_f if row.get("mode") == "fwd+bwd" else 0.0), row.get("total_ms"))
    return row


# ---------------------------------------------------------------------------------------------------
# the benchmark


@dataclasses.dataclass
class _Case:
    """One row being measured: its forward (taking q, k, v) and whether it trains."""
    row: dict
    forward: Callable[..., torch.Tensor] | None = None
    train: bool = False


def bench_attention(lengths: Iterable[int] | None = None, head_dims: Iterable[int] = (64, 128),
                    variants: Iterable[str] | None = None, backends: Iterable[str] | None = None,
                    batch: int | None = None, heads: int | None = None, dtype: str | torch.dtype = "bfloat16",
                    out_json: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                    warmup: int = 3, reps: int = 10, tokens: int = 16384, model_dim: int = 2048,
                    time_budget_s: float | None = None, verbose: bool = True) -> list[dict]:
    """Benchmark attention backends x variants; returns one dict per row (columns `COLUMNS`).

    ``batch`` defaults to ``tokens // length`` (at least 1) and ``heads`` to ``model_dim // head_dim``
    (FlashAttention's benchmark convention); on CPU both default to small values (1 and 4). Rows of
    unsupported combinations are kept with ``status = "unsupported: <reason>"`` (and ``oom`` / ``skipped`` /
    ``error: ...``, a mismatch with the dense oracle included). ``time_budget_s``: cases not started within it are
    kept as ``skipped: time budget``. ``out_json``: rewritten (atomically) after each group with
    ``{"meta": ..., "rows": [...]}``, so an interrupted run keeps what it measured.
    """
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    lengths = tuple(lengths or (GPU_LENGTHS if on_cuda else CPU_LENGTHS))
    variants = tuple(variants or VARIANTS)
    backends = tuple(backends or (GPU_BACKENDS if on_cuda else CPU_BACKENDS))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    for name in backends:
        if name not in attention_backends.MODULES:
            raise ValueError(f"unknown backend {name!r}; choose from {', '.join(attention_backends.MODULES)}")

    if verbose:
        print(format_header(), flush=True)
    rows: list[dict] = []
    for length in lengths:
        for head_dim in head_dims:
            b = batch or (max(1, tokens // length) if on_cuda else 1)
            h = heads or (max(1, model_dim // head_dim) if on_cuda else 4)
            base = dict(device=str(device), length=length, head_dim=head_dim, batch=b, heads=h,
                        dtype=str(dtype).replace("torch.", ""))
            q, k, v, grad = _inputs(b, h, length, head_dim, dtype, device)
            cases = [_warm(_Case(dict(base, backend=name, variant="baseline", mode="fwd+bwd"),
                                 functools.partial(_sdpa, flash=name == REFERENCE), True), (q, k, v), grad, device)
                     for name in (REFERENCE, DEFAULT_SDPA)]
            for variant in variants:
                spec, docs = VARIANTS[variant]
                doc_ids = packed_doc_ids(b, length, device) if docs else None
                for name in backends:
                    row = dict(base, backend=name, variant=variant)
                    if deadline is not None and time.perf_counter() > deadline:
                        cases.append(_Case(dict(row, mode="-", status="skipped: time budget")))
                    else:
                        case = _prepare(row, name, spec, doc_ids, q, k, v, grad, device)
                        cases.append(_warm(case, (q, k, v), grad, device))
            _time_group(cases, (q, k, v), grad, device, warmup, reps)
            flops = causal_flops(b, h, length, head_dim)
            rows += [_finish(_with_tflops(case.row, flops), verbose) for case in cases]
            del q, k, v, grad, cases
            _free(device)
            if out_json is not None:
                write_json(rows, out_json, device)
    return rows


def _prepare(row: dict, name: str, spec: AttentionSpec, doc_ids, q, k, v, grad, device) -> _Case:
    """The case of backend ``name`` on ``spec``: its mode and its check against the dense oracle, or a row that
    says why it is not timed."""
    train_reason = attention_backends.unsupported(name, spec, q, True)
    infer_reason = attention_backends.unsupported(name, spec, q, False) if train_reason else None
    if train_reason and infer_reason:
        return _Case(dict(row, mode="-", status=f"unsupported: {train_reason}"))
    train = train_reason is None
    row["mode"] = "fwd+bwd" if train else "fwd"
    if name == "dense" and _dense_bytes(q) > DENSE_MAX_BYTES:
        return _Case(dict(row, status=f"skipped: dense weights need {_dense_bytes(q) / 2 ** 30:.0f} GiB"))

    def forward(q_, k_, v_):
        return attend(q_, k_, v_, spec, doc_ids=doc_ids, backend=name)

    try:
        with contextlib.nullcontext() if train else torch.no_grad():
            error = _check(forward, spec, doc_ids, q, k, v, grad, train)
    except Exception as err:  # noqa: BLE001 - a row, not a crash
        return _Case(dict(row, status=_failed(err, device)))
    row["check_error"] = error
    limit = CHECK_TOLERANCE.get(q.dtype, 1e-3)
    if error is not None and not error <= limit:
        return _Case(dict(row, status=f"error: differs from the dense oracle by {error:.3g} (relative; tolerance "
                                      f"{limit:g})"))
    return _Case(row, forward, train)


def _calls(case: _Case, inputs: Sequence[torch.Tensor], grad: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """What is timed of a case: ``fwd`` and ``total`` (forward + backward) when it trains, else ``infer`` (the
    forward under no_grad); the references time all three."""
    forward = functools.partial(case.forward, *inputs)
    calls = {"infer": functools.partial(_no_grad, forward)}
    if case.train:
        calls.update(fwd=forward, total=functools.partial(_forward_backward, forward, inputs, grad))
    return calls


def _warm(case: _Case, inputs: Sequence[torch.Tensor], grad: torch.Tensor, device: torch.device) -> _Case:
    """One call of what will be timed, so that an out-of-memory case is its own row, not a failed group."""
    if case.forward is None:
        return case
    try:
        _calls(case, inputs, grad)["total" if case.train else "infer"]()
    except Exception as err:  # noqa: BLE001 - a row, not a crash
        return _Case(dict(case.row, status=_failed(err, device)))
    return case


def _time_group(cases: list[_Case], inputs: Sequence[torch.Tensor], grad: torch.Tensor, device: torch.device,
                warmup: int, reps: int) -> None:
    """Time every case that has a forward, with the references (``cases[:2]``), in the same interleaved rounds;
    fill the rows. A forward-only case is compared with the references' forward under no_grad."""
    inference = any(case.forward is not None and not case.train for case in cases[2:])
    calls = {(i, what): fn for i, case in enumerate(cases) if case.forward is not None
             for what, fn in _calls(case, inputs, grad).items()
             if what != "infer" or (i < 2 and inference) or not case.train}
    try:
        timings = measure_interleaved(calls, device, warmup, reps)
    except Exception as err:  # noqa: BLE001 - rows, not a crash
        status = _failed(err, device)
        for i, _ in calls:
            cases[i].row["status"] = status
        return
    for i, case in enumerate(cases):
        if case.forward is None:
            continue
        what = "total" if case.train else "infer"
        fwd, total = timings[i, "fwd" if case.train else "infer"], timings[i, what]
        references = [timings.get((r, what)) for r in (0, 1)]
        ratios = [None if ref is None else total / ref for ref in references]
        backward = (total - fwd).median if case.train else None
        case.row.update(status="ok", fwd_ms=fwd.median, total_ms=total.median, rounds=len(total.rounds),
                        bwd_ms=backward if backward is None or backward > 0 else None,
                        ref_ms=None if references[0] is None else references[0].median,
                        ratio_vs_sdpa_flash=None if ratios[0] is None else ratios[0].median,
                        ratio_q1=None if ratios[0] is None else ratios[0].quartiles()[0],
                        ratio_q3=None if ratios[0] is None else ratios[0].quartiles()[1],
                        ratio_vs_sdpa_default=None if ratios[1] is None else ratios[1].median,
                        peak_mem_mib=_peak(calls[i, what], device))


def _forward_backward(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], grad: torch.Tensor):
    torch.autograd.grad(forward(), inputs, grad)


def _no_grad(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return forward()


def _finish(row: dict, verbose: bool) -> dict:
    row = {c: row.get(c) for c in COLUMNS}
    if verbose:
        print(format_row(row), flush=True)
    return row


# ---------------------------------------------------------------------------------------------------
# output


_TABLE = (("backend", 12, "{}"), ("variant", 15, "{}"), ("length", 6, "{}"), ("head_dim", 4, "{}"),
          ("mode", 7, "{}"), ("fwd_ms", 9, "{:.3f}"), ("bwd_ms", 9, "{:.3f}"), ("total_tflops", 7, "{:.3g}"),
          ("peak_mem_mib", 9, "{:.0f}"), ("ratio_vs_sdpa_flash", 7, "{:.2f}"), ("status", 0, "{}"))
_HEADS = {"head_dim": "D", "total_tflops": "TFLOP/s", "peak_mem_mib": "peak MiB", "ratio_vs_sdpa_flash": "x flash",
          "fwd_ms": "fwd ms", "bwd_ms": "bwd ms", "length": "L"}


def format_header() -> str:
    return "  ".join(_HEADS.get(c, c).rjust(w) if w else _HEADS.get(c, c) for c, w, _ in _TABLE)


def format_row(row: dict) -> str:
    cells = []
    for col, width, fmt in _TABLE:
        value = row.get(col)
        text = "-" if value is None else fmt.format(value)
        if col == "mode" and value == "fwd":
            text = "fwd*"
        cells.append(text.rjust(width) if width else text)
    return "  ".join(cells)


def format_table(rows: Sequence[dict]) -> str:
    lines = [format_header(), *map(format_row, rows)]
    if any(r.get("mode") == "fwd" for r in rows):
        lines.append("fwd* = forward only: the backend cannot train here (e.g. FlexAttention has no CPU backward); "
                     "its ratio is to the flash reference's forward")
    return "\n".join(lines)


def write_json(rows: Sequence[dict], path: str | os.PathLike, device: torch.device) -> Path:
    """Write the rows atomically with their provenance (`lengthgen.eval.Provenance`) and conventions."""
    meta = dict(dataclasses.asdict(Provenance.capture(device)), python=platform.python_version(),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else
                platform.processor() or platform.machine(),
                flops="causal forward 4*b*s^2*h*d/2, backward 2.5x forward", reference=REFERENCE)
    return atomic_write_text(path, json.dumps({"meta": meta, "columns": list(COLUMNS), "rows": list(rows)}, indent=1,
                                              default=str))


def is_bench_json(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a benchmark's rows as `write_json` writes them (the only file ``--overwrite``
    replaces)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and {"meta", "columns", "rows"} <= data.keys()


__all__ = ["bench_attention", "VARIANTS", "COLUMNS", "causal_flops", "format_table", "is_bench_json",
           "packed_doc_ids"]
