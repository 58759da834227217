"""Why FlexAttention's distance terms are slow on CUDA: the same logits written three ways, under several tiles.

    python3 benchmarks/flex_score_mods.py --out sweep.json             # L = 4096, head_dim 64 and 128, bf16, causal

On the H100 (2026-11-23, `results/...-075527.md`), flex scale_invariant took 2.0-2.2x SDPA flash at head_dim 128
and 5.1-5.6x at 64 (its forward alone 13x flex's own baseline), log_bias 1.3x and 2.1-2.2x, where alibi (the same
distance t, no transcendental) stays at 0.8-1.07x. Two suspects, measured here side by side:

* **the formula** (`FORMS`): ``library`` is `lengthgen.attention.mods` as the model runs it (``log1p(t / tau)``,
  ``sqrt``: Inductor writes ``libdevice.log1p``, a round-to-nearest division and ``sqrt_rn``); ``fast`` is the same
  math with ``log(1 + t * (1/tau))`` (Triton's ``log``) and a multiplication; ``rsqrt`` is ``fast`` with
  ``sqrt(y) = y * rsqrt(y)``; ``table`` looks a_t and bias_t up in float32 tables of every distance, computed from
  the library's own mod in float64 (`tabulate`), so the kernels do no transcendental at all;
* **the tiles** (`KERNEL_OPTIONS`): torch's H100 default for bf16 head_dim 64 is a 128 x 128 forward tile with 4
  warps (128 scores per thread before the score mod's temporaries); ``fwd_BLOCK_N`` 64 halves that.

Every case runs ``torch.compile(flex_attention)`` forward + backward on the same inputs and causal block mask; the
times are taken in interleaved rounds with SDPA flash and flex without a score mod (`timing.measure_interleaved`),
and each ratio is the median of the per-round ratios. Each case's output is compared with its mod's first case (the
``library`` form at the default tiles unless those are left out): ``max_diff``, relative to the largest output.
Writes OUT.json and OUT.md (OUT without suffix); the library is changed from these figures by hand. Needs CUDA.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_args  # noqa: E402
from lengthgen.atomic import atomic_write_text  # noqa: E402
from lengthgen.attention import AttentionSpec, mods  # noqa: E402
from lengthgen.attention.backends import flex  # noqa: E402
from lengthgen.experiments.timing import measure_interleaved  # noqa: E402

TAU, LAMBDA = AttentionSpec().tau, AttentionSpec().log_bias_lambda       # the defaults, as `bench attention` runs
#: name -> FlexAttention kernel_options (torch's defaults; forward tiles; backward tiles)
KERNEL_OPTIONS = {
    "default": {},
    "fwd128x64w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4},
    "fwd128x64w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8},
    "fwd64x64w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4},
    "bwd64x64w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4},
}
MODS = ("scale_invariant", "log_bias")


def _t(score, q_idx, kv_idx):
    return torch.clamp(q_idx - kv_idx, min=0).to(score.dtype)


def fast(mod: str, tau: float = TAU, lam: float = LAMBDA):
    """The library's math with Triton's ``log`` and a multiplication for the division."""
    inv = 1.0 / tau

    def scale_invariant(score, b, h, q_idx, kv_idx):
        log_t = torch.log(1 + _t(score, q_idx, kv_idx) * inv)
        return score * torch.sqrt(1 + 2 * log_t) - 2 * log_t

    def log_bias(score, b, h, q_idx, kv_idx):
        return score - lam * torch.log(1 + _t(score, q_idx, kv_idx) * inv)
    return {"scale_invariant": scale_invariant, "log_bias": log_bias}[mod]


def rsqrt(tau: float = TAU):
    """``fast`` scale_invariant with ``sqrt(y) = y * rsqrt(y)`` (y >= 1)."""
    inv = 1.0 / tau

    def scale_invariant(score, b, h, q_idx, kv_idx):
        log_t = torch.log(1 + _t(score, q_idx, kv_idx) * inv)
        y = 1 + 2 * log_t
        return score * (y * torch.rsqrt(y)) - 2 * log_t
    return scale_invariant


def tabulate(library_mod, length: int, device):
    """``score * a[t] + bias[t]`` (``score + bias[t]`` where a is 1) with float32 tables of t = 0 .. length - 1
    evaluated from ``library_mod`` in float64 (`mods.affine_terms` on the query rows t and the key 0)."""
    a, bias = mods.affine_terms(library_mod, 1, torch.arange(length, device=device),
                                torch.zeros(1, dtype=torch.long, device=device), torch.float32)
    bias = bias.reshape(length).contiguous()
    if a is None:
        def table_bias(score, b, h, q_idx, kv_idx):
            return score + bias[torch.clamp(q_idx - kv_idx, min=0)]
        return table_bias
    a = a.reshape(length).contiguous()

    def table(score, b, h, q_idx, kv_idx):
        t = torch.clamp(q_idx - kv_idx, min=0)
        return score * a[t] + bias[t]
    return table


def score_mod(mod: str, form: str, length: int, device):
    """The score mod of ``mod`` written as ``form`` (`FORMS`)."""
    library = mods.scale_invariant(TAU) if mod == "scale_invariant" else mods.log_bias(LAMBDA, TAU)
    if form == "library":
        return library
    if form == "fast":
        return fast(mod)
    if form == "rsqrt":
        return rsqrt()
    return tabulate(library, length, device)


FORMS = {"scale_invariant": ("library", "fast", "rsqrt", "table"), "log_bias": ("library", "fast", "table")}


def _forward_backward(fn, q, k, v, grad):
    torch.autograd.grad(fn(q, k, v), (q, k, v), grad)


SDPA, BASELINE = ("sdpa_flash", "-", "default"), ("no score mod", "-", "default")     # the two references' keys


def sweep(args, device: torch.device, flex_attention=None) -> list[dict]:
    """One row per (head_dim, mod, form, kernel options) case, with the references' rows (`SDPA`, `BASELINE`).
    ``flex_attention``: what runs the cases (default ``torch.compile(flex_attention)``, `flex._compiled`)."""
    deadline = time.perf_counter() + args.budget
    rows: list[dict] = []
    for head_dim in args.head_dims:
        rows += _group(args, head_dim, deadline, device, flex_attention or flex._compiled())
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _group(args, head_dim: int, deadline: float, device: torch.device, compiled) -> list[dict]:
    """The cases at one head_dim, compiled and checked one by one, then timed together."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    rows: list[dict] = []
    batch, heads = max(1, args.tokens // args.length), max(1, args.model_dim // head_dim)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(batch, heads, args.length, head_dim, generator=gen).to(device, torch.bfloat16)
                     for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    block_mask = flex.build_block_mask(AttentionSpec(), args.length, args.length, None, device)
    base = dict(length=args.length, head_dim=head_dim, batch=batch, heads=heads)

    def sdpa(q_, k_, v_):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    def flex_call(mod_fn, options):
        return lambda q_, k_, v_: compiled(q_, k_, v_, score_mod=mod_fn, block_mask=block_mask,
                                           kernel_options=options or None)

    def row(key):
        return dict(base, mod=key[0], form=key[1], kernel_options=key[2])
    cases = {SDPA: (row(SDPA), sdpa), BASELINE: (row(BASELINE), flex_call(None, {}))}
    wanted = [(mod, form, opts) for mod in args.mods for form in FORMS[mod] if form in args.forms
              for opts in args.kernel_options if opts == "default" or head_dim in args.tile_head_dims]
    reference = {}
    for key in wanted:
        mod, form, opts = key
        if time.perf_counter() > deadline:
            rows.append(dict(row(key), status="skipped: time budget"))
            continue
        call = flex_call(score_mod(mod, form, args.length + flex.BLOCK_SIZE, device), KERNEL_OPTIONS[opts])
        try:
            out = call(q, k, v)              # the training graph only: no_grad would compile another one
            torch.autograd.grad(out, (q, k, v), grad)
            out = out.detach().float()
        except Exception as err:  # noqa: BLE001 - a configuration that does not compile is a result
            rows.append(dict(row(key), status=f"error: {type(err).__name__}: {str(err)[:200]}"))
            continue
        ref = reference.setdefault(mod, out)            # each mod's first case (library, default tiles)
        cases[key] = (dict(row(key), max_diff=((out - ref).abs().max() / ref.abs().max()).item()), call)
    timed = {}
    for key, (_, call) in cases.items():
        timed[key, "fwd"] = lambda call=call: call(q, k, v)
        timed[key, "total"] = lambda call=call: _forward_backward(call, q, k, v, grad)
    timings = measure_interleaved(timed, device, args.warmup, args.reps)
    for key, (r, _) in cases.items():
        total, fwd = timings[key, "total"], timings[key, "fwd"]
        ratio = total / timings[SDPA, "total"]
        r.update(status="ok", fwd_ms=fwd.median, total_ms=total.median, ratio_vs_sdpa_flash=ratio.median,
                 ratio_quartiles=list(ratio.quartiles()),
                 ratio_vs_flex_baseline=(total / timings[BASELINE, "total"]).median,
                 fwd_ratio_vs_flex_baseline=(fwd / timings[BASELINE, "fwd"]).median)
        rows.append(r)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# FlexAttention score-mod sweep: {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             "bf16, causal, forward + backward; ratios are medians of per-round ratios "
             f"({meta['reps']} rounds); `max_diff`: largest output difference from the mod's first case (the "
             "library form at the default tiles), relative to its largest output.", "",
             "| head_dim | mod | form | kernel options | total ms | vs SDPA flash [q1, q3] | vs flex baseline | "
             "forward vs flex baseline | max_diff | status |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, spec=".3g"):
        return "-" if x is None else format(x, spec)
    for r in rows:
        q = r.get("ratio_quartiles") or [None, None]
        lines.append(f"| {r['head_dim']} | {r['mod']} | {r['form']} | {r['kernel_options']} | {f(r.get('total_ms'))} "
                     f"| {f(r.get('ratio_vs_sdpa_flash'), '.2f')} [{f(q[0], '.2f')}, {f(q[1], '.2f')}] | "
                     f"{f(r.get('ratio_vs_flex_baseline'), '.2f')} | {f(r.get('fwd_ratio_vs_flex_baseline'), '.2f')} "
                     f"| {f(r.get('max_diff'), '.1e')} | {r.get('status', '-')} |")
    return "\n".join(lines) + "\n"


def parser() -> bench_args.Parser:
    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results OUT.json and OUT.md (OUT without suffix)")
    ap.add_argument("--overwrite", action="store_true", help="replace existing output files")
    ap.add_argument("--length", type=bench_args.positive_int, default=4096)
    ap.add_argument("--head-dims", type=bench_args.ints, default=(64, 128))
    ap.add_argument("--tile-head-dims", type=bench_args.ints, default=(64,),
                    help="head dims at which the non-default kernel options run (default: 64)")
    ap.add_argument("--mods", type=bench_args.names(MODS), default=MODS)
    ap.add_argument("--forms", type=bench_args.names(FORMS["scale_invariant"]), default=FORMS["scale_invariant"])
    ap.add_argument("--kernel-options", type=bench_args.names(KERNEL_OPTIONS), default=tuple(KERNEL_OPTIONS))
    ap.add_argument("--tokens", type=bench_args.positive_int, default=16384, help="batch = tokens // length")
    ap.add_argument("--model-dim", type=bench_args.positive_int, default=2048, help="heads = model-dim // head_dim")
    ap.add_argument("--warmup", type=bench_args.positive_int, default=3)
    ap.add_argument("--reps", type=bench_args.positive_int, default=10)
    ap.add_argument("--budget", type=bench_args.positive_float, default=420.0,
                    help="seconds after which no further case is compiled (default 420)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    out = Path(args.out)
    paths = [out.with_suffix(".json"), out.with_suffix(".md")]
    bench_args.fresh(ap, paths, args.overwrite)
    if not torch.cuda.is_available():
        ap.error("this sweep times FlexAttention's CUDA kernels and needs a CUDA device; none is visible")
    rows = sweep(args, torch.device("cuda"))
    import datetime
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                reps=args.reps, tau=TAU, lam=LAMBDA, kernel_options=KERNEL_OPTIONS)
    atomic_write_text(paths[0], json.dumps(dict(meta=meta, rows=rows), indent=1))
    atomic_write_text(paths[1], markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
