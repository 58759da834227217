"""Where `auto` switches CPU backends: every CPU backend that runs a spec class, timed at short lengths.

    python benchmarks/attention_crossover.py --out benchmarks/results/NAME     # writes NAME.json and NAME.md
    python benchmarks/attention_crossover.py --lengths 4096,16384 --specs alibi --backends cpu_flash,tiled

Two shapes, float32, forward + backward, 1 thread (``--threads``), L = 16..2048: ``single`` (batch 1, 4 heads,
head_dim 64: `attention_cpu.py`'s setup) and ``demo`` (the demo model's attention: 2048 tokens per step, batch
2048 / L, 4 heads, head_dim 16). Spec classes: softmax with a window of L/4 or packed documents (sdpa with a
mask, cpu_flash, tiled, dense), ALiBi and log-bias (cpu_flash, tiled, dense), p = 2 with and without documents
and scale-invariant (tiled, dense); ``--specs`` and ``--backends`` choose among them (dense's L x L logits take
minutes and GiB from 8K on). ``time_ms`` is the median of 5 (3 above L = 512) steps after one untimed step,
process CPU time with one thread; each row names the fastest backend and `auto`'s pick. The thresholds in
`lengthgen.attention.backends` (``SDPA_MASK_MAX_PAIRS``, ``FLASH_DENSE_MAX_LOGITS``, ``TILED_DENSE_MAX_*``)
come from these rows. Float32 denormals are flushed to zero, as the ``lengthgen`` command runs
(`lengthgen.train.setup.flush_denormals`; since 2026-11-24).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import bench_args
import torch

from lengthgen.atomic import atomic_write_text
from lengthgen.attention import AttentionSpec, attend, backends
from lengthgen.experiments.bench import packed_doc_ids
from lengthgen.train.setup import flush_denormals

SPECS = {"window": AttentionSpec(position="nope", window=1), "doc": AttentionSpec(position="nope", doc_masking=True),
         "alibi": AttentionSpec.preset("alibi"), "log_bias": AttentionSpec(position="nope", distance="log_bias"),
         "l2": AttentionSpec(position="nope", softmax_p=2.0),
         "l2_doc": AttentionSpec(position="nope", softmax_p=2.0, doc_masking=True),
         "scale_invariant": AttentionSpec.preset("scale_invariant")}
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BACKENDS = ("dense", "sdpa", "cpu_flash", "tiled")
SHAPES = {"single": (64, lambda length: 1), "demo": (16, lambda length: max(1, 2048 // length))}


def time_backends(spec: AttentionSpec, batch: int, length: int, head_dim: int,
                  names: tuple[str, ...] = BACKENDS) -> dict[str, float]:
    """Median ms of one forward + backward on each of ``names`` that runs ``spec`` on CPU."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 4, length, head_dim, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, 4, length, head_dim, generator=gen)
    docs = packed_doc_ids(batch, length, "cpu") if spec.doc_masking else None
    times = {}
    for name in names:
        if backends.unsupported(name, spec, q, True) is not None:
            continue

        def step():
            torch.autograd.grad(attend(q, k, v, spec, doc_ids=docs, backend=name), (q, k, v), grad)
        step()
        runs = []
        for _ in range(5 if length <= 512 else 3):
            start = time.process_time()
            step()
            runs.append(time.process_time() - start)
        times[name] = statistics.median(runs) * 1e3
    return times


def main(argv: list[str] | None = None) -> int:
    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=bench_args.names(SHAPES), default=tuple(SHAPES))
    ap.add_argument("--lengths", type=bench_args.ints, default=LENGTHS)
    ap.add_argument("--specs", type=bench_args.names(SPECS), default=tuple(SPECS))
    ap.add_argument("--backends", type=bench_args.names(BACKENDS), default=BACKENDS,
                    help="e.g. cpu_flash,tiled at long lengths, where dense's L x L logits take minutes and GiB")
    ap.add_argument("--threads", type=bench_args.positive_int, default=1)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = ap.parse_args(argv)
    bench_args.fresh(ap, [args.out + ".json", args.out + ".md"] if args.out else [], args.overwrite)
    flush_denormals()                   # as the lengthgen command runs
    torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes:
        head_dim, batch_of = SHAPES[shape]
        for length in args.lengths:
            for name in args.specs:
                spec = SPECS[name]
                spec = spec.replace(window=max(1, length // 4)) if spec.window else spec
                times = time_backends(spec, batch_of(length), length, head_dim, args.backends)
                row = dict(shape=shape, L=length, batch=batch_of(length), heads=4, head_dim=head_dim, spec=name,
                           time_ms=times, fastest=min(times, key=times.get) if times else None,
                           auto=backends.choose(spec, torch.empty(batch_of(length), 4, length, head_dim), length, True))
                rows.append(row)
                print(f"{shape:6} L={length:5} {name:15} " + "  ".join(f"{b}={t:9.2f}" for b, t in times.items())
                      + f"  fastest {row['fastest']}, auto {row['auto']}", flush=True)
    if args.out:
        command = "python benchmarks/attention_crossover.py " + " ".join(argv if argv is not None else sys.argv[1:])
        atomic_write_text(args.out + ".json", json.dumps(dict(command=command, threads=args.threads, rows=rows),
                                                         indent=1))
        lines = [f"# CPU backend crossovers\n\nCommand: `{command}` ({args.threads} thread(s), ms per forward + "
                 "backward, process CPU time)\n", "| shape | L | batch | spec | dense | sdpa | cpu_flash | tiled | "
                 "fastest | auto |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            cells = [f"{r['time_ms'][b]:.2f}" if b in r["time_ms"] else "-" for b in ("dense", "sdpa", "cpu_flash",
                                                                                          "tiled")]
            lines.append(f"| {r['shape']} | {r['L']} | {r['batch']} | {r['spec']} | " + " | ".join(cells)
                         + f" | {r['fastest'] or '-'} | {r['auto']} |")
        atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
