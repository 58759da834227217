"""`gpu_check`'s targets (from the issue) checked against the measured figures, and the markdown summary.

Both read only the result dict that `gpu_check` writes as JSON; nothing here measures or edits a figure.
"""

from __future__ import annotations

from typing import Any, Iterable

from lengthgen.config import counted

#: (target, limit): attention times are forward + backward over SDPA-flash p = 1 on the same shapes in the same run
RATIO_TARGETS = (
    ("triton l2 (p=2) / SDPA flash, L >= 4K", "triton", ("l2",), lambda n: n >= 4096, 1.15),
    ("triton l2 (p=2) / SDPA flash, L = 1K", "triton", ("l2",), lambda n: n == 1024, 1.3),
    ("flex scale_invariant / SDPA flash", "flex", ("scale_invariant",), None, 1.35),
    ("flex alibi / SDPA flash", "flex", ("alibi",), None, 1.35),
    ("flex log_bias / SDPA flash", "flex", ("log_bias",), None, 1.35),
    ("flex l2 (p=2) / SDPA flash", "flex", ("l2",), None, 1.7),
)
QUERY_SCALING = ("sqrt_log_n", "ssmax")          # query-scaling-only variants, against the same backend's baseline
MEMORY_GROWTH_LIMIT = 1.5       # peak bytes per token (batch x L constant) at the longest L over the shortest
EVAL_BEYOND_WEIGHTS_GIB = 4.0   # "a 64K evaluation of the 124M model fits in a few GiB beyond the weights"


def _ok_rows(result: dict) -> list[dict]:
    part = result["parts"].get("attention") or {}
    rows = (part.get("result") or {}).get("rows", [])
    return [r for r in rows if r.get("status") == "ok" and r.get("mode") == "fwd+bwd"]


def _where(row: dict) -> str:
    return f"{row['backend']} {row['variant']} L={row['length']} D={row['head_dim']}"


def _target(name: str, limit: float, worst: tuple[float, str] | None, higher_is_better: bool = False,
            unit: str = "x") -> dict[str, Any]:
    if worst is None:
        return dict(target=name, limit=limit, unit=unit, measured=None, met=None, detail="not measured")
    value, detail = worst
    met = value >= limit if higher_is_better else value <= limit
    return dict(target=name, limit=limit, unit=unit, measured=value, met=met, detail=detail)


def _worst(pairs: Iterable[tuple[float, str]], higher_is_better: bool = False) -> tuple[float, str] | None:
    pairs = list(pairs)
    if not pairs:
        return None
    return (min if higher_is_better else max)(pairs, key=lambda p: p[0])


def targets(result: dict) -> list[dict[str, Any]]:
    """Each target with its worst measured value over the shapes that ran (None: not measured)."""
    rows = _ok_rows(result)
    out = []
    for name, backend, variants, lengths, limit in RATIO_TARGETS:
        pairs = [(r["ratio_vs_sdpa_flash"], _where(r)) for r in rows if r["backend"] == backend
                 and r["variant"] in variants and (lengths is None or lengths(r["length"]))]
        out.append(_target(name, limit, _worst(pairs)))
    base = {(r["backend"], r["length"], r["head_dim"]): r["total_ms"] for r in rows if r["variant"] == "baseline"}
    for variant in QUERY_SCALING:
        pairs = [(r["total_ms"] / base[key], _where(r)) for r in rows if r["variant"] == variant
                 and (key := (r["backend"], r["length"], r["head_dim"])) in base]
        out.append(_target(f"{variant} / baseline, same backend", 1.03, _worst(pairs)))
    layer = _result(result, "layer")
    overheads = {} if layer is None else layer.get("overheads", {"out_norm+gate": layer["overhead"]})
    for name, key in (("elementwise gate", "out_norm+gate"), ("seed 000's per-head gate on 12 channels", "seed000")):
        extra = overheads.get(key)
        if key == "seed000" and extra is None:        # runs from before seed 000's pair was timed
            continue
        out.append(_target(f"out-norm + {name}: extra fraction of an attention layer's fwd+bwd", 0.03,
                           None if extra is None else (extra, f"L={layer['length']} D={layer['head_dim']}")))
        if extra is not None and extra < 0:            # more work measured faster: noise, not a result
            out[-1].update(met=None, detail=out[-1]["detail"] + "; invalid: the layer doing more work measured "
                                                                "faster")
    train = _result(result, "train_compiled")
    out.append(_target("124M GPT training MFU, compiled", 0.40,
                       None if train is None or train.get("mfu") is None else
                       (train["mfu"], f"{train['tokens_per_s']:.0f} tokens/s"), higher_is_better=True))
    out.append(_target("peak memory per token, longest L / shortest L (linear in L: constant)",
                       MEMORY_GROWTH_LIMIT, _worst(_memory_growth(rows))))
    ev = _result(result, "eval_long")
    out.append(_target(f"{'64K' if ev is None else ev['length']}-token evaluation of the 124M GPT, GiB beyond the "
                       "weights", EVAL_BEYOND_WEIGHTS_GIB,
                       None if ev is None or ev["eval"]["beyond_weights_gib"] is None else
                       (ev["eval"]["beyond_weights_gib"], f"model body alone: "
                        f"{ev['features']['beyond_weights_gib']:.2f} GiB"), unit="GiB"))
    return out


def _memory_growth(rows: list[dict]) -> list[tuple[float, str]]:
    """Per (backend, variant, head_dim) that ran at two lengths or more: peak MiB per token at the longest
    length over that at the shortest."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("peak_mem_mib"):
            groups.setdefault((r["backend"], r["variant"], r["head_dim"]), []).append(r)
    out = []
    for (backend, variant, head_dim), rs in groups.items():
        if len(rs) >= 2:
            lo, hi = min(rs, key=lambda r: r["length"]), max(rs, key=lambda r: r["length"])
            per_token = lambda r: r["peak_mem_mib"] / (r["batch"] * r["length"])   # noqa: E731
            out.append((per_token(hi) / per_token(lo),
                        f"{backend} {variant} D={head_dim}: L {lo['length']} -> {hi['length']}"))
    return out


def _result(result: dict, part: str) -> dict | None:
    entry = result["parts"].get(part) or {}
    return entry.get("result") if entry.get("status") == "ok" else None


# ---------------------------------------------------------------------------------------------------
# markdown


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows), ""]


def markdown(result: dict) -> str:
    """The summary of a gpu_check result, generated from its JSON."""
    env = _result(result, "env") or {}
    lines = [f"# lengthgen GPU check: {env.get('device_name', '?')}, {result['started'][:10]}", "",
             f"- mode: {result['mode']}" + (" (CPU dry run at tiny sizes: no GPU figures, targets not evaluated)"
                                             if result["mode"] == "tiny" else ""),
             f"- torch {env.get('torch', '?')}, triton {env.get('triton') or '-'}, CUDA {env.get('cuda') or '-'}, "
             f"compute capability {env.get('capability') or '-'}, Python {env.get('python', '?')}",
             f"- lengthgen {env.get('lengthgen', '?')}, commit {result.get('commit') or env.get('git_commit') or '?'}",
             f"- started {result['started']}; {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget",
             "", "## Parts", ""]
    lines += _table(["part", "status", "seconds", "budget s"],
                    [[name, p["status"], p.get("seconds"), p.get("budget_s")] for name, p in result["parts"].items()])
    if result["targets"]:
        lines += ["## Targets", "", "Worst case over the shapes that ran; `-`: not measured in this run.", ""]
        lines += _table(["target", "limit", "measured", "met", "where"],
                        [[t["target"], f"{t['limit']:g} {t['unit']}", t["measured"],
                          {True: "yes", False: "**no**", None: "-"}[t["met"]], t["detail"]]
                         for t in result["targets"]])
    # the training section holds both training parts: either one's figures make it
    for names, render in ((("tests",), _tests_md), (("attention",), _attention_md), (("seed001",), _seed_md),
                          (("layer",), _layer_md), (("train", "train_compiled"), _train_md),
                          (("eval_long",), _eval_md), (("compare",), _compare_md)):
        part = next((p for p in map(result["parts"].get, names) if p is not None and p.get("result")), None)
        if part is not None:
            lines += render(part["result"], result)
    return "\n".join(lines)


def _tests_md(r: dict, _: dict) -> list[str]:
    counts = ", ".join(f"{n} {k}" for k, n in r["counts"].items())
    out = ["## CUDA tests", "", f"`{r['command']}`: {counts or 'nothing collected'}", ""]
    return out + [f"- failed: `{t}`" for t in r["failed"]] + ([""] if r["failed"] else [])


def _attention_md(r: dict, _: dict) -> list[str]:
    out = ["## Attention backends (forward + backward, causal)", "",
           "x flash: time over `F.scaled_dot_product_attention` with its flash kernel forced (p = 1) on the same "
           "shapes, timed in the same interleaved rounds (median of the per-round ratios, [quartiles]); x SDPA: "
           "over SDPA as it dispatches by default (cuDNN or flash). TFLOP/s in the FlashAttention convention "
           "(masked and p != 1 variants credited the same FLOPs). Each case was first checked against the dense "
           "oracle where it fits (check: the largest error relative to the oracle's magnitude).", ""]
    out += [f"- L={g['length']} D={g['head_dim']}: {g['status']} ({_fmt(g.get('seconds'), '.0f')} s)"
            for g in r["groups"]] + [""]
    rows = sorted(r["rows"], key=lambda x: (x["head_dim"], x["length"], x["variant"], x["backend"]))
    spread = lambda x: "" if x.get("ratio_q1") is None else f" [{_fmt(x['ratio_q1'])}, {_fmt(x['ratio_q3'])}]"  # noqa: E731
    return out + _table(["backend", "variant", "L", "D", "batch x heads", "mode", "fwd ms", "bwd ms", "TFLOP/s",
                         "peak MiB", "x flash", "x SDPA", "check", "status"],
                        [[x["backend"], x["variant"], x["length"], x["head_dim"], f"{x['batch']} x {x['heads']}",
                          x["mode"], x["fwd_ms"], x["bwd_ms"], x["total_tflops"], x["peak_mem_mib"],
                          f"{_fmt(x['ratio_vs_sdpa_flash'])}{spread(x)}", x.get("ratio_vs_sdpa_default"),
                          x.get("check_error"), x["status"]] for x in rows])


def _seed_md(r: dict, _: dict) -> list[str]:
    out = ["## Our fused kernel and seed 001's Triton kernel (bf16, causal, forward + backward)", ""]
    if r.get("status") != "ok":
        return out + [r.get("status", "?"), ""]
    return out + _table(["L", "D", "p", "batch x heads", "lengthgen ms", "seed 001 ms", "ratio", "max |diff|"],
                        [[x["length"], x["head_dim"], x["p"], f"{x['batch']} x {x['heads']}", x["lengthgen_ms"],
                          x["seed001_ms"], x["ratio"], x["max_abs_diff"]] for x in r["rows"]])


def _layer_md(r: dict, _: dict) -> list[str]:
    return ["## Attention layer: out-norm + gate", "",
            f"`Attention` forward + backward, dim {r['dim']}, {r['heads']} heads of {r['head_dim']}, batch "
            f"{r['batch']} x L {r['length']}, {r['dtype']}, compiled: baseline {_fmt(r['ms']['baseline'])} ms, "
            f"with head_layer out-norm and an elementwise 2sigmoid gate {_fmt(r['ms']['out_norm+gate'])} ms "
            f"({100 * r['overhead']:+.1f}%).", ""] + _layer_parts(r) + _kernels(r)


def _kernels(r: dict) -> list[str]:
    """The top kernels of the baseline layer and the out-norm layer side by side (runs before them have none)."""
    lines = []
    for name, kernels in r.get("top_kernels", {}).items():
        lines += [f"Where the {name}'s time goes (torch.profiler: the kernels, on CPU the operators, with the most "
                  "time):", ""] + _table(
            ["kernel", "ms", "calls", "share"],
            [[f"`{k['name']}`", k["ms"], k["calls"], f"{100 * k['share']:.1f}%"] for k in kernels])
    return lines


def _layer_parts(r: dict) -> list[str]:
    """Each part alone (runs from before the parts were timed have none)."""
    names = {"out_norm": "head_layer out-norm alone", "gate": "elementwise 2sigmoid gate alone (a dim x dim W_g)",
             "head_gate": "per-head 2sigmoid gate alone (W_g: heads x dim)",
             "seed000": "seed 000's pair: head_layer out-norm + per-head sigmoid gate on 12 channels"}
    parts = [(label, r["ms"][name], r["overheads"][name]) for name, label in names.items()
             if name in r.get("overheads", {})]
    if not parts:
        return []
    return ["| layer | ms | extra |", "|---|---|---|"] + [
        f"| {label} | {_fmt(ms)} | {100 * extra:+.1f}% |" for label, ms, extra in parts] + [""]


def _train_md(_: dict, result: dict) -> list[str]:
    rows = [_result(result, name) for name in ("train", "train_compiled")]
    rows = [r for r in rows if r]
    return ["## 124M GPT training (synthetic tokens, optimizer step included)", ""] + _table(
        ["compile", "params", "batch x L", "first step s", "step s", "clip + optimizer s", "tokens/s", "TFLOP/s",
         "MFU", "peak GiB"],
        [[r["compile"], r["params"], f"{r['batch']} x {r['length']}", r["first_step_s"], r["step_s"],
          r.get("optimizer_s"), r["tokens_per_s"], r["tflops"], r["mfu"], r["peak_mem_gib"]] for r in rows]) + [
        line for r in rows for line in _kernels(
            {"top_kernels": {f"{'compiled' if r['compile'] else 'eager'} training step": r["top_kernels"]}}
            if r.get("top_kernels") else {})] + [
        f"Muon step over the {m['matrices']} hidden matrices ({'compiled' if r['compile'] else 'eager'} run): "
        f"lengthgen's (batched by shape) {_fmt(m['lengthgen'])} ms, torch.optim.Muon {_fmt(m['torch'])} ms, "
        f"ratio {_fmt(m['ratio'])} (median of per-round ratios)." for r in rows if (m := r.get("muon_step_ms"))]


def _eval_md(r: dict, _: dict) -> list[str]:
    return [f"## {r['length']}-token evaluation of the 124M GPT", "", *_table(
        ["what", "seconds (first run)", "seconds", "GiB beyond weights"],
        [[name, r[name]["first_s"], r[name]["seconds"], r[name]["beyond_weights_gib"]]
         for name in ("eval", "features")]),
        f"Weights: {r['weights_gib']:.2f} GiB. `eval` is the evaluator's forward and per-position loss; "
        "`features` the model body without the LM head.", ""]


def _compare_md(r: dict, _: dict) -> list[str]:
    out = ["## lengthgen compare", "", f"On {r['device']}, train.compile={r['compile']}, dtype {r['dtype']}, "
           f"{counted(r['steps'], 'step')} at length {r['train_length']}.", ""]
    lengths = [str(n) for n in r["eval_lengths"]]
    return out + _table(["variant", "final train loss", "train s", *(f"loss at {n}" for n in lengths)],
                        [[v, x["final_train_loss"], x["train_seconds"], *(x["loss_at"].get(n) for n in lengths)]
                         for v, x in r["runs"].items()])
