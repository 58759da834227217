"""`lengthgen compare`: train several attention variants at a short length, evaluate them far beyond it,
and write a report folder (``results.json``, ``report.md``, ``extrapolation.png``, ``diagnostics.png``).

The embedded default needs no download and no GPU: next-token prediction on a Dyck language (2 bracket types,
depth <= 8; the formal-language setting of "Post-Norm can Resharpen Attention", seed 003), trained at 64
tokens and evaluated to 16x that, small enough for 2 CPU cores. Its headline is the per-token loss (seed
000's measure): the task's own ``legal_accuracy`` can be gamed at long lengths by always predicting an opening
bracket (legal everywhere below the maximum depth), so it is reported beside the loss, not as the headline.
At this scale counting, passkey, set complement and MQAR showed no difference between variants (every variant
fails alike beyond the training length, or none learns the task in a few hundred CPU steps).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

from lengthgen.attention import FIELDS, PRESETS, AttentionSpec, resolve_spec
from lengthgen.eval import MULTIPLES, Comparison, RunEval, eval_source, evaluate
from lengthgen.report import write_report
from lengthgen.train import train
from lengthgen.data.config import make_source
from lengthgen.train.config import RunConfig, load_config
from lengthgen.train.setup import check_source_lengths

DEFAULT_VARIANTS = ("baseline", "l2", "avnorm", "sqrt_log_n", "scale_invariant")

#: The embedded default experiment (overridden by --config / --set).
DEFAULT_CONFIG: dict[str, Any] = {
    "name": "compare-dyck",
    "model": {"dim": 64, "layers": 2, "heads": 4, "mlp_ratio": 4.0, "norm": "layer", "norm_placement": "pre"},
    "train": {"steps": 400, "lr": 3e-3, "schedule": "cosine", "warmup_steps": 20, "batch_size": 32,
              "grad_clip": 1.0, "eval_batches": 0, "threads": 1, "log_every": 50},
    "data": {"kind": "task", "task": "dyck", "length": 64},
}
DEFAULT_METRIC = "loss"


def base_config(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The experiment's config: a TOML file, else the embedded default; then ``--set`` overrides."""
    cfg = load_config(config) if config else RunConfig.from_dict(DEFAULT_CONFIG)
    return cfg.override(*overrides)


def default_metric(cfg: RunConfig) -> str | None:
    """The embedded default's headline (loss) while its task is unchanged; otherwise the task's own metric."""
    return DEFAULT_METRIC if cfg.data.task == DEFAULT_CONFIG["data"]["task"] else None


def parse_variants(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """Comma-separated preset names, validated (ValueError names the bad one and the choices)."""
    names = [v.strip() for v in (text.split(",") if isinstance(text, str) else text) if v.strip()]
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"unknown variant {name!r}; choose among the attention presets: {', '.join(PRESETS)}")
    if not names:
        raise ValueError("no variants given; e.g. --variants baseline,l2")
    return names


def check_metric(source, metric: str | None) -> str:
    """The headline metric: ``metric`` if the source reports it (``loss`` always), else ValueError; None: the
    source's own."""
    if metric is None:
        return source.metric
    if metric not in ("loss", source.metric):
        raise ValueError(f"metric {metric!r} is not reported by {source.name!r}; choose loss or {source.metric}")
    return metric


def variant_spec(base: AttentionSpec, variant: str) -> AttentionSpec:
    """``variant``'s preset applied on top of the config's attention spec: the fields in which the preset
    differs from ``baseline`` replace the base's, so ``position="nope"`` in the config makes every variant NoPE."""
    preset = PRESETS[variant]
    changes = {f: getattr(preset, f) for f in FIELDS if getattr(preset, f) != getattr(PRESETS["baseline"], f)}
    return base.replace(**changes)


def run_compare(cfg: RunConfig, out: str | Path, *, variants: list[str] = list(DEFAULT_VARIANTS),
                eval_lengths: list[int] | None = None, seeds: list[int] = (0,), eval_tokens: int = 8192,
                metric: str | None = None, progress: bool = True, log: Callable[[str], None] = print
                ) -> Comparison:
    """Train every (variant, seed) on ``cfg`` into ``out/runs/<variant>-seed<seed>`` and evaluate it at
    ``eval_lengths`` (default: the training length times `MULTIPLES`) with the one evaluator, under the run's
    own device and autocast. ``metric``: the report's headline (default: the source's; ``loss`` always works).
    Writes ``results.json`` and the report into ``out``; returns the `Comparison`."""
    if not seeds:
        raise ValueError("no seeds given; e.g. --seeds 1")
    out = Path(out)
    train_length = max(cfg.lengths())
    multiples = ",".join(map(str, MULTIPLES))
    key = "--eval-lengths" if eval_lengths else f"--eval-lengths (default {train_length} x {multiples})"
    eval_lengths = sorted(set(eval_lengths or [train_length * m for m in MULTIPLES]))
    source = make_source(cfg.data)
    metric = check_metric(source, metric)
    evaluated_on = eval_source(cfg.data, source)      # text: single long validation documents
    check_source_lengths(evaluated_on, key, eval_lengths)   # before any training
    base = resolve_spec(cfg.model.attention)
    specs = {variant: variant_spec(base, variant) for variant in variants}
    runs: dict[str, list[RunEval]] = {}
    for variant, spec in specs.items():
        runs[variant] = []
        for seed in seeds:
            run_cfg = cfg.override(f"train.seed={seed}")
            run_cfg.model = run_cfg.model.replace(attention=spec)
            name, start = f"{variant}-seed{seed}", time.perf_counter()
            log(f"[{name}] training {run_cfg.train.steps} steps at length {train_length}")
            trained = train(run_cfg, out / "runs" / name, progress=progress)
            train_s = round(time.perf_counter() - start, 2)
            evaluation = evaluate(trained.model, evaluated_on, eval_lengths, tokens_per_length=eval_tokens,
                                  seed=seed, autocast=trained.trainer.autocast_dtype)
            log(f"[{name}] trained in {train_s:.0f} s; {metric} at length " + ", ".join(
                f"{r.length}: {r.at_length.get(metric, math.nan):.4g}" for r in evaluation.lengths) +
                f" (evaluated in {time.perf_counter() - start - train_s:.0f} s)")
            runs[variant].append(dataclasses.replace(
                evaluation, config=trained.config.to_dict(), seed=seed, run_dir=str(trained.run_dir),
                final_train_loss=trained.history[-1] if trained.history else None, train_seconds=train_s))
    name = getattr(source, "name", cfg.data.task)
    results = Comparison(
        title=f"lengthgen compare: {name}", source=name, metric=metric,
        higher_is_better=source.higher_is_better if metric == source.metric else False, train_length=train_length,
        eval_lengths=eval_lengths, config=cfg.to_dict(), provenance=evaluation.provenance,
        specs={variant: spec.to_dict() for variant, spec in specs.items()}, variants=runs)
    results.save(out / "results.json")
    write_report(results, out)
    return results
