"""Model-level measurements: a GPT's training throughput and MFU, a long evaluation's time and memory, and what
out-norm + gate add to an attention layer's forward + backward.

FLOPs per token of a training step (forward + backward) follow PaLM (Chowdhery et al. 2022, appendix B):
``6 N + 12 L H Q T`` with N the parameters that multiply activations (every parameter but the input embedding
table; the LM head counts, tied or not), L layers, H heads of width Q, T the sequence length. Causal attention
computes half of the score and value products (FlashAttention's convention, as `bench.causal_flops`), so the
attention term here is ``6 L H Q T``; document masks and windows are credited the same nominal FLOPs. MFU is
the achieved FLOP/s over the device's peak dense bf16 tensor-core FLOP/s (`PEAK_BF16_TFLOPS`).

Every measurement runs on synthetic tokens (no data loading) under the run config's autocast, and times whole
steps with the device synchronized (the median of ``steps`` after ``warmup``; the first step, which compiles,
is reported on its own).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from lengthgen.attention import Attention, AttentionSpec
from lengthgen.data.tasks.base import Batch
from lengthgen.eval.evaluate import measure_gpt
from lengthgen.experiments.bench import packed_doc_ids
from lengthgen.experiments.timing import measure_interleaved
from lengthgen.model import GPT
from lengthgen.train.config import RunConfig
from lengthgen.train.muon import Muon
from lengthgen.train.optim import build_optimizers, muon_param_names
from lengthgen.train.setup import autocast_dtype

#: dense bf16 tensor-core TFLOP/s by device name (first match of a case-insensitive substring): NVIDIA's H100
#: and H200 datasheets list 1979 TFLOP/s (SXM), 1513 (H100 PCIe), 1671 (NVL) "with sparsity", twice the dense
#: rate; the A100 datasheet lists 312 dense
PEAK_BF16_TFLOPS = (("H100 NVL", 835.5), ("H200 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4),
                    ("H200", 989.4), ("A100", 312.0))


def peak_bf16_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak (`PEAK_BF16_TFLOPS`), or None for a device not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key.lower() in device_name.lower()), None)


def matmul_parameters(model: GPT) -> int:
    """N of the FLOPs formula: the parameters minus the input embedding table (plus the head when tied)."""
    n = model.num_parameters() - model.embed.weight.numel()
    return n + (model.head.weight.numel() if model.head.weight is model.embed.weight else 0)


def flops_per_token(model: GPT, length: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``length`` (module docstring)."""
    cfg = model.config
    return 6.0 * matmul_parameters(model) + 6.0 * cfg.layers * cfg.heads * cfg.resolved_head_dim * length


def synthetic_batch(vocab: int, batch: int, length: int, documents: bool, device: torch.device) -> Batch:
    """Random tokens and targets, every position in the loss; packed documents (`bench.packed_doc_ids`)."""
    gen = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, vocab, (2, batch, length), generator=gen)
    doc_ids = packed_doc_ids(batch, length, "cpu") if documents else None
    return Batch(tokens, targets, torch.ones(batch, length, dtype=torch.bool), doc_ids).to(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn()`` with the device synchronized before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _reset_peak(device: torch.device) -> None:
    """Start `_peak_gib` afresh: what the work after this call allocates at most (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    """GiB allocated at most since `_reset_peak` (CUDA; None on the CPU, where no allocator counts it)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _autocast(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(cfg.train, device.type)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def top_kernels(fn: Callable[[], Any], device: torch.device, n: int = 10) -> list[dict[str, Any]]:
    """The ``n`` CUDA kernels (on CPU: operators) taking the most time in one call of ``fn``, by
    ``torch.profiler``: name, milliseconds, calls and share of all kernels' (operators' self) time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    # one cycle: acc_events changes nothing but torch 2.11's warning that it is off (2.13 no longer warns)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 acc_events=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        self_us = lambda e: e.self_device_time_total   # noqa: E731
    else:
        events, self_us = list(prof.key_averages()), lambda e: e.self_cpu_time_total   # noqa: E731
    total = sum(self_us(e) for e in events) or 1.0
    return [dict(name=e.key[:120], ms=self_us(e) / 1e3, calls=e.count, share=self_us(e) / total)
            for e in sorted(events, key=self_us, reverse=True)[:n]]


def train_throughput(cfg: RunConfig, *, batch_size: int, length: int, steps: int = 10, warmup: int = 3,
                     compile: bool = False, compile_backend: str = "inductor", device: str | torch.device = "cuda"
                     ) -> dict[str, Any]:
    """Tokens/s, TFLOP/s and MFU of training ``cfg.model`` with ``cfg.train``'s optimizers, gradient clipping and
    autocast on ``batch_size`` x ``length`` synthetic tokens (packed documents when the spec masks them).

    Whole steps are timed in the same interleaved rounds as their forward + backward alone: ``optimizer_s`` (and
    ``optimizer_fraction`` of the step) is the median per-round difference, the gradient clipping and optimizer
    steps. ``peak_mem_gib``: the most memory allocated during those rounds (CUDA only; not the first, compiling
    step's, nor what this process allocated before). ``top_kernels``: where one more step's time goes
    (`top_kernels`). With Muon, ``muon_step_ms``: its step against torch's (`muon_step_ms`)."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    optimizers = build_optimizers(model, cfg.train)
    forward = torch.compile(model, backend=compile_backend) if compile else model
    loss_fn = torch.compile(model.loss, backend=compile_backend) if compile else model.loss     # as the Trainer
    batch = synthetic_batch(cfg.model.vocab_size, batch_size, length, cfg.model.attention.doc_masking, device)

    def forward_backward() -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with _autocast(cfg, device):
            output = forward(batch.tokens, batch.doc_ids)
        loss_fn(output, batch)[0].backward()

    def step() -> None:
        forward_backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        for opt in optimizers:
            opt.step()

    first = _timed(step, device)
    _reset_peak(device)
    timings = measure_interleaved({"step": step, "forward_backward": forward_backward}, device, max(0, warmup - 1),
                                  steps)
    peak_mem = _peak_gib(device)
    timing, optimizer = timings["step"], timings["step"] - timings["forward_backward"]
    kernels = top_kernels(step, device)
    muon = muon_step_ms(model, cfg, device, warmup, steps) if cfg.train.optimizer == "muon" else None
    seconds = timing.median / 1e3
    tokens_per_s = batch_size * length / seconds
    flops = flops_per_token(model, length)
    peak = peak_bf16_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    tflops = tokens_per_s * flops / 1e12
    return dict(params=model.num_parameters(), matmul_params=matmul_parameters(model), batch=batch_size,
                length=length, compile=compile, compile_backend=compile_backend if compile else None,
                first_step_s=first, step_s=seconds, step_s_quartiles=[t / 1e3 for t in timing.quartiles()],
                steps=steps, optimizer_s=optimizer.median / 1e3, optimizer_fraction=(optimizer / timing).median,
                tokens_per_s=tokens_per_s, flops_per_token=flops,
                tflops=tflops, peak_tflops=peak, mfu=tflops / peak if peak else None, peak_mem_gib=peak_mem,
                top_kernels=kernels, muon_step_ms=muon)


def muon_step_ms(model: GPT, cfg: RunConfig, device: torch.device, warmup: int, reps: int) -> dict[str, Any]:
    """Milliseconds of one Muon step over ``model``'s hidden matrices (their current gradients): lengthgen's
    `Muon` (Newton-Schulz batched by shape) and `torch.optim.Muon` (one matrix at a time), in interleaved rounds;
    ``ratio``: the median per-round ratio of lengthgen's to torch's. The steps move the weights."""
    names = set(muon_param_names(model))
    params = [p for name, p in model.named_parameters() if name in names and p.grad is not None]
    kwargs = dict(lr=cfg.train.muon_lr, momentum=cfg.train.muon_momentum, nesterov=True,
                  adjust_lr_fn=cfg.train.muon_adjust_lr)
    steps = {"lengthgen": Muon(params, **kwargs).step, "torch": torch.optim.Muon(params, **kwargs).step}
    timings = measure_interleaved(steps, device, warmup, reps)
    return dict(matrices=len(params), lengthgen=timings["lengthgen"].median, torch=timings["torch"].median,
                ratio=(timings["lengthgen"] / timings["torch"]).median)


@torch.no_grad()
def long_eval(cfg: RunConfig, *, length: int, device: str | torch.device = "cuda") -> dict[str, Any]:
    """Time and peak memory of the evaluator's work on one ``length``-token sequence (`measure_gpt`: forward and
    per-position loss) and of the model body alone (`GPT.features`), under ``cfg.train``'s autocast. Each is
    run twice; the second (compiled kernels warm) is reported. Memory is beyond the weights (CUDA only)."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device).eval()
    batch = synthetic_batch(cfg.model.vocab_size, 1, length, False, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = dict(length=length, params=model.num_parameters(), weights_gib=weights / 2**30)
    runs = {"eval": lambda: measure_gpt(model, None, batch), "features": lambda: model.features(batch.tokens)}
    for name, fn in runs.items():
        with _autocast(cfg, device):
            first = _timed(fn, device)
            _reset_peak(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            seconds = _timed(fn, device)
        peak = _peak_gib(device)
        out[name] = dict(first_s=first, seconds=seconds,
                         beyond_weights_gib=None if peak is None else peak - base / 2**30)
    return out


def layer_overhead(*, dim: int, heads: int, head_dim: int, batch: int, length: int, dtype: torch.dtype,
                   compile: bool, compile_backend: str = "inductor", device: str | torch.device = "cuda",
                   warmup: int = 3, reps: int = 10) -> dict[str, Any]:
    """Forward + backward milliseconds of an `Attention` layer (projections, attention, output) with the
    ``baseline`` spec and with AVNorm out-norm (``head_layer``) plus an elementwise ``2sigmoid`` gate (seeds
    000 and 004), and the second's extra time as a fraction of the first's (``overhead``). The parts alone are
    timed too (``overheads``): the out-norm, the elementwise gate (its W_g is a dim x dim projection, a fifth
    projection beside Q, K, V, O), a per-head gate (W_g: heads x dim), and seed 000's own pair (``seed000``:
    ``head_layer`` out-norm and a per-head sigmoid gate on the first 12 channels, as in its modded-nanogpt). The
    layers are timed in interleaved rounds (`timing.measure_interleaved`): timed one after another, a busy moment
    once made the baseline twice as slow as the layer with more work. Each extra fraction is the median over rounds
    of the per-round ratio (``overhead_quartiles``: its quartiles). ``top_kernels``: where the baseline's and the
    out-norm layer's time goes (`top_kernels`)."""
    device = torch.device(device)
    base = AttentionSpec.preset("baseline")
    specs = {"baseline": base, "out_norm+gate": base.replace(out_norm="head_layer", gate="elementwise",
                                                             gate_act="2sigmoid"),
             "out_norm": base.replace(out_norm="head_layer"),
             "gate": base.replace(gate="elementwise", gate_act="2sigmoid"),
             "head_gate": base.replace(gate="head", gate_act="2sigmoid"),
             "seed000": base.replace(out_norm="head_layer", gate="head", gate_act="sigmoid", gate_width=12)}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(batch, length, dim, generator=gen).to(device=device, dtype=dtype)
    calls = {}
    for name, spec in specs.items():
        layer = Attention(dim, heads, spec, head_dim=head_dim).to(device=device, dtype=dtype)
        fn = torch.compile(layer, backend=compile_backend) if compile else layer
        calls[name] = lambda fn=fn, layer=layer: torch.autograd.grad(fn(x), (x, *layer.parameters()), grad)
    timings = measure_interleaved(calls, device, warmup, reps)
    ratios = {name: t / timings["baseline"] for name, t in timings.items() if name != "baseline"}
    kernels = {f"{name} layer": top_kernels(calls[name], device, 8) for name in ("baseline", "out_norm")}
    return dict(dim=dim, heads=heads, head_dim=head_dim, batch=batch, length=length, dtype=str(dtype).split(".")[-1],
                compile=compile, ms={name: t.median for name, t in timings.items()}, rounds=reps,
                overhead=ratios["out_norm+gate"].median - 1.0,
                overhead_quartiles=[q - 1.0 for q in ratios["out_norm+gate"].quartiles()],
                overheads={name: r.median - 1.0 for name, r in ratios.items()}, top_kernels=kernels)


__all__ = ["PEAK_BF16_TFLOPS", "flops_per_token", "layer_overhead", "long_eval", "matmul_parameters",
           "muon_step_ms", "peak_bf16_tflops", "synthetic_batch", "top_kernels", "train_throughput"]
