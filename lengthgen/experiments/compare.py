"""`lengthgen compare`: train several variants at a short length, evaluate them far beyond it, and write a report
folder (``results.json``, ``report.md``, ``extrapolation.png``, ``diagnostics.png``).

A variant is an attention preset applied on top of the config's attention spec, or a named table of config
changes in the config's ``[compare]`` section (`CompareConfig`), which holds a whole experiment: its variants,
optional *bases* (changes applied before each variant; every base x variant is one run, named
``base/variant``), seeds, evaluation lengths and tokens. With ``pretrain_steps`` it is seed 000's retrofit
protocol: per base and seed one run is pretrained for that many steps, then every variant is finetuned from it
for ``train.steps`` steps with a fresh optimizer (`lengthgen.experiments.retrofit.finetune_config`); the variant
without changes is the base continued the same number of steps. A run with BEMA on is also evaluated with its
BEMA weights, as variant ``name+bema``. With ``workers`` > 1, that many runs train and evaluate at once, each in its
own process (`lengthgen.experiments.jobs`), with the results of a sequential comparison.

The embedded default needs no download and no GPU: next-token prediction on a Dyck language (2 bracket types,
depth <= 8; the formal-language setting of "Post-Norm can Resharpen Attention", seed 003), trained at 64
tokens and evaluated to 16x that, small enough for 2 CPU cores. Its headline is the per-token loss (seed
000's measure); the task's ``tvd`` (to the next token's law, seed 003's measure) and ``legal_accuracy`` are
reported beside it.
At this scale counting, passkey, set complement and MQAR showed no difference between variants (every variant
fails alike beyond the training length, or none learns the task in a few hundred CPU steps).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lengthgen.attention import PRESETS
from lengthgen.config import (FOLDER_NAME, MAX_SIZE, ConfigError, ConfigWarning, build, check, counted, folder_name,
                              invalid, leaves, option)
from lengthgen.data.config import make_source
from lengthgen.data.tasks.base import metric_directions
from lengthgen.eval import Comparison, ResultsError, RunEval, check_needles
from lengthgen.experiments.eval_run import checked_lengths
from lengthgen.experiments.jobs import Job, Runner
from lengthgen.experiments.needle import needle_filler
from lengthgen.experiments.retrofit import finetune_config
from lengthgen.model import GPT
from lengthgen.report import write_report
from lengthgen.report.stats import ALPHA, smallest_p
from lengthgen.train.config import RunConfig, load_config
from lengthgen.train.optim import build_optimizers
from lengthgen.train.run_folder import RunFolderError, check_fresh, check_kind, checkpoints_at, lock, saved_run_config
from lengthgen.train.setup import (check_backend, check_lengths, check_memory, check_resume, device_type,
                                   fill_model_from_source, resolve)

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


@dataclass
class CompareConfig:
    """The ``[compare]`` section of a run config: everything `lengthgen compare` runs (see the module doc).

    A change table maps config keys to values, nested (``{model.norm_placement = "post"}`` in TOML) and
    merged into the run config: ``{model.attention.out_norm = "head_layer"}`` changes one attention field."""

    variants: dict[str, Any] = option({}, "name -> config changes; empty: attention presets (DEFAULT_VARIANTS or "
                                      "--variants)")
    bases: dict[str, Any] = option({}, "name -> config changes applied before each variant's; runs are named "
                                   "base/variant")
    pretrain_steps: int = option(0, "> 0: pretrain each base this many steps, then finetune every variant from "
                                 "it for train.steps steps with a fresh optimizer (seed 000)", ge=0)
    seeds: list[int] = option([0], "train.seed of each run of a variant (--seeds N: 0, 1, ..., N-1)", ge=0,
                              le=2**63 - 1)
    eval_lengths: list[int] = option([], "evaluation lengths (default: the training length x 1, 2, 4, 8, 16, up "
                                     "to the data's maximum length)", ge=1, le=MAX_SIZE)
    eval_tokens: int = option(8192, "tokens per evaluated length", ge=1, le=MAX_SIZE)
    metric: str | None = option(None, "the report's headline: loss, the source's metric or one it also reports "
                                "(default: the source's)")
    needle_depths: list[float] = option([], "retrieval maps at these needle depths and the eval lengths, e.g. [0, "
                                        "0.5, 1] (passkey, mqar, text; empty: none)", ge=0, le=1)
    needle_samples: int = option(100, "sequences per retrieval-map cell", ge=1)
    workers: int = option(1, "runs trained and evaluated at once, each in its own process with train.threads CPU "
                          "threads (results equal a sequential run's)", ge=1)

    def __post_init__(self) -> None:
        check(self)
        if not self.seeds or len(set(self.seeds)) < len(self.seeds):
            raise invalid("CompareConfig.seeds", self.seeds,
                          "one or more different seeds, e.g. [0, 1, 2, 3] (4 or more let the rule name a winner)")
        for key in ("variants", "bases"):
            for name, changes in getattr(self, key).items():
                if not isinstance(changes, dict) or not folder_name(name):
                    # a run's folder is runs/BASE/VARIANT-seedN: base "" put it at /VARIANT-seedN, ".." beside runs/
                    raise invalid(f"CompareConfig.{key}.{name}", changes, f"a table of config changes, under "
                                  f"{FOLDER_NAME}")
                train = changes.get("train")
                if isinstance(train, dict) and "seed" in train:   # it would replace every seed: n copies of one run
                    raise ConfigError(f"compare.{key}.{name} sets train.seed, which compare.seeds sets for every run "
                                      "(each seed is one run); leave it out", f"compare.{key}.{name}")


def compare_config(cfg: RunConfig) -> CompareConfig:
    """The run config's ``compare`` section, checked (errors name ``compare.<key>``)."""
    try:
        return build(CompareConfig, cfg.compare)
    except ConfigError as err:
        raise err.under("compare") from None


def base_config(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The experiment's config: a TOML file, else the embedded default; then ``--set`` overrides."""
    cfg = load_config(config) if config else RunConfig.from_dict(DEFAULT_CONFIG)
    cfg = cfg.override(*overrides)
    compare_config(cfg)
    return cfg


def default_metric(cfg: RunConfig) -> str | None:
    """The embedded default's headline (loss) while its task is unchanged; otherwise the task's own metric."""
    return DEFAULT_METRIC if cfg.data.task == DEFAULT_CONFIG["data"]["task"] else None


def parse_variants(text: str | list[str] | tuple[str, ...], defined: dict[str, Any] | None = None) -> list[str]:
    """Comma-separated names of ``defined`` changes or attention presets, validated (ValueError names the bad
    one and the choices)."""
    choices = list(dict.fromkeys([*(defined or {}), *PRESETS]))    # a config variant may reuse a preset's name
    names = [v.strip() for v in (text.split(",") if isinstance(text, str) else text) if v.strip()]
    for name in names:
        if name not in choices:
            raise ValueError(f"unknown variant {name!r}; choose among {', '.join(choices)}")
    if not names:
        raise ValueError("no variants given; e.g. --variants baseline,l2")
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise ValueError(f"variant {repeated!r} is named twice; name each variant once (--seeds runs it again)")
    return names


def check_metric(source, metric: str | None) -> tuple[str, bool]:
    """The headline metric and whether higher is better: ``metric`` if the source reports it (``loss`` always),
    else a `ConfigError` naming compare.metric; None: the source's own."""
    directions = metric_directions(source)
    metric = source.metric if metric is None else metric
    if metric not in directions:
        raise ConfigError(f"compare.metric={metric!r} is not reported by {source.name!r}; choose "
                          f"{', '.join(directions)}", "compare.metric")
    return metric, directions[metric]


def apply_variant(cfg: RunConfig, name: str, changes: dict[str, Any] | None, key: str) -> RunConfig:
    """``cfg`` with a variant's change table applied key by key (`RunConfig.changed`); ``changes`` None is the
    attention preset ``name`` on top of the config's attention (``model.attention.preset = name``, as `set_key`
    applies it). Errors name ``key`` (``compare.variants.<name>``)."""
    if changes is None:
        changes = {"model": {"attention": {"preset": name}}}
    try:
        return cfg.changed(leaves(changes))
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}", key) from None


@dataclass
class Plan:
    """The runs of a comparison: run name -> (base name or None, variant name), and each base's config."""
    compare: CompareConfig
    runs: dict[str, tuple[str | None, str]]
    bases: dict[str | None, RunConfig]

    def config(self, run: str, seed: int, pretrained: str | Path | None = None) -> RunConfig:
        """The config of ``run`` with ``seed``: its base's, finetuned from ``pretrained`` when given (keeping the
        base's ``train.checkpoint_every``, so that ``--resume`` continues a finetune cut short), with the variant
        applied last."""
        base, variant = self.runs[run]
        cfg = self.bases[base].override(f"train.seed={seed}")
        if pretrained is not None:
            cfg = finetune_config(cfg, pretrained, cfg.train.steps,
                                  [f"train.checkpoint_every={cfg.train.checkpoint_every}"])
        return apply_variant(cfg, variant, self.compare.variants.get(variant), f"compare.variants.{variant}")

    def pretrain_config(self, base: str | None, seed: int) -> RunConfig:
        return self.bases[base].override(f"train.seed={seed}", f"train.steps={self.compare.pretrain_steps}")


def plan(cfg: RunConfig, variants: list[str] | None = None, bases: list[str] | None = None) -> Plan:
    """Every run of the comparison, each config checked before anything trains."""
    cc = compare_config(cfg)
    variants = parse_variants(variants or list(cc.variants) or list(DEFAULT_VARIANTS), cc.variants)
    base_names: list[str | None] = list(bases or cc.bases) or [None]
    for name in base_names:
        if name is not None and name not in cc.bases:
            raise ValueError(f"unknown base {name!r}; the config's compare.bases: {', '.join(cc.bases) or 'none'}")
    base_cfgs = {name: cfg if name is None else apply_variant(cfg, name, cc.bases[name], f"compare.bases.{name}")
                 for name in base_names}
    runs = {(variant if base is None else f"{base}/{variant}"): (base, variant)
            for base in base_names for variant in variants}
    result = Plan(cc, runs, base_cfgs)
    for run in runs:
        run_cfg = result.config(run, 0, "pretrained" if cc.pretrain_steps else None)
        _check_comparable(cfg, run_cfg, *runs[run], cc)
        if cc.workers > 1 and not run_cfg.train.threads:
            raise ConfigError(f"compare.workers={cc.workers} runs several runs at once: set train.threads (each "
                              "run's CPU threads, e.g. 1), so they share the cores", "compare.workers")
        with torch.device("meta"):              # the layers' specs, without weights (any vocabulary)
            model = GPT(dataclasses.replace(run_cfg.model, vocab_size=run_cfg.model.vocab_size or 2))
        check_backend(model, run_cfg, torch.device(device_type(run_cfg.train)))
        build_optimizers(model, run_cfg.train)  # the optimizer keys against the parameters (patterns, Muon's keys)
        if run_cfg.train.init_from and not cc.pretrain_steps:
            checkpoints_at(run_cfg.train.init_from)
    return result


def _check_comparable(cfg: RunConfig, run_cfg: RunConfig, base: str | None, variant: str, cc: CompareConfig
                      ) -> None:
    """`ConfigError` naming the base or variant that makes a run train on another task or kind of data, or at
    another training length, than the comparison: its report measures every run with one metric and from one
    training length (a variant at data.length 32 was reported at "16x the training length" 8; another task
    ended in a KeyError on the headline metric after every run had trained)."""
    what = lambda c: (c.data.kind, c.data.task, max(c.lengths()))  # noqa: E731
    if what(run_cfg) == what(cfg):
        return
    base_cfg = cfg if base is None else apply_variant(cfg, base, cc.bases[base], "")
    key = f"compare.variants.{variant}" if what(base_cfg) == what(cfg) else f"compare.bases.{base}"
    kind, task, length = what(run_cfg)
    raise ConfigError(f"{key} trains on {kind} {task!r} at length {length}, the comparison on {cfg.data.kind} "
                      f"{cfg.data.task!r} at length {max(cfg.lengths())}: one report measures every run with one "
                      "metric from one training length; leave data.kind, data.task, data.length and train.stages "
                      "to the config (--task, --train-length), or compare them in separate comparisons", key)


def run_compare(cfg: RunConfig, out: str | Path, *, variants: list[str] | None = None,
                bases: list[str] | None = None, progress: bool = True, resume: bool = False, overwrite: bool = False,
                log: Callable[[str], None] = print) -> Comparison:
    """Train every (base, variant, seed) of ``cfg``'s `CompareConfig` into ``out/runs/<run>-seed<seed>`` (with
    ``pretrain_steps``: finetuned from ``out/pretrain/<base>-seed<seed>``) and evaluate it at the eval lengths
    with the one evaluator, under the run's own device and autocast. ``variants`` / ``bases``: which to run
    (default: all the config defines; attention presets for variants it does not). Every run's config and every
    evaluation length are checked before anything trains. ``out`` must be empty (``overwrite``: emptied first)
    unless ``resume``: then finished runs there are reused and interrupted ones continued, each after
    `lengthgen.train.train` checks its config. Writes ``results.json`` and the report into ``out``; returns the
    `Comparison`."""
    out, runs = Path(out), plan(cfg, variants, bases)
    cc = runs.compare
    cfg, source = resolve(cfg)
    sources = {_data_key(cfg): source}
    train_length = max(cfg.lengths())
    eval_lengths = checked_lengths(cfg, source, cc.eval_lengths, "compare.eval_lengths")
    for base, base_cfg in runs.bases.items():     # each run's data and lengths, checked before anything trains
        if base is not None:
            _resolved(base_cfg, sources, f"compare.bases.{base}")
    for run in runs.runs:       # a variant's model may need more memory than the config's at the longest length
        run_cfg = runs.config(run, cc.seeds[0], "pretrained" if cc.pretrain_steps else None)
        _resolved(run_cfg, sources, f"compare.variants.{runs.runs[run][1]}")
        check_memory(run_cfg, f"compare.eval_lengths (run {run})", eval_lengths[-1])
    if cc.needle_depths:
        check_needles(needle_filler(cfg.data, source), eval_lengths, cc.needle_depths, 1, "compare.needle_depths")
    elif cc.needle_samples != CompareConfig().needle_samples:
        warnings.warn(f"compare.needle_samples={cc.needle_samples}: no effect without compare.needle_depths (no "
                      "retrieval maps), e.g. compare.needle_depths=[0, 0.5, 1]", ConfigWarning, stacklevel=2)
    metric, higher_is_better = check_metric(source, cc.metric)
    _warn_unused(cfg, runs, sorted({train_length, *eval_lengths}))
    _warn_seeds(runs, cfg.train.bema.enabled)
    folders = {(name, seed): f"{name}-seed{seed}" for name in runs.runs for seed in cc.seeds}   # under out/runs
    with lock(out), Runner(cc.workers, log) as runner:
        if resume:
            check_kind(out, "comparison")
            _check_kept(out / "runs", set(folders.values()))
            pretrain = _pretrain_folders(runs, out / "pretrain") if cc.pretrain_steps else {}
            _check_resumable([(runs.pretrain_config(base, seed), folder) for (base, seed), folder in pretrain.items()]
                             + [(runs.config(name, seed, pretrain.get((runs.runs[name][0], seed))),
                                 out / "runs" / folder) for (name, seed), folder in folders.items()], sources)
        else:
            check_fresh(out, overwrite=overwrite, kind="comparison")
        pretrained = _pretrain(runs, out / "pretrain", resume, progress, runner) if cc.pretrain_steps else {}
        jobs = [Job(runs.config(name, seed, pretrained.get((runs.runs[name][0], seed))), out / "runs" / folder,
                    f"{name} seed {seed}", name, tuple(eval_lengths), cc.eval_tokens, metric,
                    tuple(cc.needle_depths), cc.needle_samples, resume, progress)
                for (name, seed), folder in folders.items()]
        results: dict[str, list[RunEval]] = {}
        for key, evaluation in (pair for pairs in runner.run(jobs) for pair in pairs):
            results.setdefault(key, []).append(evaluation)
        source_name = getattr(source, "name", cfg.data.task)
        comparison = Comparison(
            title=f"lengthgen compare: {source_name}", source=source_name, metric=metric,
            higher_is_better=higher_is_better, directions=metric_directions(source),
            train_length=train_length, eval_lengths=eval_lengths, config=cfg.to_dict(),
            provenance=results[next(iter(results))][0].provenance,
            specs={key: evals[0].config["model"]["attention"] for key, evals in results.items()}, variants=results,
            **_protocol(cc, runs, pretrained))
        if resume:
            comparison = _as_before(comparison, out / "results.json", log)
        comparison.save(out / "results.json")
        write_report(comparison, out)
    return comparison


def _as_before(comparison: Comparison, path: Path, log: Callable[[str], None]) -> Comparison:
    """The comparison saved at ``path`` when the resumed ``comparison`` differs from it only in when and how fast
    it was evaluated (every run was finished): its results and report are then written again byte for byte, and the
    log says so. Else ``comparison``."""
    try:
        saved = Comparison.load(path)
    except (FileNotFoundError, ResultsError):
        return comparison
    if _undated(saved) != _undated(comparison):
        return comparison
    log(f"nothing changed: every run was finished and evaluates as before; {path.name} and report.md are as they "
        "were")
    return saved


def _undated(value: Any) -> Any:
    """A comparison (its `dataclasses.asdict` at the top) as JSON text without its provenances' dates and its
    ``eval_seconds``."""
    if dataclasses.is_dataclass(value):
        return json.dumps(_undated(dataclasses.asdict(value)), sort_keys=True)
    if isinstance(value, dict):
        return {k: {**v, "date": None} if k == "provenance" else _undated(v) for k, v in value.items()
                if k != "eval_seconds"}
    return [_undated(v) for v in value] if isinstance(value, (list, tuple)) else value


def _warn_unused(cfg: RunConfig, runs: Plan, lengths: list[int]) -> None:
    """One `ConfigWarning` per note of `RunConfig.unused` at ``lengths`` (those the comparison trains and evaluates
    at): the base config's, then each note a run adds about a key its base or variant changes, naming the variants
    whose runs have it. A key a run inherits and only turns off (the config's ``prope_fraction`` in a NoPE base) is
    not its note: turning it off was the point."""
    base, values = cfg.unused(lengths), dict(leaves(cfg.to_dict()))
    having: dict[str, list[str]] = {}
    for run in runs.runs:
        run_cfg = runs.config(run, runs.compare.seeds[0], "pretrained" if runs.compare.pretrain_steps else None)
        changed = [".".join(path) for path, value in leaves(run_cfg.to_dict()) if values.get(path) != value]
        for note in run_cfg.unused(lengths):
            if note not in base and any(f"{key}=" in note for key in changed):
                having.setdefault(note, []).append(run)
    for note in base:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    for note, names in having.items():
        warnings.warn(f"variant{'s' if len(names) > 1 else ''} {', '.join(names)}: {note}", ConfigWarning,
                      stacklevel=2)


def _warn_seeds(runs: Plan, bema: bool) -> None:
    """A `ConfigWarning` when the comparison has several seeds but too few for the rule (`lengthgen.report.stats`)
    ever to name a variant best: said before the training, not only in the report (one seed: the report says why)."""
    seeds, smallest = len(runs.compare.seeds), smallest_p(len(runs.compare.seeds))
    if (len(runs.runs) > len(runs.bases) or bema) and smallest is not None and smallest > ALPHA:
        warnings.warn(f"compare.seeds: no variant can be named best: {seeds} seeds separate two variants at p = "
                      f"{smallest:.2g} at best (2 / C({2 * seeds}, {seeds})), above {ALPHA}; run 4 seeds or more "
                      "(--seeds 4) for the rule to name one", ConfigWarning, stacklevel=2)


def _check_kept(folder: Path, planned: set[str]) -> None:
    """`RunFolderError` if ``folder`` (a comparison's ``runs/``) holds runs that the resumed plan leaves out: its
    report and results.json would be rewritten without them."""
    held = {str(p.parent.relative_to(folder)) for p in folder.glob("**/run.json")} if folder.is_dir() else set()
    dropped = sorted(held - planned)
    if dropped:
        raise RunFolderError(f"{folder.parent} holds runs this --resume does not plan ({', '.join(dropped)}): its "
                             "report would be rewritten without them; name their variants and seeds too (finished "
                             "runs are reused), or run the others into another --out (lengthgen report A B --out M "
                             "merges the two)")


def _data_key(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict()["data"], sort_keys=True)


def _resolved(cfg: RunConfig, sources: dict[str, Any], key: str) -> RunConfig:
    """``cfg`` completed from its data source and its lengths checked, as `lengthgen.train.train` does it (a
    `ConfigError` under ``key`` otherwise); ``sources`` (data config JSON -> source) makes each source once (a text
    corpus is read once)."""
    try:
        data = _data_key(cfg)
        if data not in sources:
            sources[data] = make_source(cfg.data)
        cfg = fill_model_from_source(cfg, sources[data])
        check_lengths(cfg, sources[data])
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}", key) from None
    return cfg


def _check_resumable(planned: list[tuple[RunConfig, Path]], sources: dict[str, Any]) -> None:
    """`ConfigError` before anything trains when a resumed comparison's run (config, folder) was trained with another
    config: another number of steps (a comparison's runs all train the same steps, so compare has no --extend), or
    another key that sets the training trajectory (`check_resume`; found at that run's turn, it left the runs trained
    before it under the new config beside the others). The corpus's location is left to each run's own check, which
    compares the token digests. ``sources``: `_resolved`'s."""
    for cfg, folder in planned:
        saved = saved_run_config(folder)
        if saved is not None and saved.train.steps != cfg.train.steps:
            raise ConfigError(f"compare --resume: {folder} trains {saved.train.steps} steps, now {cfg.train.steps}; "
                              "a comparison's steps stay as they were: resume with the same --steps and "
                              "--pretrain-steps, or run the new steps into another --out", "train.steps")
        if saved is not None:
            check_resume(saved, _resolved(cfg, sources, str(folder)), folder / "config.json", step=0, same_data=True)


def _pretrain_folders(runs: Plan, out: Path) -> dict[tuple, Path]:
    """The pretraining run folder of each (base, seed), absolute (the finetuning runs' ``train.init_from``, the
    same however ``--out`` is spelled at a resume)."""
    return {(base, seed): out.resolve() / f"{base or 'base'}-seed{seed}"
            for base in runs.bases for seed in runs.compare.seeds}


def _pretrain(runs: Plan, out: Path, resume: bool, progress: bool, runner: Runner) -> dict[tuple, Path]:
    """Seed 000's pretraining: one run per (base, seed) of ``pretrain_steps`` steps; their folders."""
    folders = _pretrain_folders(runs, out)
    runner.run([Job(runs.pretrain_config(base, seed), folder, f"pretrain {base or 'base'} seed {seed}",
                    resume=resume, progress=progress) for (base, seed), folder in folders.items()])
    return folders


def _protocol(cc: CompareConfig, runs: Plan, pretrained: dict[tuple, Path]) -> dict[str, Any]:
    """The report's description and the results' ``retrofit`` record of seed 000's protocol (nothing without
    pretraining)."""
    if not cc.pretrain_steps:
        return {}
    bases = {base or "base": cc.bases.get(base, {}) for base in runs.bases}
    steps = next(iter(runs.bases.values())).train.steps
    text = (f"Seed 000's retrofit protocol: each base ({', '.join(f'`{b}`' for b in bases)}) pretrained "
            f"{counted(cc.pretrain_steps, 'step')} per seed (`pretrain/`), then every variant finetuned "
            f"{counted(steps, 'step')} from it with a fresh optimizer; the variant without changes is the base "
            "continued.")
    record = {"pretrain_steps": cc.pretrain_steps, "finetune_steps": steps, "bases": bases,
              "base_runs": {f"{base or 'base'}-seed{seed}": str(path) for (base, seed), path in pretrained.items()}}
    return {"description": text, "retrofit": record}
