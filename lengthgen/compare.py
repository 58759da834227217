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

import json
import time
from pathlib import Path
from typing import Any, Callable

from lengthgen.attention import FIELDS, PRESETS, AttentionSpec, resolve_spec
from lengthgen.data.config import make_source
from lengthgen.eval.evaluate import evaluate
from lengthgen.train import train
from lengthgen.train.config import RunConfig, load_config
from lengthgen.train.position_eval import position_eval_source

DEFAULT_VARIANTS = ("baseline", "l2", "avnorm", "sqrt_log_n", "scale_invariant")
MULTIPLES = (1, 2, 4, 8, 16)

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


def check_metric(task, metric: str | None) -> str:
    """The headline metric: ``metric`` if the task reports it (``loss`` always), else ValueError; None: the task's."""
    if metric is None:
        return task.metric
    if metric not in ("loss", task.metric):
        raise ValueError(f"metric {metric!r} is not reported by task {task.name!r}; choose loss or {task.metric}")
    return metric


def variant_spec(base: AttentionSpec, variant: str) -> AttentionSpec:
    """``variant``'s preset applied on top of the config's attention spec: the fields in which the preset
    differs from ``baseline`` replace the base's, so ``position="nope"`` in the config makes every variant NoPE."""
    preset = PRESETS[variant]
    changes = {f: getattr(preset, f) for f in FIELDS if getattr(preset, f) != getattr(PRESETS["baseline"], f)}
    return base.replace(**changes)


def run_compare(cfg: RunConfig, out: str | Path, *, variants: list[str] = list(DEFAULT_VARIANTS),
                eval_lengths: list[int] | None = None, seeds: list[int] = (0,), eval_tokens: int = 8192,
                metric: str | None = None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Train every (variant, seed) on ``cfg`` and evaluate at ``eval_lengths`` (default: the training length
    times 1, 2, 4, 8, 16). ``metric``: the report's headline (default: the task's; ``loss`` always works).
    Writes ``results.json`` and the report into ``out``; returns the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_length = max(cfg.lengths())
    eval_lengths = sorted(set(eval_lengths or [train_length * m for m in MULTIPLES]))
    task = make_source(cfg.data)
    metric = check_metric(task, metric)
    eval_source = position_eval_source(cfg.data, task)      # text: single long validation documents
    results: dict[str, Any] = {
        "config": cfg.to_dict(), "task": getattr(task, "name", cfg.data.task), "metric": metric,
        "higher_is_better": task.higher_is_better if metric == task.metric else False, "train_length": train_length, "eval_lengths": eval_lengths,
        "specs": {}, "variants": {},
    }
    base = resolve_spec(cfg.model.attention)
    for variant in variants:
        spec = variant_spec(base, variant)
        results["specs"][variant] = spec.to_dict()
        runs = []
        for seed in seeds:
            run_cfg = cfg.override(f"train.seed={seed}")
            run_cfg.model = run_cfg.model.replace(attention=spec)
            start = time.perf_counter()
            log(f"[{variant} seed {seed}] training {run_cfg.train.steps} steps at length {train_length}")
            trained = train(run_cfg, out / "runs" / f"{variant}-seed{seed}", progress=progress)
            train_s = time.perf_counter() - start
            log(f"[{variant} seed {seed}] evaluating at {', '.join(map(str, eval_lengths))}")
            evals = evaluate(trained.model, eval_source, eval_lengths, tokens_per_length=eval_tokens, seed=1000 + seed)
            runs.append({"seed": seed, "train_seconds": round(train_s, 2),
                         "final_train_loss": trained.history[-1] if trained.history else None,
                         "eval_seconds": round(time.perf_counter() - start - train_s, 2), "evals": evals})
        results["variants"][variant] = runs
    (out / "results.json").write_text(json.dumps(results, indent=1))
    from lengthgen.report import write_report
    write_report(results, out)
    return results
