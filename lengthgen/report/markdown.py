"""``report.md`` of a `Comparison`: what was trained, the conclusion by the rule of `lengthgen.report.stats`,
the headline table with its chance level and ratios, the other metrics, the plots and the runs."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Any

from lengthgen.config import counted, differences, toml_value
from lengthgen.data.tasks import own_task
from lengthgen.eval.results import Comparison, Provenance, RunEval
from lengthgen.model.config import final_norm_note
from lengthgen.report.needle import needle_section
from lengthgen.report.stats import RULE
from lengthgen.report.tables import (ALL_POSITIONS, AT_CHANCE, at_length, chance_level, conclusion, groups,
                                     length_label, mean, metric_names, same, seed_values, table, value_rows,
                                     verdict_rows)

#: the plots beside ``report.md``
EXTRAPOLATION, DIAGNOSTICS = "extrapolation.png", "diagnostics.png"
CHANCE = ("chance = the expected value of the best predictor that knows the task's format and each position "
          "but not the sampled tokens (the trivial baseline)")


def markdown_report(results: Comparison) -> str:
    """The whole report, embedding `EXTRAPOLATION` and, when the runs recorded attention diagnostics,
    `DIAGNOSTICS`; variant names are escaped (`escape`)."""
    results = _named_as_markdown(results)
    metric = results.metric
    arrow = "higher is better" if results.higher_is_better else "lower is better"
    lines = [f"# {results.title}", ""] + ([results.description, ""] if results.description else [])
    lines += ["## Setup", "", *setup(results), "", "## Conclusion", "", conclusion(results), "",
              f"Rule: {RULE}. Each seed has its own initialization, training batches and evaluation batches; the "
              "variants' runs of one seed see the same batches.", "",
              f"## {metric} at length L ({arrow})", "",
              f"{at_length(results, metric)}. Cells: mean over seeds, [min, max] over seeds when several"
              + (", (ratio to the mean at the training length)" if results.train_length in results.eval_lengths
                 else "") + f"; {AT_CHANCE} = not better than the chance level in every seed; {CHANCE}.", ""]
    rows = value_rows(results, metric, ratio=True) + verdict_rows(results, "best (rule)")
    lines += table(rows)
    if any(not same(run.at(n).mean.get(metric), run.at(n).at_length.get(metric))
           for runs in results.variants.values() for run in runs for n in results.eval_lengths):
        lines += ["", f"## {metric}, {ALL_POSITIONS}", "",
                  f"The same runs over every position of each length ({ALL_POSITIONS}, not only [L/2, L)).", "",
                  *table(value_rows(results, metric, field="mean"))]
    for name in metric_names(results)[1:]:
        higher = results.higher_is_better_for(name)
        direction = "" if higher is None else f" ({'higher' if higher else 'lower'} is better)"
        lines += ["", f"## {name} at length L{direction}", "", f"{at_length(results, name)}.", "",
                  *table(value_rows(results, name))]
    if results.retrofit:
        lines += ["", *retrofit_section(results)]
    lines += ["", "## Plots", "", f"![{metric} by evaluated length and by position]({EXTRAPOLATION})", "",
              f"`{EXTRAPOLATION}`: {metric} at each evaluated length (left) and, for metrics measured at most "
              "positions, by position at the longest length (right); shaded: min-max over seeds; dashed black: "
              "chance; dotted grey: training length.", ""]
    if has_diagnostics(results):
        lines += [f"![attention diagnostics by position]({DIAGNOSTICS})", "",
                  f"`{DIAGNOSTICS}`: attention diagnostics by query position at the longest length, averaged over "
                  "layers and heads (the first evaluated sequence of each seed): 1 / max_j softmax_ij, of the "
                  "softmax distribution (for p-softmax variants before the 1/||.||_p rescaling, which keeps the "
                  "distribution's shape), and the RMS of each head's attention output.", ""]
    lines += needle_section(results)
    lines += [*runs_table(results), "", "Raw numbers, every config and spec: `results.json`.", ""]
    return "\n".join(lines)


def escape(text: str) -> str:
    """``text`` as literal markdown: a backslash before each character that would end a table cell (``|``), open
    an HTML tag, a link, code or emphasis (``*``, ``~``; ``_`` at a word's edge, where it can emphasize)."""
    return re.sub(r"([\\|<>\[\]`*~])|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])", lambda m: "\\" + m.group(0), text)


def _named_as_markdown(results: Comparison) -> Comparison:
    """``results`` with its variants (and their specs) renamed by `escape`."""
    return dataclasses.replace(results, variants={escape(k): v for k, v in results.variants.items()},
                               specs={escape(k): v for k, v in results.specs.items()})


def has_diagnostics(results: Comparison) -> bool:
    """Whether every run recorded attention diagnostics at the longest length."""
    return all(run.at(results.eval_lengths[-1]).diagnostics for run in _runs(results))


def _runs(results: Comparison) -> list[RunEval]:
    return [run for runs in results.variants.values() for run in runs]


def _span(values: list[float], spec: str = ",") -> str:
    """``a`` or ``a-b`` over the known values (``n/a`` when none)."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    lo, hi = min(known), max(known)
    return format(lo, spec) if lo == hi else f"{lo:{spec}}-{hi:{spec}}"


def setup(results: Comparison) -> list[str]:
    """Bullets: task, model, variants, training, evaluation, compute and code."""
    runs = _runs(results)
    cfg = _agreed(results.config, [run.config for run in runs if run.config])
    model, train, data = cfg.get("model", {}), cfg.get("train", {}), cfg.get("data", {})
    kwargs = ", ".join(f"{k}={toml_value(v)}" for k, v in (data.get("task_kwargs") or {}).items())
    chance = chance_level(results, results.metric, results.eval_lengths[-1])
    tokens_per_step = train.get("tokens_per_step") or train.get("batch_size", 0) * results.train_length
    seeds = sorted({run.seed for run in runs if run.seed is not None})
    lengths = results.eval_lengths
    protocol = results.retrofit or {}
    trained = (f"per finetuning run; each base pretrained {counted(protocol['pretrain_steps'], 'step')} per seed first"
               if "pretrain_steps" in protocol else "the finetuning; before: its own run" if protocol else "per run")
    about = ([f"class `{data['task']}`"] if own_task(data.get("task")) else []) + ([kwargs] if kwargs else [])
    task = f"`{results.source}`" + (f" ({', '.join(about)})" if about else "")
    lines = [f"- **Task**: {task}; headline `{results.metric}`"
             + (f", chance level {chance:.4g} at the longest length" if chance is not None else ""),
             f"- **Model**: {counted(model.get('layers'), 'layer')}, width {model.get('dim')}, "
             f"{counted(model.get('heads'), 'head')}, "
             f"MLP ratio {model.get('mlp_ratio')}, {model.get('norm')} norm ({model.get('norm_placement')}"
             f"{final_norm_note(model.get('norm_placement'), model.get('final_norm'))}); "
             f"{_by_variant(results, 'parameters', 'parameters')}",
             "- **Variants** (the config keys in which their runs differ, seeds aside; every other key is shared):",
             "", *variant_table(results), "",
             f"- **Training** ({trained}): "
             f"{counted(train.get('steps'), 'step')} at length {results.train_length}"
             + (f" (stages {train.get('stages')})" if train.get("stages") else "")
             + f", {tokens_per_step:,} tokens per step, {_by_variant(results, 'train_tokens', 'tokens in all')}; "
             f"{_optimizer(train)}, {train.get('schedule')} schedule, "
             f"{counted(train.get('warmup_steps'), 'warmup step')}",
             f"- **Seeds**: {', '.join(map(str, seeds)) or 'n/a'} ({_seed_counts(results)})",
             f"- **Evaluation**: lengths {', '.join(length_label(n, results.train_length) for n in lengths)}; "
             f"{_evaluated_on(results, lengths)}"]
    per_run = (f"per run {_seconds([r.train_seconds for r in runs])} training, "
               f"{_seconds([r.eval_seconds for r in runs])} evaluation")
    origins = _origins(results)
    if len(origins) > 1:        # merged (or resumed) results computed apart: the first's origin is not all runs'
        return lines + [f"- **Compute**: {per_run}", "- **Code and device**: they differ between the runs' evaluations",
                        *(f"  - {line}" for line in origins)]
    p = results.provenance
    return lines + [f"- **Compute**: {p.device}; {per_run}", f"- **Code**: {_code(p)}, {p.date}"]


def _agreed(base: Any, configs: list[Any]) -> Any:
    """What the setup describes: the runs' own value of each config key where every run has the same (a key that
    every variant or the one base changes, e.g. a single variant's ``train.lr``), else the comparison's ``base``
    (the variants table shows the keys in which the runs differ)."""
    if configs and all(isinstance(c, dict) for c in configs):
        base = base if isinstance(base, dict) else {}
        keys = dict.fromkeys([*base, *(k for c in configs for k in c)])
        return {k: _agreed(base.get(k), [c.get(k) for c in configs]) for k in keys}
    return configs[0] if configs and configs[0] is not None and all(c == configs[0] for c in configs) else base


def _code(p: Provenance) -> str:
    """``lengthgen VERSION (git COMMIT), torch VERSION`` of a provenance."""
    return f"lengthgen {p.lengthgen}" + (f" (git {p.git_commit[:10]})" if p.git_commit else "") + f", torch {p.torch}"


def _origins(results: Comparison) -> list[str]:
    """One line per device, lengthgen version, git commit and torch that evaluated some of the runs, naming
    their variants and seeds."""
    seeds: dict[str, dict[str, list]] = {}
    for name, variant_runs in results.variants.items():
        for run in variant_runs:
            origin = f"{run.provenance.device}, {_code(run.provenance)}"
            seeds.setdefault(origin, {}).setdefault(name, []).append(run.seed)
    return [f"{origin}: " + ", ".join(f"{name} ({'seeds' if len(s) > 1 else 'seed'} {', '.join(map(str, s))})"
                                      for name, s in by_variant.items()) for origin, by_variant in seeds.items()]


def _batches(run: RunEval, lengths: list[int]) -> str:
    """What a run is evaluated on: the tokens per length and the longest length's batch for sampled sequences;
    each length's batch otherwise (text's long documents: from which split, and whether every seed sees the same)."""
    batches = {n: run.at(n).batch for n in lengths}
    if all(batch.endswith(("sampled sequence", "sampled sequences")) for batch in batches.values()):
        longest = run.at(lengths[-1])
        return (f"per length {longest.batch_size * longest.length:,} tokens (at {lengths[-1]}: {longest.batch}), "
                "seeded by each run's seed")
    return (f"batches by length (seed {run.seed}): " + "; ".join(f"{n}: {batch}" for n, batch in batches.items())
            + "; each run draws its documents with its own seed, except where a length takes all there are")


def _evaluated_on(results: Comparison, lengths: list[int]) -> str:
    """`_batches` of the first run; where some variants were evaluated on other batches (a base of other data, e.g.
    another tokenizer, may find no held-out document that long), one line per group of them, naming its variants."""
    batches: dict[tuple[str, ...], dict[str, RunEval]] = {}     # the batches -> variant -> its first run there
    for name, variant_runs in results.variants.items():
        for run in variant_runs:
            batches.setdefault(tuple(run.at(n).batch for n in lengths), {}).setdefault(name, run)
    if len(batches) == 1:
        return _batches(_runs(results)[0], lengths)
    return "the variants were evaluated on other batches:" + "".join(
        f"\n  - {', '.join(named)}: {_batches(next(iter(named.values())), lengths)}" for named in batches.values())


def _by_variant(results: Comparison, attr: str, unit: str) -> str:
    """The runs' integer ``attr``: the value most variants share, then the others with the variants that have
    each (named without their base when the value does not depend on the base)."""
    per_variant = {name: _span([getattr(run, attr) for run in runs]) for name, runs in results.variants.items()}
    common = Counter(per_variant.values()).most_common(1)[0][0]
    if len(groups(results)) > 1:
        short: dict[str, set[str]] = {}
        for name, text in per_variant.items():
            short.setdefault(name.split("/", 1)[1], set()).add(text)
        if all(len(texts) == 1 for texts in short.values()):
            per_variant = {name: texts.pop() for name, texts in short.items()}
    having: dict[str, list[str]] = {}
    for name, text in per_variant.items():
        if text != common:
            having.setdefault(text, []).append(name)
    others = "; ".join(f"{', '.join(names)}: {text}" for text, names in having.items())
    return f"{common} {unit}" + (f" ({others})" if others else "")


def _optimizer(train: dict) -> str:
    """``adamw lr 0.001``, or ``muon lr 0.02 (x4 on blocks.*.mlp.proj.weight) + adamw lr 0.008 (x75 on
    value_embeds.*) every 2 steps``: each learning rate with its multipliers by parameter pattern, AdamW's with its
    ``train.adam_every`` when above 1; then the weight decay, with its multipliers, when there is one."""
    def setting(text: str, key: str, multipliers: str) -> str:
        muls = ", ".join(f"x{m:g} on {pattern}" for pattern, m in (train.get(multipliers) or {}).items())
        return f"{text} {train.get(key)}" + (f" ({muls})" if muls else "")
    muon = train.get("optimizer") in ("muon", "normuon")
    adam = "adamw" if muon else train.get("optimizer")
    every = train.get("adam_every") or 1          # absent in results written before it was kept
    adamw = setting(f"{adam} lr", "lr", "adam_lr_mul") + (f" every {every} steps" if every > 1 else "")
    text = f"{setting(train['optimizer'] + ' lr', 'muon_lr', 'muon_lr_mul')} + {adamw}" if muon else adamw
    decays = [setting(adam, "weight_decay", "weight_decay_mul")] if train.get("weight_decay") else []
    if muon and train.get("muon_weight_decay"):
        decays.append(f"{train['optimizer']} {train['muon_weight_decay']}")
    if decays:
        text += "; weight decay " + " and ".join(decays)
        text += " (cautious)" if train.get("cautious_weight_decay") else ""
    return text


def _seed_counts(results: Comparison) -> str:
    counts = sorted({len(runs) for runs in results.variants.values()})
    return " or ".join(map(str, counts)) + (" seed" if counts == [1] else " seeds") + " per variant"


def _seconds(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{mean(known):.1f} s (range {min(known):.1f}-{max(known):.1f})" if known else "n/a"


def variant_table(results: Comparison) -> list[str]:
    """A markdown table of the config keys (``model.attention.softmax_p``, ``model.norm_placement``, ...) whose
    values differ between the variants' runs (``name``, ``train.seed`` and the pretrained run ``train.init_from``
    aside), spelled as ``lengthgen config show`` writes them, and which variants are evaluated with BEMA weights."""
    configs = {name: runs[0].config for name, runs in results.variants.items() if runs and runs[0].config}
    if len(configs) < len(results.variants):
        return ["  (no configs recorded)"]
    first = next(iter(configs.values()))
    keys = sorted({key for config in configs.values() for key, _, _ in differences(first, config)}
                  - {"name", "train.seed", "train.init_from"})
    bema = any(runs[0].bema for runs in results.variants.values())
    if not keys and not bema:
        return ["  (all variants share one config)"]
    rows = [["variant", *(f"`{k}`" for k in keys), *(["weights"] if bema else [])]]
    for name, runs in results.variants.items():
        rows.append([name, *(toml_value(_at(configs[name], k)) for k in keys),
                     *((["BEMA" if runs[0].bema else "trained"]) if bema else [])])
    return ["  " + line for line in table(rows)]


def _at(config: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in a config dict (None where missing)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def retrofit_section(results: Comparison) -> list[str]:
    """Retrofit: by length and metric, the change's effect (after - control, the same finetuning without the
    change) and the effect of the finetuning alone (control - before)."""
    if not {"before", "control", "after"} <= set(results.variants):
        return []
    lengths = results.eval_lengths
    rows = [["difference (at length L)", *(length_label(n, results.train_length) for n in lengths)]]
    for name in metric_names(results):
        at = {n: {v: mean(values) for v, values in seed_values(results, name, n).items()} for n in lengths}
        for label, (a, b) in (("after - control (the change)", ("after", "control")),
                              ("control - before (finetuning)", ("control", "before"))):
            rows.append([f"{name}: {label}", *(_signed(at[n][a] - at[n][b]) for n in lengths)])
    return ["## Retrofit: the change or more training?", "",
            "**control** is finetuned exactly as **after** (same steps, optimizer, schedule and data seeds) but "
            "without the model change, so after - control is the effect of the change and control - before the "
            f"effect of finetuning alone ({results.metric}: {'higher' if results.higher_is_better else 'lower'} is "
            "better). One run each: there is no seed spread to judge these differences against.", "", *table(rows)]


def _signed(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.4g}"


def runs_table(results: Comparison) -> list[str]:
    rows = [["variant", "seed", "parameters", "final train loss", "train s", "eval s"]]
    for variant, runs in results.variants.items():
        for run in runs:
            final = f"diverged: {run.diverged}" if run.diverged else _or_na(run.final_train_loss, ".4g")
            rows.append([variant, _or_na(run.seed), _or_na(run.parameters, ","), final,
                         _or_na(run.train_seconds, ".1f"), _or_na(run.eval_seconds, ".1f")])
    return ["## Runs", "", *table(rows)]


def _or_na(value, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)
