"""The Triton kernels compiled ahead of time for a CUDA architecture, without a GPU (triton ships ptxas and
cuobjdump): lines of PTX and SASS instructions by opcode, per kernel and case. A static measure of what a change
costs per score before a GPU can time it (benchmarks/README.md cites it); `tests/test_triton.py` compiles with
`compile_for_cuda` too.

    python3 benchmarks/triton_code.py                        # sm_90, bf16, head_dim 64 and 128, p = 1
    python3 benchmarks/triton_code.py --arch 80 --p 2 --distances none,alibi --out code.md
    python3 benchmarks/triton_code.py --gain --distances none        # with query gains (sqrt_log_n, ssmax)

Counts are of the whole kernel, not of one loop iteration: the loop bodies (one copy per masked / unmasked loop)
dominate them. SASS needs triton's ``cuobjdump`` (``sass`` is then empty without it).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_args  # noqa: E402
from lengthgen.atomic import atomic_write_text  # noqa: E402

KERNELS = ("fwd", "dq", "dkdv")
#: kernel argument names by type; every other argument is an int32 scalar
TENSOR_ARGS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
FP32_POINTERS = {"M", "LSP", "LSE1", "SLOPES", "DELTA", "GAIN", "DGAIN"}
INT32_POINTERS = {"STARTS", "ENDS"}
FP32_SCALARS = {"p", "inv_p", "scale", "tau_inv", "lam"}
#: the opcodes listed by name (the rest are summed in the total): tensor-core MMAs, the special-function unit
#: (exp2, lg2, rsqrt), float32 arithmetic, conversions to 16 bits
OPCODES = ("HGMMA", "HMMA", "MUFU", "FMUL", "FFMA", "FADD", "FMNMX", "F2FP")


def compile_for_cuda(kernel: str, arch: int, dtype: str, head_dim: int, distance: str, window: bool, docs: bool,
                     p: float, gain: bool = False, gain_grad: bool | None = None):
    """``kernel`` (fwd, dq, dkdv) compiled ahead of time for sm_``arch`` with the backend's launch configuration
    (``dtype``: bf16, fp16 or fp32; ``gain``: with query gains, and by default (``gain_grad``) their gradient in
    dq). Outside the Triton interpreter (TRITON_INTERPRET unset when the backend was imported)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lengthgen.attention.backends import triton_psoftmax as tp

    fn = {"fwd": tp._fwd_kernel, "dq": tp._bwd_dq_kernel, "dkdv": tp._bwd_dkdv_kernel}[kernel]
    cfg = tp._configs(kernel, head_dim, 4 if dtype == "fp32" else 2)
    options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    constants = dict(D=head_dim, D_V=head_dim, DIST=tp.DISTANCE_CODES[distance], HAS_WINDOW=window,
                     HAS_DOCS=docs, P_KIND=tp.p_kind(p), HAS_GAIN=gain,
                     GAIN_GRAD=gain if gain_grad is None else gain_grad,
                     PREC="ieee" if dtype == "fp32" else "tf32", **cfg)
    constants = {name: value for name, value in constants.items() if name in fn.arg_names}
    signature = {name: "constexpr" if name in constants else f"*{dtype}" if name in TENSOR_ARGS
                 else "*fp32" if name in FP32_POINTERS else "*i32" if name in INT32_POINTERS
                 else "fp32" if name in FP32_SCALARS else "i32" for name in fn.arg_names}
    return triton_compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32), options=options)


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode -> count of the SASS instructions in ``cubin`` (triton's ``cuobjdump -sass``; empty without it)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    # an instruction line: /*0a10*/  [@P0] OPCODE.MODIFIERS operands ;
    ops = (re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line) for line in listing.splitlines())
    return collections.Counter(m.group(1) for m in ops if m)


def table(arch: int, dtype: str, head_dims, distances, p: float, gain: bool = False) -> str:
    rows = [f"sm_{arch}, {dtype}, p = {p:g}, causal (no window, no documents){', query gains' if gain else ''}; "
            "counts of the whole kernel", "",
            "| kernel | head_dim | distance | PTX lines | SASS | " + " | ".join(OPCODES) + " |",
            "|---|---|---|---|---|" + "---|" * len(OPCODES)]
    for kernel in KERNELS:
        for head_dim in head_dims:
            for distance in distances:
                compiled = compile_for_cuda(kernel, arch, dtype, head_dim, distance, False, False, p, gain)
                ops = sass_opcodes(compiled.asm["cubin"])
                rows.append(f"| {kernel} | {head_dim} | {distance} | {compiled.asm['ptx'].count(chr(10))} | "
                            f"{sum(ops.values())} | " + " | ".join(str(ops[op]) for op in OPCODES) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    from lengthgen.attention.backends.triton_psoftmax import DISTANCE_CODES       # the kernel's distance terms

    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, choices=(80, 90), default=90, help="compute capability x 10 (default 90)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--head-dims", type=bench_args.ints, default=(64, 128))
    ap.add_argument("--distances", type=bench_args.names(tuple(DISTANCE_CODES)),
                    default=("none", "scale_invariant", "alibi"))
    ap.add_argument("--p", type=bench_args.positive_float, default=1.0, help="softmax p (default 1)")
    ap.add_argument("--gain", action="store_true", help="with query gains (sqrt_log_n, ssmax) and their gradient")
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    if bad := [d for d in args.head_dims if d > 128 or d & (d - 1) or d < 16]:
        ap.error(f"argument --head-dims: {bad[0]} is not valid; give powers of two from 16 to 128")
    if args.out:
        bench_args.fresh(ap, [args.out], args.overwrite)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: the kernels would be built for the interpreter; unset it")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")       # triton 3.9's default, without its warning
    text = table(args.arch, args.dtype, args.head_dims, args.distances, args.p, args.gain)
    print(text, end="")
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
