"""Command line: ``lengthgen <command> ...`` (also ``python -m lengthgen <command> ...``).

The top layer: each command parses its arguments and calls the layers below (`lengthgen.experiments`,
`lengthgen.train`, `lengthgen.report`). A subcommand is one function decorated with `command`, whose
docstring is its help and whose ``add_arguments`` callback declares its options::

    def _eval_args(p): p.add_argument("run")
    @command("eval", _eval_args)
    def eval_command(args) -> int: ...
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path


class CommandError(Exception):
    """A bad command-line argument; printed as a one-line error (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``lengthgen train: error: ...``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give a positive integer")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number >= 0") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not valid; give a finite number >= 0")
    return value


Handler = Callable[[argparse.Namespace], int]
#: name -> (add_arguments, handler)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler]] = {}


def command(name: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``handler(args) -> exit code`` as subcommand ``name``."""
    def register(handler: Handler) -> Handler:
        COMMANDS[name] = (add_arguments, handler)
        return handler
    return register


CONFIG_HELP = "Every config key with its meaning and valid values: lengthgen config show [CONFIG] [--set ...]."
SEEDS_HELP = ("Seeds, the notes cited by number: 000 AVnorm (per-head output norm), 001 p-softmax (\"Attention\n"
              "Normalizes the Wrong Norm\"), 002 a note on normalization, 003 post-norm resharpens attention,\n"
              "004 long-context attention (sqrt(2 log n) logit scaling).")


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set key=value`` (shared by commands that take a run config)."""
    p.add_argument("--config", "-c", help="TOML config (e.g. configs/counting.toml); defaults if omitted")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.attention=l2 --set train.steps=200 "
                        "(values are TOML literals, else strings; keys: lengthgen config show)")


def add_logging_arguments(p: argparse.ArgumentParser) -> None:
    """``--log-every``, ``--wandb`` and ``--no-progress`` (shared by the commands that train)."""
    p.add_argument("--log-every", type=int, metavar="N", help="log every N steps (sets train.log_every)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log to this Weights & Biases project (sets "
                   "train.wandb; needs pip install wandb; WANDB_MODE=offline works without a network)")
    p.add_argument("--no-progress", action="store_true",
                   help="plain log lines instead of a progress bar (the default when stdout is not a terminal)")


def logging_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides that ``--log-every`` and ``--wandb`` stand for."""
    return ([f"train.log_every={args.log_every}"] if args.log_every is not None else []) + \
        ([f"train.wandb={json.dumps(args.wandb)}"] if args.wandb else [])


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", "-o", help="run folder (default runs/<config name>); it must be empty unless --resume "
                                       "or --overwrite")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest readable "
                   "checkpoint (refused if the config changes the training trajectory)")
    p.add_argument("--extend", action="store_true", help="with --resume: allow a new train.steps, e.g. to train a "
                   "finished run longer (recorded in metrics.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="delete the run in --out and start over")
    add_logging_arguments(p)


@command("train", _train_args)
def train_command(args: argparse.Namespace) -> int:
    """Train a model from a TOML config (+ --set overrides) into a run folder.

    The run folder holds config.json, run.json (versions, git commit, device), metrics.jsonl, TensorBoard
    events (tb/), checkpoints and, when the eval lengths go beyond the training length, eval.json.
    Every config key with its meaning and valid values: lengthgen config show [CONFIG] [--set ...]."""
    from lengthgen.train.config import load_config
    from lengthgen.report import run_summary
    from lengthgen.train import distributed, train

    if args.resume and args.overwrite:
        raise CommandError("--resume continues the run in --out, --overwrite deletes it: give one of them")
    if args.extend and not args.resume:
        raise CommandError("--extend changes train.steps of a resumed run: add --resume")
    cfg = load_config(args.config, args.overrides + logging_overrides(args))
    out = Path(args.out) if args.out else Path("runs") / (cfg.name or (Path(args.config).stem if args.config
                                                                        else "run"))
    try:
        result = train(cfg, out, progress=not args.no_progress, resume=args.resume, overwrite=args.overwrite,
                       extend=args.extend)
    finally:
        rank = distributed.env_world()[0]
        distributed.cleanup()
    if rank != 0:  # torchrun: rank 0 reports
        return 0
    final = f"{result.history[-1]:.4g}" if result.history else "n/a"
    print(f"trained {result.step} steps; final loss {final}; run folder {result.run_dir}")
    if result.evaluation:
        print(run_summary(result.evaluation, getattr(result.trainer.source, "metric", "loss"),
                          train_length=max(result.config.lengths())))
        print(f"by-position results: {result.run_dir / 'eval.json'}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 256,1024") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 256,1024")
    return values


def _compare_args(p: argparse.ArgumentParser) -> None:
    from lengthgen.experiments.compare import DEFAULT_VARIANTS

    add_config_arguments(p)
    p.add_argument("--task", help="task name (counting, mqar, set_complement, ...); sets data.task")
    p.add_argument("--variants", help="comma-separated variants: names in the config's compare.variants or "
                                      f"attention presets (default: the config's, else {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--bases", help="comma-separated names in the config's compare.bases (default: all of them)")
    p.add_argument("--train-length", type=_positive_int, help="training length (sets data.length)")
    p.add_argument("--eval-lengths", type=_int_list, help="comma-separated lengths (default 1,2,4,8,16 x training; "
                                                          "sets compare.eval_lengths)")
    p.add_argument("--steps", type=_positive_int, help="training steps per variant (sets train.steps)")
    p.add_argument("--pretrain-steps", type=_positive_int, help="pretrain each base this many steps, then finetune "
                   "every variant from it (seed 000; sets compare.pretrain_steps)")
    p.add_argument("--seeds", type=_positive_int, help="seeds per variant: 0, 1, ..., N-1; mean and spread are "
                                                      "reported (sets compare.seeds)")
    p.add_argument("--eval-tokens", type=_positive_int, help="tokens per evaluated length (sets compare.eval_tokens)")
    p.add_argument("--workers", type=_positive_int, help="runs at once, each in its own process with train.threads "
                                                        "CPU threads (sets compare.workers)")
    p.add_argument("--metric", help="the report's headline: loss or the source's metric (default: the source's; "
                                    "loss for the embedded default; sets compare.metric)")
    p.add_argument("--out", "-o", default="runs/compare", help="report folder (default runs/compare); it must be "
                                                                 "empty unless --resume or --overwrite")
    p.add_argument("--resume", action="store_true", help="continue an interrupted comparison in --out: reuse its "
                   "finished runs, resume the others (each checked against the config)")
    p.add_argument("--overwrite", action="store_true", help="delete the comparison in --out and start over")
    add_logging_arguments(p)


@command("compare", _compare_args)
def compare_command(args: argparse.Namespace) -> int:
    """Train variants at a short length (or finetune them from pretrained bases), evaluate far beyond it, write a
    report folder. A config's [compare] section holds a whole experiment (see the presets in configs/).

    Without --config: the embedded default (Dyck, length 64, 5 variants; lengthgen config show compare).
    Every config key with its meaning and valid values: lengthgen config show [CONFIG] [--set ...]."""
    from lengthgen.config import ConfigError
    from lengthgen.data.config import make_source
    from lengthgen.experiments.compare import base_config, check_metric, default_metric, plan, run_compare
    from lengthgen.report import terminal_table

    if args.resume and args.overwrite:
        raise CommandError("--resume continues the comparison in --out, --overwrite deletes it: give one of them")
    seeds = None if args.seeds is None else list(range(args.seeds))
    flags = {"data.task": args.task, "data.length": args.train_length, "train.steps": args.steps,
             "compare.seeds": seeds, "compare.eval_lengths": args.eval_lengths,
             "compare.eval_tokens": args.eval_tokens, "compare.pretrain_steps": args.pretrain_steps,
             "compare.metric": args.metric, "compare.workers": args.workers}
    overrides = list(args.overrides) + logging_overrides(args)
    cfg = base_config(args.config, overrides + [f"{k}={v}" for k, v in flags.items() if v is not None])
    if not args.config and "metric" not in cfg.compare and default_metric(cfg):
        cfg = cfg.override(f"compare.metric={default_metric(cfg)}")
    variants, bases = ([v.strip() for v in text.split(",")] if text else None for text in (args.variants, args.bases))
    try:
        check_metric(make_source(cfg.data), cfg.compare.get("metric"))
        plan(cfg, variants, bases)          # every run's config, checked before anything trains
    except ConfigError:
        raise
    except ValueError as err:
        raise CommandError(f"{err}") from None
    results = run_compare(cfg, args.out, variants=variants, bases=bases, progress=not args.no_progress,
                          resume=args.resume, overwrite=args.overwrite)
    print(terminal_table(results))
    plots = ", ".join(sorted(path.name for path in Path(args.out).glob("*.png")))
    print(f"report: {Path(args.out) / 'report.md'} (plots {plots}; raw results.json)")
    return 0


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="compare or retrofit folders (or results.json files) to report on")
    p.add_argument("--out", "-o", help="write results.json and the report here (default: rebuild the report of a "
                                       "single results.json beside it; required when merging several)")


@command("report", _report_args)
def report_command(args: argparse.Namespace) -> int:
    """Rebuild report.md and the plots from existing results.json files (several are merged into --out)."""
    from lengthgen.eval import Comparison
    from lengthgen.report import terminal_table, write_report
    from lengthgen.train.run_folder import lock

    paths = [Path(p) / "results.json" if Path(p).is_dir() else Path(p) for p in args.results]
    if len(paths) > 1 and not args.out:
        raise CommandError("merging several results needs --out, a folder of its own for the merged report")
    out = Path(args.out) if args.out else paths[0].parent
    if len(paths) > 1 and any(out.resolve() == path.parent.resolve() for path in paths):
        raise CommandError(f"--out {out} holds one of the merged results.json; give a folder of its own")
    merged = Comparison.load(paths[0])
    for path in paths[1:]:
        merged.merge(Comparison.load(path), str(path))
    with lock(out):
        if out.resolve() != paths[0].parent.resolve():
            merged.save(out / "results.json")
        write_report(merged, out)
    print(terminal_table(merged))
    print(f"report: {out / 'report.md'}")
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder or checkpoint (omit with --hf)")
    p.add_argument("--lengths", type=_int_list, help="comma-separated lengths (default 1,2,4,8,16 x training)")
    p.add_argument("--tokens", type=_positive_int, default=8192, help="tokens per evaluated length")
    p.add_argument("--bema", action="store_true", help="evaluate the BEMA weights")
    p.add_argument("--hf", metavar="PATH", help="a local Hugging Face model directory instead of a run")
    p.add_argument("--corpus", default="stdlib", help="with --hf: text corpus (stdlib, a path, bin:GLOB)")
    p.add_argument("--tokenizer", help="with --hf: byte, gpt2 or hf:PATH (default: the folder's tokenizer.json)")
    p.add_argument("--out", "-o", help="write the results JSON here (in a lengthgen folder: under its lock)")


@command("eval", _eval_args)
def eval_command(args: argparse.Namespace) -> int:
    """Evaluate a trained run (or a local HF model) by position at lengths far beyond training."""
    from lengthgen.report import run_summary

    if not (args.run or args.hf):
        raise CommandError("give a run folder or checkpoint, or --hf PATH")
    with _writing(Path(args.out)) if args.out else contextlib.nullcontext():
        if args.hf:
            from lengthgen.hf import evaluate_hf

            result = evaluate_hf(args.hf, corpus=args.corpus, lengths=args.lengths or [256, 1024],
                                 tokens=args.tokens, tokenizer=args.tokenizer)
            train_length = None
        else:
            from lengthgen.train.config import RunConfig
            from lengthgen.experiments.eval_run import eval_run

            result = eval_run(args.run, lengths=args.lengths, tokens=args.tokens, bema=args.bema)
            train_length = max(RunConfig.from_dict(result.config).lengths())
        if args.out:
            result.save(args.out)
    print(run_summary(result, train_length=train_length))
    return 0


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 0,0.5,1") from None


def _needle_args(p: argparse.ArgumentParser) -> None:
    from lengthgen.eval import DEPTHS

    p.add_argument("run", nargs="?", help="run folder or checkpoint (omit with --hf)")
    p.add_argument("--lengths", type=_int_list, help="comma-separated context lengths, up to 64x the training length "
                   "(default 1,2,4,8,16 x training; with --hf 256,512,1024,2048)")
    p.add_argument("--depths", type=_float_list, default=list(DEPTHS), help="comma-separated needle depths in [0, 1], "
                   "the fraction of the filler before the needle (default 0,0.1,...,1)")
    p.add_argument("--samples", type=_positive_int, default=100, help="sequences per (depth, length) cell")
    p.add_argument("--needles", type=_positive_int, default=1, help="needles per context, each asked for (RULER's "
                   "multi-query needles; mqar and text; passkey holds one)")
    p.add_argument("--bema", action="store_true", help="map the BEMA weights")
    p.add_argument("--hf", metavar="PATH", help="a local Hugging Face model directory instead of a run")
    p.add_argument("--corpus", default="stdlib", help="with --hf: the filler's text corpus (stdlib, a path, bin:GLOB)")
    p.add_argument("--tokenizer", help="with --hf: byte, gpt2 or hf:PATH (default: the folder's tokenizer.json)")
    p.add_argument("--train-length", type=_positive_int, help="with --hf: the model's training length, marked on "
                   "the map")
    p.add_argument("--out", "-o", help="folder for needle.json, needle.md and needle.png (default: the run folder; "
                   "required with --hf or a checkpoint)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("needle", _needle_args)
def needle_command(args: argparse.Namespace) -> int:
    """Retrieval maps: needle-in-a-haystack exact match by needle depth and context length.

    A run's own retrieval task (passkey, mqar) or, for text runs and --hf models, key-value sentences hidden in
    real text (the run's corpus; with --hf --corpus, default the embedded stdlib) with a query for each at the end.
    Writes needle.json (every cell), needle.md (tables) and needle.png (the heatmap, training length marked)."""
    from lengthgen.report.needle import grid_rows, write_needle
    from lengthgen.report.tables import table
    from lengthgen.train.run_folder import lock

    if not (args.run or args.hf) or (args.run and args.hf):
        raise CommandError("give a run folder or checkpoint, or --hf PATH")
    if args.train_length and not args.hf:
        raise CommandError("--train-length marks an HF model's map; a run's map is marked with its own")
    if not args.out and (args.hf or not (Path(args.run) / "config.json").is_file()):
        raise CommandError("give --out, the folder for the map (only a run folder is its own default)")
    out, progress = Path(args.out or args.run), not args.no_progress
    with lock(out):
        if args.hf:
            from lengthgen.hf import needle_hf

            result = needle_hf(args.hf, corpus=args.corpus, lengths=args.lengths or [256, 512, 1024, 2048],
                               depths=args.depths, needles=args.needles, samples=args.samples,
                               tokenizer=args.tokenizer, train_length=args.train_length, progress=progress)
        else:
            from lengthgen.experiments.needle import needle_run

            result = needle_run(args.run, lengths=args.lengths, depths=args.depths, needles=args.needles,
                                samples=args.samples, bema=args.bema, progress=progress)
        paths = write_needle(result, out)
    chance = next((c.chance["exact_match"] for c in result.cells if "exact_match" in c.chance), None)
    print(f"exact match by needle depth (rows) and context length, {result.source}"
          + (f" (chance {chance:.3g})" if chance is not None else ""))
    print("\n".join(table(grid_rows([result], "exact_match"))))
    print(f"map: {paths[2]} (tables {paths[1]}, every cell {paths[0]})")
    return 0


def _writing(path: Path) -> contextlib.AbstractContextManager:
    """The lock of ``path``'s folder when lengthgen writes there (it has a lock file), else nothing; refuses to
    replace a run's own files other than its evaluations."""
    from lengthgen.train.run_folder import LOCK, WRITTEN, lock

    if not (path.parent / LOCK).exists():
        return contextlib.nullcontext()
    if path.name in WRITTEN - {"eval.json", "eval_bema.json"}:
        raise CommandError(f"--out {path} would replace a file of the run; choose another file name")
    return lock(path.parent)


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a trained run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument("--out", "-o", required=True, help="the Hugging Face model folder to write (new or empty)")
    p.add_argument("--bema", action="store_true", help="export the BEMA weights")


@command("export", _export_args)
def export_command(args: argparse.Namespace) -> int:
    """Write a trained run as a Hugging Face model folder (lengthgen.hf.from_pretrained or AutoModelForCausalLM)."""
    from lengthgen.hf import export_run

    for line in export_run(args.run, args.out, bema=args.bema):
        print(line)
    return 0


def _sample_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a trained text run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument("--prompt", required=True, help="the text to continue (after a BOS, as documents start)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=200, help="tokens to generate (default 200; "
                   "the text ends earlier where the model ends its document)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.8, help="softmax temperature (default "
                   "0.8); 0: greedy, the most likely token at each step")
    p.add_argument("--top-k", type=_positive_int, help="draw from the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--bema", action="store_true", help="sample from the BEMA weights")


@command("sample", _sample_args)
def sample_command(args: argparse.Namespace) -> int:
    """Continue a text prompt with a trained text run's model (KV-cached generation); prints prompt and continuation."""
    from lengthgen.experiments.sample import sample_run

    print(sample_run(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, seed=args.seed, bema=args.bema))
    return 0


@command("theory", lambda p: p.add_argument("--out", "-o", default="runs/theory", help="output folder"))
def theory_command(args: argparse.Namespace) -> int:
    """Extreme-value theory of seed 004: Monte Carlo E[1/w_max] vs its limit 1 + 1/(r-1); writes theory.png."""
    from lengthgen.experiments.theory import main_theory

    main_theory(args.out)
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    from lengthgen.experiments import bench

    p.add_argument("what", choices=["attention"], help="what to benchmark")
    bench.add_arguments(p)


@command("bench", _bench_args)
def bench_command(args: argparse.Namespace) -> int:
    """Benchmark attention backends x variants against SDPA (ratios measured in the same run)."""
    from lengthgen.experiments import bench

    bench.main(args)
    return 0


def _retrofit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a trained run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config change to retrofit, e.g. --set model.attention.out_norm=head_layer or "
                        "--set model.attention.gate=elementwise --set model.attention.gate_act=2sigmoid "
                        "(also train.* keys, e.g. --set train.lr=1e-3)")
    p.add_argument("--steps", type=_positive_int, required=True, help="finetuning steps (fresh optimizer)")
    p.add_argument("--eval-lengths", type=_int_list, help="comma-separated lengths (default 1,2,4,8,16 x training)")
    p.add_argument("--eval-tokens", type=_positive_int, default=8192, help="tokens per evaluated length")
    p.add_argument("--out", "-o", required=True, help="report folder (results.json, report.md, plots, finetune/); "
                                                      "it must be empty unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="delete the retrofit in --out and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("retrofit", _retrofit_args)
def retrofit_command(args: argparse.Namespace) -> int:
    """Add attention parameters to a trained model (e.g. AVNorm out-norm); finetune it and a same-steps control."""
    from lengthgen.report import terminal_table
    from lengthgen.experiments.retrofit import run_retrofit

    results = run_retrofit(args.checkpoint, args.out, overrides=args.overrides, steps=args.steps,
                           eval_lengths=args.eval_lengths, eval_tokens=args.eval_tokens,
                           progress=not args.no_progress, overwrite=args.overwrite)
    print(terminal_table(results))
    print(f"report: {Path(args.out) / 'report.md'} (plots extrapolation.png, diagnostics.png; raw results.json; "
          f"finetuning runs {Path(args.out) / 'finetune'} and the control {Path(args.out) / 'control'})")
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print a resolved config, each key with its value, "
                   "meaning and valid values")
    p.add_argument("what", nargs="?", help="a TOML or JSON config file, a run folder, a name in configs/ "
                   "(counting, mqar, ...), compare (its embedded default), attention (every AttentionSpec field "
                   "and the presets) or an attention preset (l2, avnorm, ...); default: lengthgen train's defaults")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key as train and compare do, e.g. --set model.attention=l2")


@command("config", _config_args)
def config_command(args: argparse.Namespace) -> int:
    """Show a resolved config: each key with its value, meaning and valid values (set any with --set KEY=VALUE)."""
    from lengthgen.attention import PRESETS
    from lengthgen.config import format_config
    from lengthgen.train.tracking import spec_changes

    what = args.what
    if what == "attention" or what in PRESETS:
        if args.overrides:
            raise CommandError("--set applies to run configs; for attention use --set model.attention.FIELD=VALUE")
        print(format_config(PRESETS.get(what, PRESETS["baseline"])))
        print(f"\n# presets (model.attention=NAME) and how they differ from baseline, the defaults"
              f"{' above' if what == 'attention' else ''}")
        for name, spec in PRESETS.items():
            print(f"{name:<16} {spec_changes(spec) or 'the defaults'}")
        return 0
    cfg = _run_config_to_show(what, args.overrides)
    print(format_config(cfg))
    if cfg.data.kind == "task":
        from lengthgen.data.tasks import TASKS

        arguments = inspect.signature(TASKS[cfg.data.task]).parameters.values()
        print(f"\n# data.task_kwargs of {cfg.data.task}: " + ", ".join(
            f"{a.name} (default {a.default!r})" for a in arguments if a.default is not inspect.Parameter.empty))
    return 0


def _run_config_to_show(what: str | None, overrides: list[str]):
    """The `RunConfig` that ``lengthgen config show WHAT`` prints (see its ``what`` argument)."""
    from lengthgen.experiments.compare import base_config
    from lengthgen.train.config import load_config

    if what is None or what == "compare":
        return base_config(None, overrides) if what else load_config(None, overrides)
    path = Path(what)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and (Path("configs") / f"{what}.toml").exists():
        path = Path("configs") / f"{what}.toml"
    elif not path.exists():
        names = ", ".join(sorted(p.stem for p in Path("configs").glob("*.toml"))) or "none here"
        raise CommandError(f"{what!r} is not a config file, a run folder, a name in configs/ ({names}), compare, "
                           "attention or an attention preset (lengthgen config show attention lists them)")
    return load_config(path, overrides)


def build_parser() -> argparse.ArgumentParser:
    from lengthgen.version import __version__

    parser = _Parser(prog="lengthgen", description="Length generalization of attention.",
                     epilog=f"{CONFIG_HELP}\n{SEEDS_HELP}",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lengthgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_arguments, handler) in COMMANDS.items():
        help_text = (handler.__doc__ or "").strip().splitlines()[0] if handler.__doc__ else None
        p = sub.add_parser(name, help=help_text, description=inspect.cleandoc(handler.__doc__ or ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lengthgen`` script. User errors (arguments, configs, results files, run folders,
    checkpoints, missing optional packages) exit with status 2 and a one-line message, a diverged run (non-finite
    loss) with status 1 and one line; run folder warnings are one line too."""
    from lengthgen.config import ConfigError
    from lengthgen.eval import ResultsError
    from lengthgen.optional import MissingPackageError
    from lengthgen.train import NonFiniteLossError
    from lengthgen.train.checkpoint import CheckpointError
    from lengthgen.train.run_folder import RunFolderError, RunFolderWarning

    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        show = warnings.showwarning

        def one_line(message, category, *rest):
            if not issubclass(category, RunFolderWarning):
                return show(message, category, *rest)
            print(f"lengthgen {args.command}: warning: {message}", file=sys.stderr)

        warnings.showwarning = one_line
        try:
            return args.handler(args)
        except (CommandError, ConfigError, ResultsError, RunFolderError, CheckpointError, MissingPackageError,
                FileNotFoundError) as err:
            print(f"lengthgen {args.command}: error: {err}", file=sys.stderr)
            return 2
        except NonFiniteLossError as err:       # the run diverged: not bad input, but no traceback either
            print(f"lengthgen {args.command}: error: {err}", file=sys.stderr)
            return 1
        except BrokenPipeError:                 # `lengthgen config show | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
