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
import functools
import time
from pathlib import Path
from typing import Any, Callable

from lengthgen.attention import FIELDS, PRESETS, AttentionSpec, resolve_spec
from lengthgen.config import ConfigError, check_value
from lengthgen.eval import MULTIPLES, Comparison, RunEval, eval_source, evaluate
from lengthgen.report import write_report
from lengthgen.train import train
from lengthgen.train.config import RunConfig, load_config
from lengthgen.train.run_folder import check_fresh, lock
from lengthgen.train.setup import check_length, resolve

DEFAULT_VARIANTS = ("baseline", "l2", "avnorm", "sqrt_log_n", "scale_invariant")

#: The embedded default experiment (overridden by --config / --set).
DEFAULT_CONFIG: dict[str, Any] = {
    "name": "compare-dyck",
    "model": {"dim": 64, "layers": 2, "heads": 4, "mlp_ratio": 4.0, "norm": "layer", "norm_placement": "pre"},
    "train": {"steps": 400, "lr": 3e-3, "schedule": "cosine", "warmup_steps": 20, "batch_size": 32,
              "grad_clip": 1.0, "eval_batches": 0, "threads": 1},
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
                metric: str | None = None, progress: bool = True, resume: bool = False, overwrite: bool = False,
                log: Callable[[str], None] = print) -> Comparison:
    """Train every (variant, seed) on ``cfg`` into ``out/runs/<variant>-seed<seed>`` and evaluate it at
    ``eval_lengths`` (default: the training length times `MULTIPLES`) with the one evaluator, under the run's
    own device and autocast. ``metric``: the report's headline (default: the source's; ``loss`` always works).
    ``out`` must be empty (``overwrite``: emptied first) unless ``resume``: then finished runs there are reused
    and interrupted ones continued, each after `lengthgen.train.train` checks its config. Every argument, variant
    and evaluation length is checked before anything is trained. Writes ``results.json`` and the report into
    ``out``; returns the `Comparison`."""
    seeds = check_value("seeds", list(seeds), list[int], ge=0)
    if not seeds or len(set(seeds)) < len(seeds):
        raise ConfigError(f"seeds={seeds} is not valid; give one or more different seeds, e.g. [0, 1]", "seeds")
    eval_tokens = check_value("eval_tokens", eval_tokens, int, ge=1)
    out = Path(out)
    cfg, source = resolve(cfg)
    train_length = max(cfg.lengths())
    eval_lengths = sorted(set(eval_lengths or [train_length * m for m in MULTIPLES]))
    for length in eval_lengths:
        check_length(source, "eval_lengths", length)
    metric = check_metric(source, metric)
    base = resolve_spec(cfg.model.attention)
    specs = {variant: variant_spec(base, variant) for variant in parse_variants(variants)}
    configs = {(variant, seed): dataclasses.replace(cfg.override(f"train.seed={seed}"),
                                                    model=cfg.model.replace(attention=spec))
               for variant, spec in specs.items() for seed in seeds}
    evaluate_run = functools.partial(_train_and_evaluate, evaluated_on=eval_source(cfg.data, source),
                                     eval_lengths=eval_lengths, eval_tokens=eval_tokens, progress=progress, log=log)
    with lock(out):
        if not resume:
            check_fresh(out, overwrite=overwrite)
        runs = {variant: [evaluate_run(configs[variant, seed], out / "runs" / f"{variant}-seed{seed}", resume,
                                       f"[{variant} seed {seed}]") for seed in seeds] for variant in specs}
        name = getattr(source, "name", cfg.data.task)
        results = Comparison(
            title=f"lengthgen compare: {name}", source=name, metric=metric,
            higher_is_better=source.higher_is_better if metric == source.metric else False,
            train_length=train_length, eval_lengths=eval_lengths, config=cfg.to_dict(),
            provenance=runs[next(iter(specs))][0].provenance,
            specs={variant: spec.to_dict() for variant, spec in specs.items()}, variants=runs)
        results.save(out / "results.json")
        write_report(results, out)
    return results


def _train_and_evaluate(run_cfg: RunConfig, run_dir: Path, resume: bool, label: str, *, evaluated_on: Any,
                        eval_lengths: list[int], eval_tokens: int, progress: bool, log: Callable[[str], None]
                        ) -> RunEval:
    """Train one run (resume: reuse or continue the one in ``run_dir``) and evaluate it. ``train_seconds`` is
    that of a run trained from step 0 in this call, else None."""
    seed, steps = run_cfg.train.seed, run_cfg.train.steps
    log(f"{label} training {steps} steps at length {max(run_cfg.lengths())}" + (" (resuming)" if resume else ""))
    start = time.perf_counter()
    trained = train(run_cfg, run_dir, progress=progress, resume=resume)
    started = trained.trainer.start_step
    train_s = round(time.perf_counter() - start, 2) if started == 0 else None
    if started:
        log(f"{label} {'reused the finished run' if started == steps else f'resumed at step {started}'} {run_dir}")
    log(f"{label} evaluating at {', '.join(map(str, eval_lengths))}")
    evaluation = evaluate(trained.model, evaluated_on, eval_lengths, tokens_per_length=eval_tokens, seed=seed,
                          autocast=trained.trainer.autocast_dtype)
    return dataclasses.replace(evaluation, config=trained.config.to_dict(), seed=seed, run_dir=str(trained.run_dir),
                               final_train_loss=trained.history[-1] if trained.history else None,
                               train_seconds=train_s, train_tokens=trained.trainer.tokens)
