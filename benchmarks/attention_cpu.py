"""CPU benchmark of the attention core: every CPU backend x variant against SDPA's flash kernel (p = 1, causal)
in the same run, forward + backward, and the peak memory of the memory-linear backends.

    python benchmarks/attention_cpu.py --out benchmarks/results/NAME          # writes NAME.json and NAME.md
    python benchmarks/attention_cpu.py --lengths 512,2048 --threads 1 --variants l2,alibi --backends auto,tiled

Setup: batch 1, 4 heads, head_dim 64 (``--head-dim``), float32, causal; one step is ``attend(q, k, v, spec,
backend=...)`` and ``autograd.grad`` of a fixed upstream gradient. Variants (`VARIANTS`) are NoPE specs (positions
belong to the layer, not to attend): windows of L/4, packed documents of L/16..L/4 tokens
(`lengthgen.experiments.bench.packed_doc_ids`). ``auto`` rows name the backend it picked.

Time: one fresh subprocess per (threads, L) times the reference ``F.scaled_dot_product_attention(is_causal=True)``
and every (variant, backend) in interleaved rounds, so that a busy moment of a shared machine slows all alike.
``time_s`` is the median over ``--repeats`` rounds after one untimed step (above 4K: one round after an untimed
step at 256, to keep a run within minutes): process CPU time with one thread (other processes on the machine barely
move it), wall time with more. ``ratio`` = time_s / the reference's time_s; ``spread`` = the lowest and highest
per-round ratio (noise), none from a single round (``rounds``: how many). Float32 denormals are flushed to zero,
as the ``lengthgen`` command runs (`lengthgen.train.setup.flush_denormals`; since 2026-11-24).

Memory (``--memory-variants``, backends tiled and cpu_flash, and dense up to ``--dense-max-length``): each
(L, variant, backend) in a fresh subprocess started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every
tensor above 64 KiB on its own and returns it when freed, so the resident size does not depend on allocation
history); after a small warm-up step, ``peak_MiB`` is the growth of the process's high-water resident set
(``ru_maxrss``) over one forward + backward: every tensor alive at the worst moment, inputs excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_args

ROOT = Path(__file__).resolve().parents[1]
BATCH, HEADS = 1, 4
#: name -> (AttentionSpec fields, packed documents?)
VARIANTS = {
    "baseline": (dict(position="nope"), False),
    "window": (dict(position="nope", window="L/4"), False),
    "doc": (dict(position="nope", doc_masking=True), True),
    "l2": (dict(position="nope", softmax_p=2.0), False),
    "doc_l2": (dict(position="nope", softmax_p=2.0, doc_masking=True), True),
    "alibi": (dict(position="nope", distance="alibi"), False),
    "log_bias": (dict(position="nope", distance="log_bias"), False),
    "scale_invariant": (dict(position="nope", distance="scale_invariant"), False),
}
BACKENDS = ("auto", "dense", "sdpa", "cpu_flash", "tiled")
LENGTHS = (64, 256, 1024, 2048, 4096, 8192, 16384)


def spec_for(variant: str, length: int):
    from lengthgen.attention import AttentionSpec

    fields = dict(VARIANTS[variant][0])
    if fields.get("window") == "L/4":
        fields["window"] = max(1, length // 4)
    return AttentionSpec(**fields)


def _inputs(length: int, head_dim: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, length, head_dim, generator=gen).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(BATCH, HEADS, length, head_dim, generator=gen)


def _step(variant: str, backend: str, q, k, v, grad):
    """A closure running one forward + backward of (variant, backend) on these inputs."""
    import torch

    from lengthgen.attention import attend
    from lengthgen.experiments.bench import packed_doc_ids

    spec = spec_for(variant, q.shape[-2])
    docs = packed_doc_ids(BATCH, q.shape[-2], "cpu") if VARIANTS[variant][1] else None

    def run():
        torch.autograd.grad(attend(q, k, v, spec, doc_ids=docs, backend=backend), (q, k, v), grad)
    return run


def _skip_reason(variant: str, backend: str, length: int, head_dim: int, args) -> str | None:
    import torch

    from lengthgen.attention import backends

    spec = spec_for(variant, length)
    if backend == "auto":
        return None
    if backend == "dense" and length > args.dense_max_length:
        return f"dense above {args.dense_max_length}"
    if backend == "sdpa" and (spec.window or spec.doc_masking) and length > args.dense_max_length:
        return f"sdpa's (L, L) mask above {args.dense_max_length}"
    return backends.unsupported(backend, spec, torch.empty(BATCH, HEADS, length, head_dim), True)


def time_worker(length: int, threads: int, cases: list[tuple[str, str]], head_dim: int, repeats: int) -> dict:
    """Time the reference and ``cases`` [(variant, backend)] in interleaved rounds (see the module doc)."""
    import torch
    import torch.nn.functional as F

    from lengthgen.attention import backends
    from lengthgen.train.setup import flush_denormals

    flush_denormals()                   # as the lengthgen command runs
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    q, k, v, grad = _inputs(length, head_dim)

    def reference():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
    steps = {("sdpa_causal", "reference"): reference}
    steps.update({tuple(case): _step(*case, q, k, v, grad) for case in cases})
    warm = _inputs(256, head_dim) if length > 4096 else (q, k, v, grad)
    for variant, backend in steps:
        (reference if backend == "reference" else _step(variant, backend, *warm))()
    rounds = {case: [] for case in steps}
    for _ in range(repeats if length <= 4096 else 1):
        for case, run in steps.items():
            start = clock()
            run()
            rounds[case].append(clock() - start)
    ref = rounds[("sdpa_causal", "reference")]
    rows = []
    for (variant, backend), times in rounds.items():
        row = dict(L=length, threads=threads, variant=variant, backend=backend, time_s=statistics.median(times),
                   clock="cpu" if threads == 1 else "wall")
        row["ratio"] = row["time_s"] / statistics.median(ref)
        per_round = sorted(t / r for t, r in zip(times, ref))
        row["rounds"] = len(times)
        row["spread"] = [per_round[0], per_round[-1]] if len(times) > 1 else None
        if backend == "auto":
            spec = spec_for(variant, length)
            row["picked"] = backends.choose(spec, q, length, True)
        rows.append(row)
    return {"rows": rows}


def memory_worker(length: int, variant: str, backend: str, head_dim: int) -> dict:
    """Peak extra resident memory of one forward + backward (see the module doc)."""
    import torch

    torch.set_num_threads(1)
    _step(variant, backend, *_inputs(128, head_dim))()                # lazy initialization is not counted
    run = _step(variant, backend, *_inputs(length, head_dim))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024     # KiB on Linux
    return {"rows": [dict(L=length, variant=variant, backend=backend, peak_MiB=peak)]}


def _subprocess(worker: str, payload: dict, args, memory: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, json.dumps(payload)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {args.timeout:.0f} s timeout"}
    if proc.returncode != 0:
        return {"error": f"rc {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    rows, skipped = [], []
    for threads in args.threads:
        for length in args.lengths:
            cases = []
            for variant in args.variants:
                for backend in args.backends:
                    reason = _skip_reason(variant, backend, length, args.head_dim, args)
                    if reason:
                        skipped.append(dict(L=length, threads=threads, variant=variant, backend=backend, why=reason))
                    else:
                        cases.append((variant, backend))
            out = _subprocess("time", dict(length=length, threads=threads, cases=cases, head_dim=args.head_dim,
                                           repeats=args.repeats), args)
            if "error" in out:
                skipped.append(dict(L=length, threads=threads, why=out["error"]))
                print(f"L={length} threads={threads}: {out['error']}", flush=True)
                continue
            rows += out["rows"]
            print(format_rows(out["rows"]), flush=True)
    memory = []
    for length in args.lengths:
        for variant in args.memory_variants:
            for backend in ("tiled", "cpu_flash", "dense"):
                if _skip_reason(variant, backend, length, args.head_dim, args) is None:
                    out = _subprocess("memory", dict(length=length, variant=variant, backend=backend,
                                                     head_dim=args.head_dim), args, memory=True)
                    memory += out.get("rows", [dict(L=length, variant=variant, backend=backend, **out)])
                    print(memory[-1], flush=True)
    return dict(setup=dict(batch=BATCH, heads=HEADS, head_dim=args.head_dim, dtype="float32", step="forward+backward",
                           reference="F.scaled_dot_product_attention(is_causal=True), p = 1",
                           repeats=args.repeats, variants={v: VARIANTS[v][0] for v in args.variants}),
                time=rows, skipped=skipped, memory=memory)


def format_rows(rows: list[dict]) -> str:
    ref = next(r for r in rows if r["backend"] == "reference")
    lines = [f"L={ref['L']} threads={ref['threads']}: SDPA causal p=1 {ref['time_s']:.4f} s ({ref['clock']})"]
    for r in rows:
        if r["backend"] != "reference":
            picked = f" -> {r['picked']}" if "picked" in r else ""
            lines.append(f"  {r['variant']:<16} {r['backend']:<10} {r['ratio']:6.2f}x  {_spread(r)}{picked}")
    return "\n".join(lines)


def _spread(row: dict) -> str:
    return f"[{row['spread'][0]:.2f}, {row['spread'][1]:.2f}]" if row["spread"] else "(1 round)"


def markdown(result: dict, command: str) -> str:
    """Per thread count: a table of ratios to SDPA p=1 (L x variant, each backend), then the memory table."""
    out = [f"# CPU attention benchmark\n\nCommand: `{command}`\n\nSetup: {json.dumps(result['setup'])}\n"]
    time_rows = result["time"]
    for threads in sorted({r["threads"] for r in time_rows}):
        sub = [r for r in time_rows if r["threads"] == threads]
        variants = list(dict.fromkeys(r["variant"] for r in sub if r["backend"] != "reference"))
        out.append(f"\n## {threads} thread(s): time / SDPA causal p=1 time (same run; [min, max] over rounds, "
                   "or (1 round): no spread)\n")
        out.append("| L | SDPA p=1 | " + " | ".join(variants) + " |")
        out.append("|---" * (len(variants) + 2) + "|")
        for length in sorted({r["L"] for r in sub}):
            ref = next(r for r in sub if r["L"] == length and r["backend"] == "reference")
            cells = []
            for variant in variants:
                here = [r for r in sub if r["L"] == length and r["variant"] == variant]
                cells.append("<br>".join(f"{r['backend'] if r['backend'] != 'auto' else 'auto=' + r['picked']} "
                                         f"{r['ratio']:.2f} {_spread(r)}" for r in here))
            out.append(f"| {length} | {ref['time_s']:.4f} s | " + " | ".join(cells) + " |")
        out += targets(sub)
    if result["memory"]:
        out.append("\n## Peak memory of one forward + backward (MiB, inputs excluded)\n")
        out.append("| L | variant | backend | peak MiB |\n|---|---|---|---|")
        out += [f"| {m['L']} | {m['variant']} | {m['backend']} | {m.get('peak_MiB', m.get('error'))} |"
                for m in result["memory"]]
    return "\n".join(out) + "\n"


#: issue 15's targets for the memory-linear path (tiled or cpu_flash, the faster), as a ratio to SDPA causal p = 1
TARGETS = {"window": 1.5, "doc": 1.5, "l2": 2.0, "doc_l2": 2.0, "alibi": 2.0, "log_bias": 2.0, "scale_invariant": 2.0}


def targets(rows: list[dict]) -> list[str]:
    """The targets table of one thread count: per L and variant, the faster memory-linear backend's ratio and
    what ``auto`` picked with its ratio, each marked when over the target."""
    variants = [v for v in TARGETS if any(r["variant"] == v for r in rows)]
    out = ["", "Targets: the faster memory-linear backend (tiled or cpu_flash) and what `auto` picked, each at most "
           + ", ".join(f"{v} {t}x" for v, t in TARGETS.items() if v in variants) + " SDPA p=1 (**over**: missed).",
           "",
        "| L | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for length in sorted({r["L"] for r in rows}):
        cells = []
        for variant in variants:
            here = [r for r in rows if r["L"] == length and r["variant"] == variant]
            linear = min((r for r in here if r["backend"] in ("tiled", "cpu_flash")), key=lambda r: r["ratio"],
                         default=None)
            auto = next((r for r in here if r["backend"] == "auto"), None)
            mark = lambda r: f"{r['ratio']:.2f}" + ("" if r["ratio"] <= TARGETS[variant] else " **over**")  # noqa: E731
            cells.append("; ".join([*([f"{linear['backend']} {mark(linear)}"] if linear else []),
                                    *([f"auto={auto['picked']} {mark(auto)}"] if auto else [])]) or "n/a")
        out.append(f"| {length} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=bench_args.ints, default=LENGTHS)
    ap.add_argument("--threads", type=bench_args.ints, default=(1, 2))
    ap.add_argument("--variants", type=bench_args.names(VARIANTS), default=tuple(VARIANTS))
    ap.add_argument("--backends", type=bench_args.names(BACKENDS), default=BACKENDS)
    ap.add_argument("--memory-variants", type=bench_args.names(VARIANTS, empty=True), default=("l2", "alibi"),
                    help="'' measures no memory")
    ap.add_argument("--head-dim", type=bench_args.positive_int, default=64)
    ap.add_argument("--repeats", type=bench_args.positive_int, default=3, help="timed rounds up to 4K (above: one)")
    ap.add_argument("--dense-max-length", type=int, default=4096, help="dense, and sdpa with a mask, up to this L")
    ap.add_argument("--timeout", type=bench_args.positive_float, default=3600.0, help="seconds per subprocess")
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, payload = args.worker[0], json.loads(args.worker[1])
        result = time_worker(**payload) if kind == "time" else memory_worker(**payload)
        print(json.dumps(result))
        return 0
    bench_args.fresh(ap, [args.out + ".json", args.out + ".md"] if args.out else [], args.overwrite)
    result = run(args)
    if args.out:
        from lengthgen.atomic import atomic_write_text

        command = "python benchmarks/attention_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        atomic_write_text(args.out + ".json", json.dumps(dict(result, command=command), indent=1))
        atomic_write_text(args.out + ".md", markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
