"""Commands that read runs and results: report, eval, needle, export, sample, theory, config."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
from pathlib import Path

from lengthgen.cli.common import (CommandError, command, config_file, float_list, int_list, no_transformers_bars,
                                  non_negative_float, positive_int, report_written, seed_int, writing)

HF_TOKENIZER_HELP = "with --hf: byte, gpt2, tiktoken:ENCODING or hf:PATH (default: the folder's tokenizer.json)"


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="compare or retrofit folders (or results.json files) to report on")
    p.add_argument("--out", "-o", help="write results.json and the report here (default: rebuild the report of a "
                                       "single results.json beside it; required when merging several)")


@command("report", _report_args)
def report_command(args: argparse.Namespace) -> int:
    """Rebuild report.md and the plots from existing results.json files (several are merged into --out)."""
    from lengthgen.eval import Comparison
    from lengthgen.report import terminal_table, write_report
    from lengthgen.report.markdown import DIAGNOSTICS, EXTRAPOLATION
    from lengthgen.report.needle import NEEDLE_PLOT, variant_maps
    from lengthgen.train.run_folder import check_outputs, kinds_held, lock, results_file

    paths = [Path(p) / "results.json" if Path(p).is_dir() else Path(p) for p in args.results]
    for path in paths:
        # a folder without its results.json: say what it holds (not for another missing file: a typo)
        held = kinds_held(path.parent) if path.name == "results.json" and not path.exists() else {}
        if "training run" in held:
            raise CommandError(f"{path.parent} is a training run, which has no results.json: report reads compare "
                               f"and retrofit folders; evaluate a run with lengthgen eval {path.parent}")
        if "comparison" in held or "retrofit" in held:
            finish = ("finish it with lengthgen compare (its config and variants) --resume --out "
                      f"{path.parent}, which reuses its finished runs" if "comparison" in held
                      else f"run it again with lengthgen retrofit ... --overwrite --out {path.parent}")
            raise CommandError(f"{path.parent} holds a {'comparison' if 'comparison' in held else 'retrofit'} that "
                               "did not finish: its results.json and report are written once every run is "
                               f"evaluated; {finish}")
    if len(paths) > 1 and not args.out:
        raise CommandError("merging several results needs --out, a folder of its own for the merged report")
    out = Path(args.out) if args.out else paths[0].parent
    if len(paths) > 1 and any(out.resolve() == path.parent.resolve() for path in paths):
        raise CommandError(f"--out {out} holds one of the merged results.json; give a folder of its own")
    runs = [name for found in kinds_held(out).values() for name in found]
    if runs and out.resolve() != paths[0].parent.resolve():
        raise CommandError(f"--out {out} holds another experiment ({', '.join(runs)}), whose results.json and "
                           "report this would replace; give a folder of its own")
    if (out / "theory.json").exists() and out.resolve() != paths[0].parent.resolve():
        raise CommandError(f"--out {out} holds lengthgen theory's output (theory.json), whose theory.png the report "
                           "would list as its own plot; give a folder of its own")
    merged = _current_keys(Comparison.load(paths[0]))
    for path in paths[1:]:
        merged.merge(_current_keys(Comparison.load(path)), str(path))
    if variant_maps(merged) and results_file(out / "needle.json") == "needle":
        raise CommandError(f"--out {out} holds a retrieval map of lengthgen needle (needle.json), whose needle.png "
                           "this report's map would replace; choose another folder")
    check_outputs(out, ["results.json", "report.md", EXTRAPOLATION, DIAGNOSTICS, NEEDLE_PLOT],
                  "--out" if args.out else "")
    with lock(out):
        if out.resolve() != paths[0].parent.resolve():
            merged.save(out / "results.json")
        write_report(merged, out)
    print(terminal_table(merged))
    print(report_written(out))
    return 0


def _current_keys(results):
    """``results`` with each run's config and each variant's spec read by this lengthgen (`RunConfig`,
    `AttentionSpec`), so that a results.json written before a key existed holds it at its default, which is the
    behaviour before the key (each new key's default keeps it): merging it with newer results compares like with
    like. A config this lengthgen cannot read is left as it is (merge then names what differs)."""
    from lengthgen.attention import AttentionSpec
    from lengthgen.config import ConfigError
    from lengthgen.train.config import RunConfig

    def current(kind, data):
        try:
            return kind.from_dict(data).to_dict()
        except (ConfigError, TypeError, ValueError):
            return data
    for runs in results.variants.values():
        for run in runs:
            run.config = current(RunConfig, run.config)
    results.specs = {name: current(AttentionSpec, spec) for name, spec in results.specs.items()}
    return results


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder or checkpoint (omit with --hf)")
    p.add_argument("--lengths", type=int_list, help="comma-separated lengths (default 1,2,4,8,16 x training, up to "
                   "the data's maximum length; with --hf 256,1024)")
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="tokens per evaluated length (default %(default)s)")
    p.add_argument("--bema", action="store_true", help="evaluate the BEMA weights")
    p.add_argument("--hf", metavar="PATH", help="a local Hugging Face model directory instead of a run")
    p.add_argument("--corpus", help="with --hf: text corpus (stdlib, a path, bin:GLOB; default stdlib)")
    p.add_argument("--tokenizer", help=HF_TOKENIZER_HELP)
    p.add_argument("--out", "-o", help="write the results JSON here, a NAME.json (in a lengthgen folder: under its "
                                       "lock); it replaces only an earlier evaluation")


def only_hf(args: argparse.Namespace) -> None:
    """--corpus and --tokenizer choose the text of an --hf model; a run reads its own. --bema is a run's."""
    if not args.hf and (args.corpus or args.tokenizer):
        raise CommandError("--corpus and --tokenizer apply only with --hf; a run uses its own corpus and tokenizer")
    if args.hf and args.bema:
        raise CommandError("--bema applies to a run's BEMA weights; an --hf model has none (export a run with "
                           "--bema to evaluate its BEMA weights as an HF model)")


@command("eval", _eval_args)
def eval_command(args: argparse.Namespace) -> int:
    """Evaluate a trained run (or a local HF model) by position at lengths far beyond training."""
    from lengthgen.report import run_summary
    from lengthgen.train.run_folder import results_file

    if not (args.run or args.hf) or (args.run and args.hf):
        raise CommandError("give a run folder or checkpoint, or --hf PATH")
    only_hf(args)
    with writing(Path(args.out), args.run) if args.out else contextlib.nullcontext():
        if args.out and Path(args.out).suffix != ".json":     # else a later eval --out could not replace it
            raise CommandError(f"--out {args.out}: give a file name ending in .json, the results' format (an "
                               "earlier evaluation is replaced only under such a name)")
        if args.out and Path(args.out).exists() and results_file(args.out) != "run":
            raise CommandError(f"--out {args.out} exists and is not an earlier evaluation (a results file of "
                               "lengthgen eval); choose another file name")
        name = Path(args.out or "").name
        if name in ("eval.json", "eval_bema.json") and (Path(args.out).parent / "config.json").is_file() \
                and (name == "eval_bema.json") != args.bema:      # a run's own file: of the weights its name says
            raise CommandError(f"--out {args.out}: the run's {name} holds the evaluation of its "
                               f"{'live' if args.bema else 'BEMA'} weights; "
                               f"{'leave out' if args.bema else 'add'} --bema or choose another file name")
        if args.hf:
            from lengthgen.hf import evaluate_hf

            with no_transformers_bars():
                result = evaluate_hf(args.hf, corpus=args.corpus or "stdlib", lengths=args.lengths or [256, 1024],
                                     tokens=args.tokens, tokenizer=args.tokenizer)
            train_length = None
        else:
            from lengthgen.experiments.eval_run import eval_run
            from lengthgen.train.config import RunConfig

            result = eval_run(args.run, lengths=args.lengths, tokens=args.tokens, bema=args.bema)
            train_length = max(RunConfig.from_dict(result.config).lengths())
        if args.out:
            result.save(args.out)
    print(run_summary(result, train_length=train_length))
    return 0


def _needle_args(p: argparse.ArgumentParser) -> None:
    from lengthgen.eval import DEPTHS

    p.add_argument("run", nargs="?", help="run folder or checkpoint (omit with --hf)")
    p.add_argument("--lengths", type=int_list, help="comma-separated context lengths, any the data can generate "
                   "(default 1,2,4,8,16 x training, up to the data's maximum length; with --hf 256,512,1024,2048)")
    p.add_argument("--depths", type=float_list, default=list(DEPTHS), help="comma-separated needle depths in [0, 1], "
                   "the fraction of the filler before the needle (default 0,0.1,...,1)")
    p.add_argument("--samples", type=positive_int, default=100,
                   help="sequences per (depth, length) cell (default %(default)s)")
    p.add_argument("--needles", type=positive_int, default=1, help="needles per context, each asked for (RULER's "
                   "multi-query needles; mqar and text; passkey holds one; default 1)")
    p.add_argument("--bema", action="store_true", help="map the BEMA weights")
    p.add_argument("--hf", metavar="PATH", help="a local Hugging Face model directory instead of a run")
    p.add_argument("--corpus", help="with --hf: the filler's text corpus (stdlib, a path, bin:GLOB; default stdlib)")
    p.add_argument("--tokenizer", help=HF_TOKENIZER_HELP)
    p.add_argument("--train-length", type=positive_int, help="with --hf: the model's training length, marked on "
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
    from lengthgen.eval import NeedleMap
    from lengthgen.report.needle import NEEDLE_PLOT, grid_rows, write_needle
    from lengthgen.report.tables import table
    from lengthgen.train.run_folder import check_outputs, lock, results_file

    if not (args.run or args.hf) or (args.run and args.hf):
        raise CommandError("give a run folder or checkpoint, or --hf PATH")
    only_hf(args)
    if args.train_length and not args.hf:
        raise CommandError("--train-length marks an HF model's map; a run's map is marked with its own")
    if not args.out and (args.hf or not (Path(args.run) / "config.json").is_file()):
        raise CommandError("give --out, the folder for the map (only a run folder is its own default)")
    out, progress = Path(args.out or args.run), not args.no_progress
    if (out / "config.json").is_file() and not (args.run and Path(args.run).resolve().is_relative_to(out.resolve())):
        raise CommandError(f"--out {out} is another run's folder (its own map would be replaced); choose another "
                           "folder")
    if results_file(out / "results.json") == "comparison":
        raise CommandError(f"--out {out} holds a comparison's report (results.json), whose needle.png this map would "
                           "replace; choose another folder")
    check_outputs(out, ["needle.json", "needle.md", NEEDLE_PLOT], "--out" if args.out else "")
    if results_file(out / "needle.json") == "needle" and NeedleMap.load(out / "needle.json").bema != args.bema:
        raise CommandError(f"--out {out} holds a map of {'live' if args.bema else 'BEMA'} weights (needle.json), "
                           f"which this map of {'BEMA' if args.bema else 'live'} weights would replace; choose "
                           "another --out")
    with lock(out):
        if args.hf:
            from lengthgen.hf import needle_hf

            with no_transformers_bars():
                result = needle_hf(args.hf, corpus=args.corpus or "stdlib",
                                   lengths=args.lengths or [256, 512, 1024, 2048], depths=args.depths,
                                   needles=args.needles, samples=args.samples, tokenizer=args.tokenizer,
                                   train_length=args.train_length, progress=progress)
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


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a trained run folder (its newest readable checkpoint) or checkpoint folder")
    p.add_argument("--out", "-o", required=True, help="the Hugging Face model folder to write (new or empty)")
    p.add_argument("--bema", action="store_true", help="export the BEMA weights")


@command("export", _export_args)
def export_command(args: argparse.Namespace) -> int:
    """Write a trained run as a Hugging Face model folder (lengthgen.hf.from_pretrained or AutoModelForCausalLM)."""
    from lengthgen.hf import export_run

    with no_transformers_bars():
        lines = export_run(args.run, args.out, bema=args.bema)
    for line in lines:
        print(line)
    return 0


def _sample_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a trained text run folder (its newest readable checkpoint) or checkpoint folder")
    p.add_argument("--prompt", required=True, help="the text to continue (after a BOS, as documents start)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="tokens to generate (default 200; "
                   "the text ends earlier where the model ends its document)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="softmax temperature (default "
                   "0.8); 0: greedy, the most likely token at each step")
    p.add_argument("--top-k", type=positive_int, help="draw from the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--bema", action="store_true", help="sample from the BEMA weights")


@command("sample", _sample_args)
def sample_command(args: argparse.Namespace) -> int:
    """Continue a text prompt with a trained text run's model (KV-cached generation); prints prompt and continuation."""
    from lengthgen.experiments.sample import sample_run

    try:        # bytes the shell passed that are not UTF-8 come as surrogates, which tokenizers would change
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CommandError(f"--prompt is not UTF-8 text (byte {os.fsencode(args.prompt[err.start])!r} at character "
                           f"{err.start}); give UTF-8 text, as the run's tokenizer reads") from None
    print(sample_run(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, seed=args.seed, bema=args.bema))
    return 0


@command("theory", lambda p: p.add_argument("--out", "-o", default="runs/theory",
                                            help="folder for theory.json and theory.png (default runs/theory)"))
def theory_command(args: argparse.Namespace) -> int:
    """Extreme-value theory of seed 004: Monte Carlo E[1/w_max] vs its limit 1 + 1/(r-1); writes theory.json
    and theory.png."""
    from lengthgen.experiments.theory import main_theory
    from lengthgen.train.run_folder import check_outputs, kinds_held, lock, results_file

    out = Path(args.out)
    held = [name for found in kinds_held(out).values() for name in found]
    held += ["results.json"] if results_file(out / "results.json") == "comparison" else []
    if held:                # a report there would list theory.png as its own plot
        raise CommandError(f"--out {out} holds another experiment ({', '.join(held)}); give theory a folder of "
                           "its own")
    check_outputs(args.out, ["theory.json", "theory.png"], "--out")
    with lock(args.out):            # one writer per folder: not into a run that is training
        main_theory(args.out)
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    # `show` is a subcommand (not a positional beside `what`): argparse takes a command's positionals in one run, so
    # `config show --set K=V counting` would leave `counting` unrecognized
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="list the configs in configs/ (the seeds' presets, their CPU analogs, examples)",
                       description="List the configs in configs/, each with its header's first sentence.")
    show = actions.add_parser("show", help="print a resolved config, each key with its value, meaning and valid "
                              "values", description="Print a resolved config, each key with its value, meaning and "
                              "valid values.")
    show.add_argument("what", nargs="?", help="a TOML or JSON config file, a run folder, a name in configs/ "
                      "(counting, mqar, ...), compare (its embedded default), attention (every AttentionSpec field "
                      "and the presets) or an attention preset (l2, avnorm, ...); default: lengthgen train's defaults")
    show.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key as train and compare do, e.g. --set model.attention=l2")


@command("config", _config_args)
def config_command(args: argparse.Namespace) -> int:
    """Show a resolved config: each key with its value, meaning and valid values (set any with --set KEY=VALUE);
    or list the configs in configs/."""
    from lengthgen.attention import PRESETS
    from lengthgen.config import format_config
    from lengthgen.experiments.compare import compare_config
    from lengthgen.train.setup import resolve
    from lengthgen.train.tracking import spec_changes

    if args.action == "list":
        return _list_configs()
    what = args.what
    if what == "attention" or what in PRESETS:
        if args.overrides:
            preset = what if what in PRESETS else "baseline"
            raise CommandError(f"config show {what} takes no --set (it shows the spec as defined); to see it changed, "
                               f"show a run config: lengthgen config show --set model.attention={preset} "
                               "--set model.attention.FIELD=VALUE")
        print(format_config(PRESETS.get(what, PRESETS["baseline"])))
        print(f"\n# presets (model.attention=NAME) and how they differ from baseline, the defaults"
              f"{' above' if what == 'attention' else ''}")
        for name, spec in PRESETS.items():
            print(f"{name:<16} {spec_changes(spec) or 'the defaults'}")
        return 0
    cfg = _run_config_to_show(what, args.overrides)
    resolve(cfg)            # what train would refuse (data keys, lengths, model against data), refused here too
    compare_config(cfg)
    print(format_config(cfg))
    if cfg.data.kind == "task":
        from lengthgen.data.tasks import task_class

        arguments = inspect.signature(task_class(cfg.data.task)).parameters.values()
        print(f"\n# data.task_kwargs of {cfg.data.task}: " + (", ".join(
            _task_argument(a) for a in arguments if a.kind is not a.VAR_POSITIONAL) or "none"))
    return 0


def _task_argument(argument: inspect.Parameter) -> str:
    """A task constructor's argument as `config show` lists it: its default, required, or any key (``**kwargs``)."""
    if argument.kind is argument.VAR_KEYWORD:
        return f"any key (**{argument.name})"
    return f"{argument.name} ({'required' if argument.default is argument.empty else f'default {argument.default!r}'})"


def _shipped_configs() -> list[Path]:
    """The configs in configs/ and its subfolders, top level first."""
    return sorted(Path("configs").rglob("*.toml"), key=lambda p: (len(p.parts), p))


def _config_name(path: Path) -> str:
    """The name --config takes for a config in configs/ (``cpu/seed003_dyck``)."""
    return path.relative_to("configs").with_suffix("").as_posix()


def _list_configs() -> int:
    """Each config in configs/ (and its subfolders) by the name --config takes, with its header's first sentence."""
    paths = _shipped_configs()
    if not paths:
        raise CommandError("no configs/ folder with .toml files here: run from a lengthgen checkout, whose configs/ "
                           "holds the seeds' presets")
    for path in paths:
        header = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#") or line.strip() == "#":
                break
            header.append(line.lstrip("# ").strip())
        sentence = re.split(r"\.\s+(?=[A-Z])", " ".join(header))[0].rstrip(".")   # not at "et al. 2023"
        name = _config_name(path)
        print(f"{name:<28} {sentence[:90] + '...' if len(sentence) > 93 else sentence}")
    return 0


def _run_config_to_show(what: str | None, overrides: list[str]):
    """The `RunConfig` that ``lengthgen config show WHAT`` prints (see its ``what`` argument)."""
    from lengthgen.experiments.compare import base_config
    from lengthgen.train.config import load_config

    if what is None or what == "compare":
        return base_config(None, overrides) if what else load_config(None, overrides)
    path = Path(config_file(what))
    if path.is_dir():
        path = _run_config_file(path)
    elif not path.exists():
        names = ", ".join(map(_config_name, _shipped_configs())) or "none here"
        raise CommandError(f"{what!r} is not a config file, a run folder, a name in configs/ ({names}), compare, "
                           "attention or an attention preset (lengthgen config show attention lists them)")
    return load_config(path, overrides)


def _run_config_file(folder: Path) -> Path:
    """The ``config.json`` of the run folder ``folder``; a `CommandError` naming what the folder is otherwise (a
    comparison, a retrofit, a checkpoint or a run's checkpoints, a folder without one)."""
    from lengthgen.train.run_folder import LOCK, kinds_held

    if (folder / "config.json").is_file():
        return folder / "config.json"
    held = kinds_held(folder)
    runs = {"comparison": folder / "runs", "retrofit": folder / "finetune"}
    kind = next((kind for kind in held if kind in runs), None)
    if kind is not None:
        examples = sorted(p for p in runs[kind].rglob("config.json") if (p.parent / LOCK).exists())
        example = f", e.g. lengthgen config show {examples[0].parent}" if examples else ""
        raise CommandError(f"{folder} holds a {kind}, not a run: each of its runs (in {runs[kind]}) has its own "
                           f"config{example}")
    checkpoint = (folder / "state.json").is_file()
    run = folder.parent if checkpoint else folder
    if run.name == "checkpoints" and (run.parent / "config.json").is_file():
        raise CommandError(f"{folder} is {'a checkpoint' if checkpoint else 'the checkpoints folder'} of the run "
                           f"{run.parent}: lengthgen config show {run.parent} shows its config")
    raise CommandError(f"{folder} holds no config.json, so it is not a run folder; give a run folder, a config file "
                       "or a name in configs/")
