"""Launch-configuration sweep of lengthgen's fused Triton kernels (forward, dQ, dK/dV) on CUDA.

    python3 benchmarks/triton_configs.py --out sweep.json            # L = 4096, head_dim 128 and 64, p = 1 and 2

Each kernel is timed alone (``triton.testing.do_bench``, median) for every (BLOCK_M, BLOCK_N, num_warps,
num_stages) in `CANDIDATES`, the other two kernels at their current configuration (`triton_psoftmax._configs`);
a candidate that fails to launch (shared memory) is listed with its error, and one whose result differs from the
current configuration's by more than bf16 rounding is marked. `_configs` is then set from the fastest per
(kind, head_dim) by hand, with the sweep's JSON committed under benchmarks/results/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_args  # noqa: E402
from lengthgen.atomic import atomic_write_text  # noqa: E402
from lengthgen.attention import AttentionSpec  # noqa: E402
from lengthgen.attention.backends import triton_psoftmax as tp  # noqa: E402

CANDIDATES = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
              (128, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2), (64, 128, 4, 3),
              (32, 64, 4, 3), (64, 32, 4, 3), (32, 128, 4, 3))


def main(argv: list[str] | None = None) -> int:
    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=bench_args.positive_int, default=4096)
    ap.add_argument("--batch-heads", type=bench_args.positive_int, nargs=2, default=(4, 16))
    ap.add_argument("--head-dims", type=bench_args.positive_int, nargs="+", default=(128, 64))
    ap.add_argument("--ps", type=bench_args.positive_float, nargs="+", default=(2.0, 1.0))
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    args = ap.parse_args(argv)
    bench_args.fresh(ap, [args.out], args.overwrite)
    import triton.testing

    default = tp._configs
    rows = []
    for head_dim in args.head_dims:
        for p in args.ps:
            b, h = args.batch_heads
            gen = torch.Generator().manual_seed(0)
            q, k, v, do = (torch.randn(b, h, args.length, head_dim, generator=gen).cuda().bfloat16() for _ in range(4))
            q = q * head_dim ** -0.5
            spec = AttentionSpec(softmax_p=p)
            starts, ends = tp._documents(None, q.device)
            slopes = tp._slopes(spec, h, q.device)
            ref_out, _, m, lsp = tp.forward(q, k, v, spec, starts, slopes, False)
            for kind in ("fwd", "dq", "dkdv"):
                def run(kind=kind):
                    if kind == "fwd":
                        return tp.forward(q, k, v, spec, starts, slopes, False)[0]
                    dq, dk, dv, _ = tp.backward(q, k, v, ref_out, do, m, lsp, spec, starts, ends, slopes, False)
                    return dq if kind == "dq" else torch.cat((dk, dv), -1)
                ref = run()                         # at the current configuration
                for bm, bn, warps, stages in CANDIDATES:
                    cand = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                    tp._configs = lambda k_, *a, kind=kind, cand=cand: cand if k_ == kind else default(k_, *a)
                    row = dict(kind=kind, head_dim=head_dim, p=p, length=args.length, BLOCK_M=bm, BLOCK_N=bn,
                               num_warps=warps, num_stages=stages)
                    try:
                        diff = (run().float() - ref.float()).abs().max().item()
                        row.update(ms=triton.testing.do_bench(run, warmup=10, rep=40), max_diff=diff,
                                   matches=diff <= 2e-2 * max(ref.float().abs().max().item(), 1.0))
                    except Exception as err:  # noqa: BLE001 - a config that does not fit is a result
                        row.update(error=f"{type(err).__name__}: {str(err)[:200]}")
                    tp._configs = default
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    atomic_write_text(args.out, json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                current={k: default(k, 128) for k in ("fwd", "dq", "dkdv")},
                                                rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
