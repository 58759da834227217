"""CPU benchmark of the attention core: `tiled` vs the `dense` oracle, forward + backward.

    python benchmarks/attention_cpu.py [--lengths 1024,2048] [--specs baseline,l2] [--backends tiled,dense]
                                       [--out file.json]

Setup: batch 1, 4 heads, head_dim 64, float32, causal, ``attend(q, k, v, spec, backend=...)`` followed by
``out.backward(grad)``; specs are presets (``baseline`` = softmax p=1, ``l2`` = p-softmax p=2).

How memory is measured (CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``):

* ``peak_MiB``: each (L, backend, spec) is measured in a fresh subprocess started with
  ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc serves every tensor above 64 KiB with its own mmap and
  returns it to the OS when freed (by default glibc's threshold adapts and keeps freed blocks, which made the
  resident size depend on allocation history: +-50% between identical runs). The subprocess imports torch,
  allocates its inputs, runs one small forward + backward (lazy library initialization is not counted), reads
  the process high-water resident set size ``ru_maxrss`` (getrusage), runs the measured forward + backward
  once and reads ``ru_maxrss`` again. The difference is the peak of extra memory the step needed: every live
  tensor at the worst moment (saved activations, temporaries, gradients, output) as the OS saw it. It excludes
  the inputs q, k, v and the upstream gradient (allocated before). Identical runs agree to ~0.5 MiB.
* ``saved_MiB``: the bytes of the distinct tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``, inputs included), a deterministic, allocator-free lower
  bound of what a training step must keep between forward and backward.

Timing runs in a second fresh subprocess with the default allocator (the fixed mmap threshold slows large
allocations). ``time_s`` is the median wall time of ``--repeats`` forward + backward steps after one untimed
full-size step; above 4K it is a single step after the small warm-up only. Threads: torch's default unless
``--threads``. On a shared machine wall times are noisy, so ``cpu_s`` (process CPU time, all threads) is
reported alongside. ``ratio`` is time_s over dense's time_s at the same L and spec.

Dense memory grows like L^2; it is skipped above ``--dense-max-length`` (default 8192) or when its estimate
(``DENSE_BYTES_PER_PAIR`` bytes per (head, query, key) triple) exceeds ``--dense-max-gib`` (default 8).
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

BATCH, HEADS, HEAD_DIM = 1, 4, 64
DENSE_BYTES_PER_PAIR = 24        # measured 20.4 (p=1 and p=2, 2K-8K): about five float32 (L, L) tensors per head


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024    # KiB on Linux


def worker(length: int, backend: str, spec_name: str, mode: str, repeats: int, threads: int = 0) -> dict:
    """One measurement (``mode`` memory or time), run in its own process (see the module docstring)."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from lengthgen.attention import AttentionSpec, attend

    spec = AttentionSpec.preset(spec_name)
    gen = torch.Generator().manual_seed(0)

    def inputs(n):
        q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen).requires_grad_() for _ in range(3))
        return q, k, v, torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=gen)

    def step(q, k, v, grad):
        out = attend(q, k, v, spec, backend=backend)
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None

    step(*inputs(128))                                   # warm up kernels and lazy initialization
    q, k, v, grad = inputs(length)
    row = {"L": length, "backend": backend, "spec": spec_name, "threads": torch.get_num_threads()}
    if mode == "memory":
        before = _maxrss_mib()
        step(q, k, v, grad)
        row["peak_MiB"] = _maxrss_mib() - before
        saved: dict[tuple[int, int], int] = {}

        def pack(t):
            storage = t.untyped_storage()
            saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attend(q, k, v, spec, backend=backend)
        del out
        row["saved_MiB"] = sum(saved.values()) / 2**20
        return row
    if repeats > 0:
        step(q, k, v, grad)                              # untimed full-size step
    walls, cpus = [], []
    for _ in range(max(repeats, 1)):
        wall, cpu = time.perf_counter(), time.process_time()
        step(q, k, v, grad)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    row.update(time_s=statistics.median(walls), cpu_s=statistics.median(cpus), timed_steps=len(walls),
               warm_step=repeats > 0)
    return row


def run_worker(length: int, backend: str, spec: str, mode: str, args) -> dict:
    """Run `worker` in a fresh subprocess; returns its row, or a row with ``skipped`` saying why not."""
    repeats = args.repeats if length <= 4096 else 0
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(length), backend, spec, mode,
           "--repeats", str(repeats), "--threads", str(args.threads)]
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    base = {"L": length, "backend": backend, "spec": spec}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return {**base, "skipped": f"{mode} run over the {args.timeout:.0f} s timeout"}
    if proc.returncode != 0:
        return {**base, "skipped": f"{mode} run failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dense_estimate_gib(length: int) -> float:
    return DENSE_BYTES_PER_PAIR * BATCH * HEADS * length * length / 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--specs", default="baseline,l2")
    ap.add_argument("--backends", default="tiled,dense")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed steps after one untimed step, up to 4K (above: one timed step, no untimed one)")
    ap.add_argument("--dense-max-length", type=int, default=8192)
    ap.add_argument("--dense-max-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--worker", nargs=4, metavar=("L", "BACKEND", "SPEC", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        length, backend, spec, mode = int(args.worker[0]), *args.worker[1:]
        print(json.dumps(worker(length, backend, spec, mode, args.repeats, args.threads)))
        return 0

    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict] = []
    header = f"{'L':>6}  {'backend':<7}  {'spec':<8}  {'time_s':>8}  {'cpu_s':>8}  {'peak_MiB':>9}  " \
             f"{'saved_MiB':>9}  {'ratio':>6}"
    print(header, "\n" + "-" * len(header), flush=True)
    for length in lengths:
        for spec in args.specs.split(","):
            dense_time = None
            for backend in sorted(args.backends.split(","), key=lambda b: b != "dense"):   # dense first
                if backend == "dense" and (length > args.dense_max_length
                                           or dense_estimate_gib(length) > args.dense_max_gib):
                    row = {"L": length, "backend": backend, "spec": spec, "skipped":
                           f"estimated {dense_estimate_gib(length):.1f} GiB (limits: L <= {args.dense_max_length},"
                           f" {args.dense_max_gib} GiB)"}
                    rows.append(row)
                    print(f"{length:>6}  {backend:<7}  {spec:<8}  skipped: {row['skipped']}", flush=True)
                    continue
                row = run_worker(length, backend, spec, "memory", args)
                if "skipped" not in row:
                    timing = run_worker(length, backend, spec, "time", args)
                    row = {**row, **timing}
                if "skipped" in row:
                    rows.append(row)
                    print(f"{length:>6}  {backend:<7}  {spec:<8}  {row['skipped']}", flush=True)
                    continue
                if backend == "dense":
                    dense_time = row["time_s"]
                row["ratio"] = row["time_s"] / dense_time if dense_time else None
                rows.append(row)
                ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
                print(f"{length:>6}  {backend:<7}  {spec:<8}  {row['time_s']:>8.3f}  {row['cpu_s']:>8.3f}  "
                      f"{row['peak_MiB']:>9.1f}  {row['saved_MiB']:>9.1f}  {ratio:>6}", flush=True)

    summary = summarize(rows)
    for line in summary["lines"]:
        print(line)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"setup": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                                 "causal": True, "step": "forward+backward"},
                       "rows": rows, "summary": {k: v for k, v in summary.items() if k != "lines"}}, fh, indent=2)
    return 0


def summarize(rows: list[dict]) -> dict:
    """Targets: tiled peak at the longest L <= 1/8 of dense's quadratic extrapolation, tiled memory linear,
    tiled time within 2x of dense where dense ran."""
    out: dict = {"lines": []}
    done = [r for r in rows if "skipped" not in r]
    for spec in sorted({r["spec"] for r in done}):
        tiled = sorted((r for r in done if r["spec"] == spec and r["backend"] == "tiled"), key=lambda r: r["L"])
        dense = sorted((r for r in done if r["spec"] == spec and r["backend"] == "dense"), key=lambda r: r["L"])
        if not tiled:
            continue
        entry: dict = {}
        last = tiled[-1]
        if dense:
            ref = dense[-1]
            extrapolated = ref["peak_MiB"] * (last["L"] / ref["L"]) ** 2
            entry.update(tiled_L=last["L"], tiled_peak_MiB=last["peak_MiB"], dense_extrapolated_MiB=extrapolated,
                         memory_fraction=last["peak_MiB"] / extrapolated)
            ratios = [r["ratio"] for r in tiled if r.get("ratio") is not None]
            entry["max_time_ratio"] = max(ratios) if ratios else None
        if len(tiled) >= 2:
            growth = [(b["L"] / a["L"], b["peak_MiB"] / a["peak_MiB"]) for a, b in zip(tiled, tiled[1:])
                      if a["peak_MiB"] > 0]
            entry["tiled_peak_growth_per_step"] = growth
        out[spec] = entry
        line = f"[{spec}]"
        if "memory_fraction" in entry:
            line += (f" tiled peak at L={entry['tiled_L']}: {entry['tiled_peak_MiB']:.0f} MiB = "
                     f"{entry['memory_fraction']:.4f} x dense's quadratic extrapolation "
                     f"({entry['dense_extrapolated_MiB']:.0f} MiB; target <= 0.125)")
        if entry.get("max_time_ratio") is not None:
            line += f"; worst tiled/dense time {entry['max_time_ratio']:.2f} (target <= 2)"
        if entry.get("tiled_peak_growth_per_step"):
            line += "; tiled peak growth between consecutive lengths: " + ", ".join(
                f"x{m:.2f} (L x{n:g})" for n, m in entry["tiled_peak_growth_per_step"])
        out["lines"].append(line)
    return out


if __name__ == "__main__":
    sys.exit(main())
