"""``lengthgen bench attention``: the command line of `lengthgen.experiments.bench` (also
``benchmarks/attention_gpu.py``). Defaults depend on the device: GPU sizes on CUDA, tiny ones on CPU."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, Iterable

import torch

from lengthgen.attention import backends as attention_backends
from lengthgen.cli.common import command, writing
from lengthgen.config import MAX_SIZE, ConfigError
from lengthgen.experiments import bench


def _positive(text: str, at_least: int = 1) -> int:
    """An integer from ``at_least`` to `MAX_SIZE` (a ``k`` suffix multiplies by 1024), else argparse's one-line
    error."""
    try:
        value = int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not at_least <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give an integer from {at_least} to {MAX_SIZE}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(_positive(x.strip()) for x in text.split(",") if x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no integers")
    return values


def _choices(valid: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma list whose every name is one of ``valid``."""
    valid = tuple(valid)

    def names(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        unknown = [x for x in chosen if x not in valid]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)} is not valid; choose from "
                                             f"{', '.join(valid)}")
        return chosen
    return names


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give a number of seconds > 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``bench attention`` (defaults depend on the device: GPU sizes on CUDA, tiny ones on CPU)."""
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    parser.add_argument("--lengths", type=_ints, default=None,
                        help=f"comma list, 1k suffixes allowed (default {','.join(map(str, bench.GPU_LENGTHS))} on "
                             f"cuda, {','.join(map(str, bench.CPU_LENGTHS))} on cpu)")
    parser.add_argument("--head-dims", type=_ints, default=(64, 128), help="comma list (default 64,128)")
    parser.add_argument("--variants", type=_choices(bench.VARIANTS), default=None,
                        help=f"comma list of {', '.join(bench.VARIANTS)} (default: all)")
    parser.add_argument("--backends", type=_choices(attention_backends.MODULES), default=None,
                        help=f"comma list (default {','.join(bench.GPU_BACKENDS)} on cuda, "
                             f"{','.join(bench.CPU_BACKENDS)} on cpu)")
    parser.add_argument("--batch", type=_positive, default=None, help="default tokens // length on cuda, 1 on cpu")
    parser.add_argument("--heads", type=_positive, default=None, help="default model_dim // head_dim on cuda, 4 on "
                        "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--tokens", type=_positive, default=16384, help="cuda: tokens per case (batch = tokens // "
                        "length unless --batch)")
    parser.add_argument("--model-dim", type=_positive, default=2048, help="cuda: heads = model_dim // head_dim unless "
                        "--heads")
    parser.add_argument("--warmup", type=lambda text: _positive(text, 0), default=None, help="default 3 (1 on cpu)")
    parser.add_argument("--reps", type=_positive, default=None, help="default 10 (3 on cpu)")
    parser.add_argument("--time-budget", type=_seconds, default=None, help="seconds; later cases are skipped")
    parser.add_argument("--out", default=None, help="JSON path (default runs/bench/attention_<device>.json); "
                        "rewritten after each (length, head_dim) group")
    parser.add_argument("--overwrite", action="store_true", help="replace --out when it is an earlier benchmark's JSON")
    return parser


def output_path(args: argparse.Namespace) -> Path:
    """Where ``main`` writes: ``--out``, else runs/bench/attention_<device>.json."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Path(args.out or f"runs/bench/attention_{device}.json")


def main(args: argparse.Namespace) -> list[dict]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch sees no CUDA device; use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    out = output_path(args)
    if out.exists() and not getattr(args, "overwrite", False):
        raise ConfigError(f"--out {out} exists; pass --overwrite to replace it, or give another --out")
    if out.exists() and not bench.is_bench_json(out):
        raise ConfigError(f"--out {out} exists and is not a benchmark's results (JSON of meta, columns and "
                          "rows): --overwrite replaces only those; give another --out")
    rows = bench.bench_attention(args.lengths, args.head_dims, args.variants, args.backends, args.batch, args.heads,
                           args.dtype or ("float32" if cpu else "bfloat16"), out, device=device,
                           warmup=args.warmup if args.warmup is not None else (1 if cpu else 3),
                           reps=args.reps if args.reps is not None else (3 if cpu else 10),
                           tokens=args.tokens, model_dim=args.model_dim, time_budget_s=args.time_budget,
                           verbose=True)
    print()
    print(bench.format_table(rows))
    print(f"\nwrote {out}")
    return rows


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["attention"], help="what to benchmark")
    add_arguments(p)


@command("bench", _bench_args)
def bench_command(args: argparse.Namespace) -> int:
    """Benchmark attention backends x variants against SDPA (ratios measured in the same run)."""
    with writing(output_path(args)):
        main(args)
    return 0
