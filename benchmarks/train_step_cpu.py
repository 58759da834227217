"""CPU training step of the demo model (`lengthgen compare`'s default: dim 64, 2 layers, 4 heads of 16) for
every attention preset, as a ratio to the ``baseline`` preset's step in the same run.

    python benchmarks/train_step_cpu.py --out benchmarks/results/NAME        # writes NAME.json and NAME.md

A step is AdamW on the cross-entropy of random tokens (vocabulary 8): zero_grad, forward, backward, step, with
``attention`` = the preset and ``backend = auto``. Tokens per step are the demo's 2048 (batch 2048 / L, at least
1). One fresh subprocess per (threads, L) times all presets in interleaved rounds after two untimed steps;
``step_ms`` is the median over ``--repeats`` rounds (process CPU time with one thread, wall time with more),
``ratio`` its quotient by the baseline's, ``spread`` the lowest and highest per-round ratio. Float32 denormals
are flushed to zero, as the ``lengthgen`` command runs (`lengthgen.train.setup.flush_denormals`; since 2026-11-24).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_args

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (64, 256, 1024, 4096)
TOKENS = 2048


def worker(length: int, threads: int, presets: list[str], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lengthgen.attention import backends
    from lengthgen.experiments.compare import DEFAULT_CONFIG
    from lengthgen.model import GPT, GPTConfig
    from lengthgen.train.setup import flush_denormals

    flush_denormals()                   # as the lengthgen command runs
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    batch = max(1, TOKENS // length)

    def make(preset: str):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**DEFAULT_CONFIG["model"], "vocab_size": 8, "attention": preset}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, targets = torch.randint(0, 8, (batch, length)), torch.randint(0, 8, (batch, length))

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            opt.step()
        return model, step
    made = {p: make(p) for p in presets}
    for _, step in made.values():
        step()
        step()
    times = {p: [] for p in presets}
    for _ in range(repeats):
        for preset, (_, step) in made.items():
            start = clock()
            step()
            times[preset].append(clock() - start)
    rows, base = [], statistics.median(times["baseline"])
    for preset, (model, _) in made.items():
        attn = model.attentions[0]
        q = torch.empty(batch, attn.heads, length, attn.head_dim)
        per_round = sorted(t / b for t, b in zip(times[preset], times["baseline"]))
        rows.append(dict(L=length, batch=batch, threads=threads, preset=preset, clock="cpu" if threads == 1 else "wall",
                         step_ms=statistics.median(times[preset]) * 1e3, ratio=statistics.median(times[preset]) / base,
                         spread=[per_round[0], per_round[-1]], backend=backends.choose(attn.spec, q, length, True)))
    return rows


def markdown(rows: list[dict], command: str, failed: list[dict] = ()) -> str:
    """Per thread count: each preset's ratio to the baseline at each L; then the (threads, L) that failed."""
    lines = [f"# CPU training step of the demo model, every preset / baseline\n\nCommand: `{command}`\n",
             f"Tokens per step {TOKENS}; cells: ratio to baseline [min, max over rounds] (backend auto picked)\n"]
    for threads in sorted({r["threads"] for r in rows}):
        sub = [r for r in rows if r["threads"] == threads]
        lengths = sorted({r["L"] for r in sub})
        lines += [f"\n## {threads} thread(s)\n", "| preset | " + " | ".join(f"L={n}" for n in lengths) + " |",
                  "|---" * (len(lengths) + 1) + "|"]
        base = {r["L"]: r["step_ms"] for r in sub if r["preset"] == "baseline"}
        lines.append("| baseline step | " + " | ".join(f"{base[n]:.1f} ms" for n in lengths) + " |")
        for preset in dict.fromkeys(r["preset"] for r in sub):
            cells = [next((f"{r['ratio']:.2f} [{r['spread'][0]:.2f}, {r['spread'][-1]:.2f}] ({r['backend']})"
                           for r in sub if r["preset"] == preset and r["L"] == n), "-") for n in lengths]
            lines.append(f"| {preset} | " + " | ".join(cells) + " |")
    lines += [f"\nFailed (not measured): threads={f['threads']} L={f['L']}: {f['error']}" for f in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from lengthgen.atomic import atomic_write_text
    from lengthgen.attention import PRESETS

    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=bench_args.ints, default=LENGTHS)
    ap.add_argument("--threads", type=bench_args.ints, default=(1, 2))
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma list; baseline is always included")
    ap.add_argument("--repeats", type=bench_args.positive_int, default=5)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return 0
    presets = ["baseline"] + [p for p in args.presets.split(",") if p and p != "baseline"]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        ap.error(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}")
    bench_args.fresh(ap, [args.out + ".json", args.out + ".md"] if args.out else [], args.overwrite)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    rows, failed = [], []
    for threads in args.threads:
        for length in args.lengths:
            payload = json.dumps(dict(length=length, threads=threads, presets=presets, repeats=args.repeats))
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", payload], cwd=ROOT, env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(dict(L=length, threads=threads, error=f"rc {proc.returncode}: "
                                   + " ".join(proc.stderr.strip()[-400:].split())))
                print(f"L={length} threads={threads} failed: {proc.stderr[-400:]}", flush=True)
                continue
            rows += json.loads(proc.stdout.strip().splitlines()[-1])
            print("\n".join(f"threads={r['threads']} L={r['L']:5} {r['preset']:16} {r['step_ms']:9.1f} ms "
                            f"{r['ratio']:5.2f}x ({r['backend']})" for r in rows if r["L"] == length
                            and r["threads"] == threads), flush=True)
    if args.out:
        command = "python benchmarks/train_step_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        atomic_write_text(args.out + ".json", json.dumps(dict(command=command, tokens=TOKENS, rows=rows, failed=failed),
                                                         indent=1))
        atomic_write_text(args.out + ".md", markdown(rows, command, failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
