"""Commands that train: train, compare (the main job), retrofit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lengthgen.cli.common import (
    CommandError,
    add_config_arguments,
    add_logging_arguments,
    check_task_read,
    check_writable,
    command,
    int_list,
    flag_overrides,
    positive_int,
    report_written,
    warn_unused,
)
from lengthgen.config import counted, steps_trained


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", "-o", help="run folder (default runs/<config name>); it must be empty unless --resume "
                                       "or --overwrite")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest readable "
                   "checkpoint (refused if the config changes the training trajectory); with no checkpoint yet, or no "
                   "folder, it starts the run at step 0")
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
    from lengthgen.report import run_summary
    from lengthgen.experiments.compare import compare_config
    from lengthgen.train import distributed, train
    from lengthgen.train.config import load_config

    if args.resume and args.overwrite:
        raise CommandError("--resume continues the run in --out, --overwrite deletes it: give one of them")
    if args.extend and not args.resume:
        raise CommandError("--extend changes train.steps of a resumed run: add --resume")
    overrides = flag_overrides(args)
    cfg = load_config(args.config, overrides)
    check_task_read(cfg, overrides)
    compare_config(cfg)         # a preset's [compare] section is checked here too: its typos are not silent
    warn_unused(cfg, sorted({*cfg.lengths(), *(cfg.train.eval_lengths or [cfg.data.length])}))
    out = Path(args.out) if args.out else Path("runs") / (cfg.name or (Path(args.config).stem if args.config
                                                                        else "run"))
    if not args.out:        # a given --out was checked by `main`
        check_writable(out, folder=True, default=True)
    result = train(cfg, out, progress=not args.no_progress, resume=args.resume, overwrite=args.overwrite,
                   extend=args.extend)
    if distributed.env_world()[0] != 0:  # torchrun: rank 0 reports (`main` leaves the process group)
        return 0
    final = f"{result.history[-1]:.4g}" if result.history else "n/a"
    done = f"final loss {final}; run folder {result.run_dir}"
    if result.trainer.start_step == result.step:        # --resume of a finished run: nothing was trained now
        print(f"nothing to train: the run finished its {counted(result.step, 'step')} before; {done}")
    else:
        print(f"trained {steps_trained(result.trainer.start_step, result.step)}; {done}")
    if result.evaluation:
        print(run_summary(result.evaluation, getattr(result.trainer.source, "metric", "loss"),
                          train_length=max(result.config.lengths())))
        print(f"by-position results: {result.run_dir / 'eval.json'}")
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    from lengthgen.experiments.compare import DEFAULT_VARIANTS

    add_config_arguments(p)
    p.add_argument("--task", help="task name (counting, mqar, set_complement, ...) or module:Class, a Task "
                   "subclass of your own; sets data.task")
    p.add_argument("--variants", help="comma-separated variants: names in the config's compare.variants or "
                                      f"attention presets (default: the config's, else {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--bases", help="comma-separated names in the config's compare.bases (default: all of them)")
    p.add_argument("--train-length", type=positive_int, help="training length (sets data.length)")
    p.add_argument("--eval-lengths", type=int_list, help="comma-separated lengths (default 1,2,4,8,16 x training; "
                                                          "sets compare.eval_lengths)")
    p.add_argument("--steps", type=positive_int, help="training steps per variant (sets train.steps)")
    p.add_argument("--pretrain-steps", type=positive_int, help="pretrain each base this many steps, then finetune "
                   "every variant from it (seed 000; sets compare.pretrain_steps)")
    p.add_argument("--seeds", type=positive_int, help="seeds per variant: 0, 1, ..., N-1; mean and spread are "
                   "reported (default: the config's compare.seeds, else 1; sets compare.seeds)")
    p.add_argument("--eval-tokens", type=positive_int, help="tokens per evaluated length (default: the config's, "
                   "else 8192; sets compare.eval_tokens)")
    p.add_argument("--workers", type=positive_int, help="runs at once, each in its own process with train.threads "
                   "CPU threads (default: the config's, else 1; sets compare.workers)")
    p.add_argument("--metric", help="the report's headline: loss, the source's metric or one it also reports, "
                                    "e.g. Dyck's legal_accuracy, each ranked in its own direction (default: the "
                                    "source's; loss for the embedded default; sets compare.metric)")
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
    from lengthgen.experiments.jobs import WorkerLost
    from lengthgen.report import terminal_table

    if args.resume and args.overwrite:
        raise CommandError("--resume continues the comparison in --out, --overwrite deletes it: give one of them")
    seeds = None if args.seeds is None else list(range(args.seeds))
    flags = {"data.task": ("--task", args.task), "data.length": ("--train-length", args.train_length),
             "train.steps": ("--steps", args.steps), "compare.seeds": ("--seeds", seeds),
             "compare.eval_lengths": ("--eval-lengths", args.eval_lengths),
             "compare.eval_tokens": ("--eval-tokens", args.eval_tokens),
             "compare.pretrain_steps": ("--pretrain-steps", args.pretrain_steps),
             "compare.metric": ("--metric", args.metric), "compare.workers": ("--workers", args.workers)}
    overrides = flag_overrides(args, {key: (flag, None if value is None else str(value))
                                      for key, (flag, value) in flags.items()})
    cfg = base_config(args.config, overrides)
    check_task_read(cfg, overrides)
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
    try:
        results = run_compare(cfg, args.out, variants=variants, bases=bases, progress=not args.no_progress,
                              resume=args.resume, overwrite=args.overwrite)
    except WorkerLost as err:           # not bad input, but no traceback either
        print(f"lengthgen compare: error: {err}", file=sys.stderr)
        return 1
    print(terminal_table(results))
    print(report_written(Path(args.out)))
    return 0


def _retrofit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a trained run folder (its newest readable checkpoint) or checkpoint folder")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config change to retrofit, e.g. --set model.attention.out_norm=head_layer or "
                        "--set model.attention.gate=elementwise --set model.attention.gate_act=2sigmoid "
                        "(also train.* keys, e.g. --set train.lr=1e-3)")
    p.add_argument("--steps", type=positive_int, required=True, help="finetuning steps (fresh optimizer)")
    p.add_argument("--eval-lengths", type=int_list, help="comma-separated lengths (default 1,2,4,8,16 x training)")
    p.add_argument("--eval-tokens", type=positive_int, default=8192, help="tokens per evaluated length (default "
                   "%(default)s)")
    p.add_argument("--out", "-o", required=True, help="report folder (results.json, report.md, plots, the runs "
                                                      "finetune/ and control/); it must be empty unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="delete the retrofit in --out and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("retrofit", _retrofit_args)
def retrofit_command(args: argparse.Namespace) -> int:
    """Add attention parameters to a trained model (e.g. AVNorm out-norm); finetune it and a same-steps control."""
    from lengthgen.experiments.retrofit import run_retrofit
    from lengthgen.report import terminal_table

    results = run_retrofit(args.checkpoint, args.out, overrides=args.overrides, steps=args.steps,
                           eval_lengths=args.eval_lengths, eval_tokens=args.eval_tokens,
                           progress=not args.no_progress, overwrite=args.overwrite)
    print(terminal_table(results))
    out = Path(args.out)
    print(report_written(out, f"; finetuning runs {out / 'finetune'} and the control {out / 'control'}"))
    return 0
