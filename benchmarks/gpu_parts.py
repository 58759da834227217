"""The measuring parts of `gpu_check` (each runs in its own subprocess: ``gpu_check.py --run-part NAME``).

Every part returns a JSON-plain dict of what it measured. Sizes: ``GPU`` for a CUDA run, ``TINY`` for the CPU
dry run (``--tiny``), which runs the same code at sizes that finish in seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
#: the ~124M modded-nanogpt-like model, with GPT-2's vocabulary padded to 50304
MODEL_CONFIG = ROOT / "benchmarks" / "gpt124m.toml"

GPU = dict(
    model=["model.vocab_size=50304"], train_batch=16, train_length=2048, train_steps=10, train_warmup=3,
    eval_length=65536, layer=dict(dim=768, heads=6, head_dim=128, batch=8, length=2048),
    seed_shapes=[(4096, 128), (4096, 64)], seed_p=2.0,
    compare=["--variants", "baseline,l2", "--steps", "100", "--eval-lengths", "64,256,1024", "--set",
             "train.compile=true", "--set", "train.dtype=bfloat16", "--set", "train.device=cuda"],
    compile_backend="inductor", dtype=torch.bfloat16, warmup=3, reps=10)
TINY = dict(
    model=["model.vocab_size=256", "model.dim=32", "model.layers=2", "model.heads=2", "model.head_dim=16"],
    train_batch=2, train_length=64, train_steps=2, train_warmup=1, eval_length=256,
    layer=dict(dim=32, heads=2, head_dim=16, batch=1, length=32), seed_shapes=[(64, 16)], seed_p=2.0,
    compare=["--variants", "l2", "--steps", "1", "--eval-lengths", "64,128", "--eval-tokens", "128",
             "--set", "train.device=cpu", "--set", "train.dtype=float32", "--set", "train.compile=false"],
    compile_backend="eager", dtype=torch.float32, warmup=1, reps=2)


def sizes(tiny: bool) -> dict[str, Any]:
    return TINY if tiny else GPU


def device(tiny: bool) -> torch.device:
    return torch.device("cpu" if tiny else "cuda")


def model_config(tiny: bool):
    from lengthgen.train.config import load_config

    return load_config(MODEL_CONFIG, sizes(tiny)["model"])


# ---------------------------------------------------------------------------------------------------
# parts


def env(tiny: bool, **_: Any) -> dict[str, Any]:
    """Device name, compute capability, torch / triton / CUDA versions, date and lengthgen's provenance."""
    from lengthgen.eval.results import Provenance

    dev = device(tiny)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = dict(dataclasses.asdict(Provenance.capture(dev)), triton=triton_version, python=platform.python_version(),
               cuda=torch.version.cuda, cpu_count=os.cpu_count())
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)
    else:
        out.update(device_name=platform.processor() or platform.machine(), capability=None)
    return out


def train(tiny: bool, compile: bool = False, **_: Any) -> dict[str, Any]:
    """The 124M GPT's training throughput and MFU (`model_bench.train_throughput`)."""
    from lengthgen.experiments.model_bench import train_throughput

    s = sizes(tiny)
    return train_throughput(model_config(tiny), batch_size=s["train_batch"], length=s["train_length"],
                            steps=s["train_steps"], warmup=s["train_warmup"], compile=compile,
                            compile_backend=s["compile_backend"], device=device(tiny))


def eval_long(tiny: bool, **_: Any) -> dict[str, Any]:
    """The 124M GPT evaluated on one 64K-token sequence (`model_bench.long_eval`)."""
    from lengthgen.experiments.model_bench import long_eval

    return long_eval(model_config(tiny), length=sizes(tiny)["eval_length"], device=device(tiny))


def layer(tiny: bool, **_: Any) -> dict[str, Any]:
    """Out-norm + gate against the plain attention layer, compiled (`model_bench.layer_overhead`)."""
    from lengthgen.experiments.model_bench import layer_overhead

    s = sizes(tiny)
    return layer_overhead(**s["layer"], dtype=s["dtype"], compile=True, compile_backend=s["compile_backend"],
                          device=device(tiny), warmup=s["warmup"], reps=s["reps"])


def compare(tiny: bool, out_dir: str, **_: Any) -> dict[str, Any]:
    """``lengthgen compare`` end to end (bf16, ``train.compile=true`` on CUDA); what its results.json says."""
    from lengthgen.cli import main
    from lengthgen.eval import Comparison

    folder = Path(out_dir) / "compare"
    rc = main(["compare", *sizes(tiny)["compare"], "--out", str(folder), "--no-progress"])
    results = Comparison.load(folder / "results.json")
    train_cfg = results.config["train"]
    runs = {}
    for variant, evals in results.variants.items():
        run = evals[0]
        runs[variant] = dict(final_train_loss=run.final_train_loss, train_seconds=run.train_seconds,
                             eval_seconds=run.eval_seconds,
                             loss_at={str(r.length): r.at_length.get("loss") for r in run.lengths})
    return dict(rc=rc, device=results.provenance.device, compile=train_cfg["compile"], dtype=train_cfg["dtype"],
                steps=train_cfg["steps"], train_length=results.train_length, eval_lengths=results.eval_lengths,
                runs=runs)


def seed001(tiny: bool, seed_kernel: str | None = None, **_: Any) -> dict[str, Any]:
    """Our fused kernel (``attend(..., backend="triton")``) side by side with seed 001's own Triton kernel at the
    same shapes and p, bf16, causal, forward + backward; the seed's kernel autotunes over `SEED_CONFIGS` only
    (its lists of 256 launch configurations per kernel take longer to tune than this check has)."""
    if not seed_kernel:
        return dict(status="skipped: seed 001's kernel is not shipped with lengthgen; pass --seed-kernel PATH "
                           "(make gpu-check SEED_KERNEL=PATH)")
    path = Path(seed_kernel)
    if not path.is_file():
        return dict(status=f"skipped: seed 001's kernel is not at {path}")
    spec = importlib.util.spec_from_file_location("seed001_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "triton_p_softmax_attention"):
        return dict(status=f"skipped: {path} defines no triton_p_softmax_attention")
    if device(tiny).type != "cuda":
        return dict(status=f"skipped: needs CUDA (kernel loaded from {path})")
    return dict(status="ok", kernel=str(path), rows=[_seed_row(module, length, head_dim, sizes(tiny)["seed_p"])
                                                      for length, head_dim in sizes(tiny)["seed_shapes"]])


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) kept from seed 001's autotuning lists: its tiles nearest ours (two:
#: four took more than the part's 45 s on an H100, compiling)
SEED_CONFIGS = ((128, 64, 8, 2), (64, 64, 4, 3))


def _seed_row(module, length: int, head_dim: int, p: float) -> dict[str, Any]:
    import triton

    from lengthgen.attention import AttentionSpec, attend
    from lengthgen.experiments.bench import causal_flops
    from lengthgen.experiments.timing import measure

    for kernel in (module._fwd_kernel, module._bwd_kernel, module._bwd_dq_kernel):
        kernel.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                          for m, n, w, s in SEED_CONFIGS]
    module._bwd_preprocess.configs = [triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=1)]
    dev, batch, heads = torch.device("cuda"), max(1, 16384 // length), 2048 // head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(batch, heads, length, head_dim, generator=gen).to(dev, torch.bfloat16)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = AttentionSpec(softmax_p=p)
    calls = {"lengthgen": lambda: attend(q, k, v, spec, backend="triton"),
             "seed001": lambda: module.triton_p_softmax_attention(q, k, v, p)}
    outs = {name: fn().float() for name, fn in calls.items()}
    row: dict[str, Any] = dict(length=length, head_dim=head_dim, batch=batch, heads=heads, p=p,
                               max_abs_diff=(outs["lengthgen"] - outs["seed001"]).abs().max().item())
    flops = sum(causal_flops(batch, heads, length, head_dim))
    for name, fn in calls.items():
        ms = measure(lambda: torch.autograd.grad(fn(), (q, k, v), grad), dev, 3, 10).median
        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / (ms * 1e-3) / 1e12
    row["ratio"] = row["lengthgen_ms"] / row["seed001_ms"]
    return row


PARTS = {"env": env, "train": train, "eval_long": eval_long, "layer": layer, "compare": compare, "seed001": seed001}


if __name__ == "__main__":      # pragma: no cover - gpu_check.py is the entry point
    sys.exit("run benchmarks/gpu_check.py")
