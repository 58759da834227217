"""Reports on hand-made results: the rule that names a winner (separated, overlapping, one seed, at chance),
the tables and report.md that apply it, and the plots' styles, labels, legends, bands and chance lines."""

from __future__ import annotations

import dataclasses
import math
import random
import re

import numpy as np
import pytest
import torch

from lengthgen import GPT, GPTConfig
from lengthgen.data.tasks import make_task
from lengthgen.eval import Bucket, Comparison, LengthEval, Provenance, RunEval, evaluate
from lengthgen.eval.buckets import bucket_edges
from lengthgen.report import markdown_report, run_summary, terminal_table, verdict, verdicts, write_report
from lengthgen.report.plots import diagnostics_figure, extrapolation_figure, variant_styles
from lengthgen.report.stats import above_chance, pair_p, smallest_p
from lengthgen.report.tables import groups, position_table, times

LENGTHS = [16, 32, 64]


def _buckets(length: int, value: float, dense: bool) -> list[Bucket]:
    return [Bucket(lo, hi, value if dense or hi == length else math.nan, hi - lo if dense or hi == length else 0)
            for lo, hi in bucket_edges(length)]


def _run(seed: int, values: dict[int, float], chance: float | None, dense: bool = True) -> RunEval:
    rows = []
    for n, v in values.items():
        rows.append(LengthEval(
            length=n, batch_size=4, batch="4 sampled sequences", at_length={"accuracy": v, "loss": 2 - v},
            mean={"accuracy": v + 0.01, "loss": 2 - v}, buckets={"accuracy": _buckets(n, v, dense)},
            prefix={}, chance={} if chance is None else {"accuracy": chance},
            chance_buckets={} if chance is None else {"accuracy": _buckets(n, chance, dense)},
            diagnostics=[{"inv_wmax": _buckets(n, 2.0 + seed, True), "rms_pre": _buckets(n, 0.5, True),
                          "rms_post": _buckets(n, 1.0, True)}] if n == max(values) else []))
    return RunEval(rows, eval_seed=seed, provenance=Provenance.capture("cpu"), seed=seed, parameters=1000,
                   train_tokens=4096, train_seconds=1.0, eval_seconds=0.5)


def comparison(seeds: dict[str, list[float]], chance: float | None = 0.1, dense: bool = True) -> Comparison:
    """Variants whose seeds score ``seeds[variant]`` at the longest length (and 0.9 at the others)."""
    specs = {name: {"out_norm": "head_layer" if name == "b" else "none", "softmax_p": i + 1.0}
             for i, name in enumerate(seeds)}
    variants = {name: [dataclasses.replace(_run(i, {16: 0.9, 32: 0.9, 64: v}, chance, dense), config={
        "name": f"{name}-{i}", "train": {"seed": i, "steps": 2}, "model": {"dim": 8, "attention": specs[name]}})
        for i, v in enumerate(values)] for name, values in seeds.items()}
    return Comparison(title="test", source="mqar", metric="accuracy", higher_is_better=True, train_length=16,
                      eval_lengths=LENGTHS, config={"model": {"dim": 8}, "train": {"steps": 2}},
                      provenance=Provenance.capture("cpu"),
                      specs=specs, variants=variants)


# ------------------------------------------------------------------ the rule


def test_separated_seeds_name_a_winner_with_the_pairwise_p():
    found = verdict({"a": [0.80, 0.85, 0.90, 0.9], "b": [0.50, 0.60, 0.70, 0.7], "c": [0.2, 0.3, 0.4, 0.4]}, True,
                    chance=0.1)
    assert found.status == "separated" and found.winner == "a" and found.p == pytest.approx(2 / 70)   # 2 / C(8, 4)
    assert "were a and that variant alike" in found.reason and found.short() == "a (p = 0.029)"
    unequal = verdict({"a": [0.8, 0.9, 0.9, 0.9, 0.9], "b": [0.5, 0.6, 0.7, 0.7], "c": [0.1, 0.2, 0.3]}, True)
    assert unequal.p == pytest.approx(2 / 56)       # against c: 1 / C(8, 5) + 1 / C(8, 3), the largest
    assert pair_p(4, 5) == pytest.approx(2 / 126) and smallest_p(3) == pytest.approx(0.1) and smallest_p(1) is None


def test_the_rule_takes_any_numbers_and_refuses_what_is_not_its_arguments():
    """verdict(values, "False") named the lower-is-better variant with the worst values best (a non-empty string is
    true); NumPy or tensor seeds were 'The truth value of an array ... is ambiguous', a number a TypeError deep in."""
    seeds = {"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0]}
    assert verdict({k: np.array(v) for k, v in seeds.items()}, False).winner == "a"
    assert verdict({k: torch.tensor(v) for k, v in seeds.items()}, False).winner == "a"
    with pytest.raises(TypeError, match=r"^verdict: higher_is_better must be True or False, got 'False'$"):
        verdict(seeds, "False")
    with pytest.raises(TypeError, match=r"^verdict: values must map each variant to a list of its seeds' values "):
        verdict({"a": 1.0, "b": 2.0}, False)


def test_separated_with_too_few_seeds_names_no_winner():
    two = verdict({"a": [0.8, 0.9], "b": [0.5, 0.6]}, True)
    assert two.status == "too few seeds" and two.winner is None and two.p == pytest.approx(2 / 6)
    assert "p = 0.33, the largest" in two.reason and "above 0.05" in two.reason
    assert two.short() == "too few seeds (a, p = 0.33)"
    three = verdict({"a": [0.8, 0.9, 0.9], "b": [0.5, 0.6, 0.7]}, True)           # either could separate: 2 / 20
    assert three.status == "too few seeds" and three.p == pytest.approx(0.1)
    unequal = verdict({"a": [0.8, 0.9, 0.9, 0.9], "b": [0.5, 0.6, 0.7]}, True)     # 1 / C(7, 4) + 1 / C(7, 3)
    assert unequal.status == "too few seeds" and unequal.p == pytest.approx(2 / 35)
    # 3 seeds never suffice, however many variants are far worse (the sum over 5 variants was 5 / C(15, 3) = 0.011)
    many = verdict({"a": [0.9, 0.9, 0.9], **{v: [0.1, 0.2, 0.3] for v in "bcde"}}, True)
    assert many.status == "too few seeds" and many.p == pytest.approx(0.1)


@pytest.mark.parametrize("variants, seeds", [(2, 3), (3, 3), (5, 3), (2, 4), (4, 4), (3, 2)])
def test_p_bounds_the_rate_of_a_wrong_winner(variants, seeds):
    """The best variant is wrongly named when another is alike. Two alike variants and the rest far worse: the rule
    finds one of the two separated (named, or too few seeds) at the rate p, within 4 standard errors; every variant
    alike: at most that rate. (The earlier p, sum_i 1 / C(N, n_i), was the second case's rate: with 5 variants x 3
    seeds it stated 0.011 where two alike variants beside three worse ones were separated 10% of the time.)"""
    rng = random.Random(0)
    trials = 10000
    for far in (10.0, 0.0):
        found, p = 0, None
        for _ in range(trials):
            values = {f"v{i}": [rng.random() - (far if i >= 2 else 0.0) for _ in range(seeds)]
                      for i in range(variants)}
            outcome = verdict(values, True)
            if outcome.status in ("separated", "too few seeds"):
                found, p = found + 1, outcome.p
        rate, exact = found / trials, smallest_p(seeds)
        assert p is None or p == pytest.approx(exact)
        if far or variants == 2:
            assert abs(rate - exact) <= 4 * math.sqrt(exact * (1 - exact) / trials), (far, rate, exact)
        else:
            assert rate < exact - 4 * math.sqrt(exact * (1 - exact) / trials), (rate, exact)


def test_with_unequal_seeds_the_fewest_set_p_and_bound_the_rate():
    """Seeds 5, 3, 3, the first two alike and the third far worse (the module docstring's example): each of the two
    is separated 1 / C(8, 3) = 1.8% of the time; the first is named at p = 2 / C(8, 3) = 0.036, against a 3-seed
    variant, and the second never (p = 0.1), so wrong winners come at 1.8%, below p. A p taken against the other
    variants' largest seed count (0.036 for the second too) named both, at 3.6%."""
    rng = random.Random(1)
    trials, named, separated = 10000, {"v0": 0, "v1": 0}, 0
    for _ in range(trials):
        outcome = verdict({"v0": [rng.random() for _ in range(5)], "v1": [rng.random() for _ in range(3)],
                           "v2": [rng.random() - 10 for _ in range(3)]}, True)
        separated += outcome.status in ("separated", "too few seeds")
        if outcome.winner:
            named[outcome.winner] += 1
            assert outcome.p == pytest.approx(2 / 56)
        elif outcome.status == "too few seeds":
            assert outcome.best == "v1" and outcome.p == pytest.approx(0.1)
    exact = 1 / 56
    assert abs(separated / trials - 2 * exact) <= 4 * math.sqrt(2 * exact / trials)
    assert named["v1"] == 0 and abs(named["v0"] / trials - exact) <= 4 * math.sqrt(exact / trials), named


def test_overlapping_seeds_name_no_winner():
    found = verdict({"a": [0.60, 0.95], "b": [0.70, 0.80]}, True, chance=0.1)
    assert found.status == "not separated" and found.winner is None and found.best == "a"
    assert "overlap those of b" in found.reason
    # a variant with a lower mean but a wide spread also blocks the winner
    wide = verdict({"a": [0.80, 0.90], "b": [0.70, 0.75], "c": [0.2, 0.95]}, True)
    assert wide.winner is None and "c" in wide.reason and "b" not in wide.reason.split("those of")[1]


def test_tied_means_are_named_together_not_one_as_best():
    """Seed 003's Tomita 1 (every variant at ROC AUC 1.0 in every seed) read "t1/pre has the best mean, but its
    seeds overlap those of ...": the first of six tied variants was singled out."""
    found = verdict({"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 1.0], "c": [0.5, 0.6, 0.7]}, True, chance=0.5)
    assert found.status == "not separated" and found.winner is None
    assert found.reason.startswith("a and b share the best mean (1)") and "a has the best mean" not in found.reason
    wide = verdict({"a": [0.8, 0.9], "b": [0.85, 0.85], "c": [0.5, 0.86]}, True)
    assert wide.reason == "a and b share the best mean (0.85); the seeds of a also overlap those of c"
    tied_at_chance = verdict({"a": [0.5, 0.5], "b": [0.5, 0.5]}, True, chance=0.5)
    assert tied_at_chance.status == "at chance" and tied_at_chance.reason.startswith("a and b, tied for the best mean")

def test_one_seed_never_names_a_winner():
    found = verdict({"a": [0.99], "b": [0.1]}, True, chance=0.01)
    assert found.status == "one seed" and found.winner is None and found.best == "a"
    assert "every variant has a single seed" in found.reason
    mixed = verdict({"a": [0.99, 0.98], "b": [0.1]}, True)
    assert mixed.status == "one seed" and "b has a single seed" in mixed.reason
    none = verdict({"a": [0.99, 0.98], "b": []}, True)         # a variant without runs said "b has a single seed"
    assert none.status == "one seed" and none.reason.startswith("b has fewer than two seeds, so the seed spread")


def test_no_winner_at_or_below_chance():
    # separated, but one seed of the best is at the chance level
    found = verdict({"a": [0.50, 0.52], "b": [0.30, 0.40]}, True, chance=0.50)
    assert found.status == "at chance" and found.winner is None and found.at_chance == ["a", "b"]
    assert verdict({"a": [0.51, 0.52, 0.53, 0.52], "b": [0.3, 0.4, 0.4, 0.3]}, True, chance=0.50).winner == "a"
    # lower is better: a loss at or above the chance loss is at chance
    assert verdict({"a": [1.0, 1.1], "b": [2.0, 2.1]}, False, chance=1.05).status == "at chance"
    assert verdict({"a": [1.0, 1.1, 1.1, 1.0], "b": [2.0, 2.1, 2.2, 2.0]}, False, chance=1.2).winner == "a"
    assert above_chance([0.2, 0.3], 0.1, True) and not above_chance([0.2, math.nan], 0.1, True)


def test_a_tie_with_a_variant_above_chance_is_not_called_at_chance():
    """a (one seed at chance) and b (every seed above it) tie for the best mean: the verdict said "a and b, tied for
    the best mean, are not better than the chance level in every seed", of b too, beside "Not better than chance in
    every seed: a"; its status hung on which of the two float rounding put first."""
    for seeds in ({"a": [0.4, 0.8], "b": [0.6, 0.6]}, {"b": [0.6, 0.6], "a": [0.4, 0.8]}):
        found = verdict(seeds, True, chance=0.5)
        assert found.status == "not separated" and found.at_chance == ["a"]
        assert re.fullmatch(r"(a and b|b and a) share the best mean \(0\.6\)", found.reason)
    both = verdict({"a": [1.2, 0.8], "b": [1.0, 1.0], "c": [2.0, 2.0]}, False, chance=0.9)   # lower is better
    assert both.status == "at chance" and both.reason.startswith("a and b, tied for the best mean, are not better")


def test_nan_seeds_cannot_be_ranked_and_a_lone_variant_is_not_compared():
    assert verdict({"a": [math.nan, 0.9], "b": [0.5, 0.6]}, True).status == "NaN seeds"
    # b is separated from a's finite seeds, but a's NaN seed could be anywhere: no winner
    found = verdict({"a": [math.nan, 0.4, 0.3, 0.2], "b": [0.5, 0.6, 0.7, 0.8]}, True)
    assert found.status == "NaN seeds" and found.winner is None and found.best == "b" and found.at_chance == []
    assert "a has seeds without a value" in found.reason
    # an infinite loss is a value (the worst): the other variant can be named
    assert verdict({"a": [1.0, 1.1, 1.2, 1.1], "b": [2.0, math.inf, 2.2, 2.1]}, False).winner == "a"
    assert verdict({"a": [math.nan], "b": [math.nan]}, True).status == "no value"
    assert verdict({"a": [0.5, 0.6]}, True).status == "one variant"


# ------------------------------------------------------------------ tables and report.md


def test_report_names_the_winner_only_when_separated():
    separated = comparison({"a": [0.80, 0.85, 0.90, 0.85], "b": [0.50, 0.60, 0.70, 0.60]})
    text = markdown_report(separated)
    assert "At 64 tokens (4x the training length) **a** has the highest accuracy" in text
    assert "| best (rule) | not separated | not separated | a (p = 0.029) |" in text   # 0.9 for all at 16 and 32
    assert "| a | 0.9 [0.9, 0.9] (1x) |" in text and "0.85 [0.8, 0.9] (0.944x)" in text
    assert "| chance | 0.1 | 0.1 | 0.1 |" in text
    assert terminal_table(separated).splitlines()[-1].startswith("At 64 tokens (4x the training length) a has")
    overlapping = comparison({"a": [0.60, 0.95], "b": [0.70, 0.80]})
    assert "no variant is named best (not separated)" in markdown_report(overlapping)
    assert "no variant is named best (not separated)" in terminal_table(overlapping)


def test_a_named_winner_is_printed_apart_from_the_others():
    """Means of 0.11072 and 0.11067 both printed "0.1107" while the verdict named a best: the winner's column gets
    the digits that show the separation; the other columns, without a winner, keep 4."""
    results = comparison({"a": [0.11071, 0.11072, 0.11073, 0.11072], "b": [0.11066, 0.11067, 0.11068, 0.11067]},
                         chance=0.110708)
    assert verdicts(results)[64].winner == "a"
    text, terminal = markdown_report(results), terminal_table(results)
    assert "| a | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.11072 [0.11071, 0.11073] (0.123x) |" in text
    assert "| b | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.11067 [0.11066, 0.11068]° (0.123x) |" in text
    assert "| chance | 0.1107 | 0.1107 | 0.110708 |" in text      # the winner's worst seed 0.11071 beats it
    assert "Means: a 0.11072, b 0.11067." in text
    assert "Not better than chance (0.110708) in every seed: b." in text
    assert "Means: a 0.11072, b 0.11067." in terminal and "0.11072 [0.11071, 0.11073]" in terminal


def test_a_separation_with_too_few_seeds_is_printed_apart():
    """The verdict row said "too few seeds (post, p = 0.1)", every seed of post beating every other's, beside cells
    and means that printed alike (set complement at 16x: 0.7479 [0.7479, 0.7479] for post and post+bema): a
    separated best has the digits that show it, named or not."""
    results = comparison({"a": [0.110712, 0.110714, 0.110716], "b": [0.110701, 0.110703, 0.110704]})
    assert verdicts(results)[64].short() == "too few seeds (a, p = 0.1)"
    text = markdown_report(results)
    assert "| a | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.11071 [0.11071, 0.11072] (0.123x) |" in text
    assert "| b | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.1107 [0.1107, 0.1107] (0.123x) |" in text
    assert "Means: a 0.11071, b 0.1107." in text


def test_a_value_better_than_chance_never_prints_as_the_chance_level():
    """No ° says every seed beats the chance level: a cell "0.1 [0.1, 0.1]" unmarked beside a chance row "0.1" (set
    complement at 16x: 0.748 [0.7479, 0.748] against 0.748; Tomita's loss 0.6931 [0.6931, 0.6931] against 0.6931)
    read as at chance. That length gets the digits to show the worst seed apart from the level, in every metric's
    table, lower or higher better; a seed at it keeps its mark whatever the digits."""
    results = comparison({"a": [0.10002, 0.10004], "b": [0.5, 0.6]}, chance=0.1)
    text = markdown_report(results)
    assert "| a | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.10003 [0.10002, 0.10004] (0.111x) |" in text
    assert "| chance | 0.1 | 0.1 | 0.1 |" in text
    at = comparison({"a": [0.10002, 0.1], "b": [0.5, 0.6]}, chance=0.1)
    assert "| 0.1 [0.1, 0.1]° (0.111x) |" in markdown_report(at)       # a seed at chance: marked, 4 digits
    lower = comparison({"a": [0.099998, 0.099996], "b": [0.5, 0.6]}, chance=0.1)
    lower.higher_is_better = False
    assert "| 0.099997 [0.099996, 0.099998] (0.111x) |" in markdown_report(lower)
    results.metric, results.directions = "loss", {"loss": False, "accuracy": True}     # another metric's table too
    other = markdown_report(results).split("## accuracy at length L (higher is better)")[1]
    assert "| a | 0.9 [0.9, 0.9] | 0.9 [0.9, 0.9] | 0.10003 [0.10002, 0.10004] |" in other


def test_nan_seeds_are_counted_in_cells_and_listed_last():
    results = comparison({"c": [math.nan] * 3, "a": [0.5, math.nan, math.nan], "b": [0.8, 0.9, 0.7]})
    text = markdown_report(results)
    assert "| a | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | 0.5 (1 of 3 seeds) (0.556x) |" in text
    assert "no variant is named best (NaN seeds): c, a have seeds without a value" in text
    assert text.count("Means: b 0.8, a 0.5 (1 of 3 seeds).") == 1
    assert "Not better than chance" not in text         # a's seed with a value beats chance; c has none


def test_an_undefined_metric_says_why_and_never_prints_nan():
    """Tomita's ROC AUC over a batch of one sequence (one class) is NaN: run summaries printed "nan (nan)", report.md
    "n/a (nanx)" and a verdict "no value" without a reason."""
    results = comparison({"a": [math.nan, math.nan], "b": [math.nan, math.nan]})
    why = "one class at this length (a batch of 1 sequence)"
    for run in (run for runs in results.variants.values() for run in runs):
        run.at(64).undefined["accuracy"] = why
    text, terminal = markdown_report(results), terminal_table(results)
    summary = run_summary(results.variants["a"][0], "accuracy")
    assert f"| a | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | undefined: {why} |" in text
    assert (f"no variant is named best (no value): no variant has a finite value in every seed; accuracy is "
            f"undefined there: {why}.") in terminal
    assert f"length 64: accuracy undefined: {why} [chance 0.1], loss n/a" in summary
    r = results.variants["a"][0].at(64)         # the one formatter of the summaries and compare's log lines
    assert (r.value_text("accuracy"), r.value_text("loss"), r.value_text("absent")) == (f"undefined: {why}", "n/a",
                                                                                        "n/a")
    assert not re.search(r"\bnan", text + terminal + summary)


def test_a_run_summary_prints_the_all_positions_mean_only_where_it_reads_differently():
    """Two different means that agree to 4 digits printed as 'loss 4.054 (4.054)', as if one value twice."""
    run = comparison({"a": [0.9]}).variants["a"][0]
    r = run.at(64)
    r.at_length["loss"], r.mean["loss"] = 4.05401, 4.05399
    r.at_length["accuracy"], r.mean["accuracy"] = 0.5, 0.25
    summary = run_summary(run, "accuracy")
    assert "length 64: accuracy 0.5 (0.25) [chance 0.1], loss 4.054" in summary.splitlines()
    assert "in parentheses, where it differs: mean over all positions [0, L)" in summary


def test_one_sampled_sequence_is_singular_and_still_summarized_by_tokens():
    """evaluate at one sequence per length wrote "1 sampled sequences", in eval's summary and the report."""
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    row = evaluate(model, task, [64], tokens_per_length=64, diagnostics=False).lengths[0]
    assert (row.batch_size, row.batch) == (1, "1 sampled sequence")
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for runs in results.variants.values():
        for run in runs:
            for r in run.lengths:
                r.batch_size, r.batch = 1, row.batch
    text = markdown_report(results)
    assert "per length 64 tokens (at 64: 1 sampled sequence)" in text and "batches by length" not in text


def test_a_merged_report_lists_each_device_and_code_its_runs_were_evaluated_with():
    """Merged comparisons showed the first one's Compute and Code only, as if every run had been evaluated there."""
    merged, other = comparison({"a": [0.8, 0.9]}), comparison({"b": [0.5, 0.6]})
    for run in other.variants["b"]:
        run.provenance = dataclasses.replace(run.provenance, device="cuda:0 (NVIDIA H100)", torch="2.5.1",
                                             git_commit="0123456789abcdef")
    assert "- **Compute**: cpu;" in markdown_report(merged)         # one origin: as before
    merged.merge(other)
    text = markdown_report(merged)
    p = merged.variants["a"][0].provenance
    here = f"{p.device}, lengthgen {p.lengthgen}" + (f" (git {p.git_commit[:10]})" if p.git_commit else "")
    assert ("- **Code and device**: they differ between the runs' evaluations\n"
            f"  - {here}, torch {p.torch}: a (seeds 0, 1)\n"
            f"  - cuda:0 (NVIDIA H100), lengthgen {p.lengthgen} (git 0123456789), torch 2.5.1: b (seeds 0, 1)") in text
    assert "- **Compute**: per run" in text and "- **Code**:" not in text


def test_report_lists_each_lengths_documents_for_text():
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    assert "per length 256 tokens (at 64: 4 sampled sequences)" in markdown_report(results)
    described = {16: "4 long documents (val split)", 32: "2 long documents (val split; all there are, the same for "
                 "every seed)", 64: "1 long document (train split, which the run trained on; all there are, the same "
                 "for every seed)"}
    for runs in results.variants.values():
        for run in runs:
            for row in run.lengths:
                row.batch = described[row.length]
    text = markdown_report(results)
    assert ("batches by length (seed 0): 16: 4 long documents (val split); 32: 2 long documents (val split; all "
            "there are, the same for every seed); 64: 1 long document (train split, which the run trained on") in text


def test_report_lists_the_documents_of_each_variant_evaluated_on_others():
    """A base that changes the data (another tokenizer: no validation document that long) is evaluated on other
    documents, here the training text; the report described the first run's batches only, "val split", as if
    every run had been evaluated on held-out text."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    described = {"a": "4 long documents (val split)", "b": "4 long documents (train split, which the run trained on)"}
    for name, runs in results.variants.items():
        for run in runs:
            for row in run.lengths:
                row.batch = described[name]
    text = markdown_report(results)
    tail = "; each run draws its documents with its own seed, except where a length takes all there are"
    assert ("- **Evaluation**: lengths 16 (1x), 32 (2x), 64 (4x); the variants were evaluated on other batches:\n"
            "  - a: batches by length (seed 0): 16: 4 long documents (val split); 32: 4 long documents (val split); "
            f"64: 4 long documents (val split){tail}\n"
            "  - b: batches by length (seed 0): 16: 4 long documents (train split, which the run trained on); 32: 4 "
            "long documents (train split, which the run trained on); 64: 4 long documents (train split, which the "
            f"run trained on){tail}\n") in text


def test_variant_names_are_escaped_as_markdown():
    """A variant is named by any TOML key: 'a|b' split its table rows into an extra column, '<b>' vanished as an
    HTML tag, and '*' or '_' at a word's edge turned the text around it into emphasis."""
    names = ["a|b", "<b>", "x*y*", "_u_", "log_n"]
    report = markdown_report(comparison({name: [0.9 - 0.1 * i, 0.92 - 0.1 * i, 0.94 - 0.1 * i, 0.93 - 0.1 * i]
                                         for i, name in enumerate(names)}))
    tables: list[list[int]] = [[]]
    for line in report.splitlines():
        if line.strip().startswith("|"):
            tables[-1].append(len(re.split(r"(?<!\\)\|", line.strip())))     # cells, escaped pipes aside
        elif tables[-1]:
            tables.append([])
    assert len(tables) > 3 and all(len(set(widths)) <= 1 for widths in tables)
    assert "**a\\|b**" in report and "| a\\|b | 0.9 " in report and "| \\<b\\> |" in report
    assert "| x\\*y\\* |" in report and "| \\_u\\_ |" in report
    assert "| log_n |" in report            # an underscore inside a word is no emphasis: left as it is


def test_lengths_that_are_no_multiple_of_the_training_length_have_readable_ratios():
    """Lengths 20, 50 and 100 at training length 12 were labelled 1.66667x, 4.16667x and 8.33333x in every table
    header, the conclusion and the plot's ticks; exact ratios (0.03125x of 64 at 2048) stay exact."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    results.train_length = 12
    text = markdown_report(results)
    assert "| variant | 16 (1.33x) | 32 (2.67x) | 64 (5.33x) |" in text and "(5.33x the training length)" in text
    assert "64 (5.33x)" in terminal_table(results)
    ticks = [t.get_text() for t in extrapolation_figure(results).axes[0].get_xticklabels()]
    assert ticks == ["16\n1.33x", "32\n2.67x", "64\n5.33x"]
    assert [times(n, 2048) for n in (64, 3072, 65536)] == ["0.03125x", "1.5x", "32x"]


def test_report_with_one_seed_says_why_there_is_no_winner():
    text = markdown_report(comparison({"a": [0.9], "b": [0.2]}))
    assert "no variant is named best (one seed): every variant has a single seed" in text
    assert "**a**" not in text and "| a | 0.9 (1x) |" in text


def test_values_at_chance_are_marked_and_never_win():
    results = comparison({"a": [0.10, 0.11], "b": [0.05, 0.08]}, chance=0.1)
    text, terminal = markdown_report(results), terminal_table(results)
    assert verdicts(results)[64].status == "at chance"
    assert "0.105 [0.1, 0.11]° (0.117x)" in text and "0.065 [0.05, 0.08]°" in text
    assert "Not better than chance (0.1) in every seed: a, b." in text
    assert "° = not better than the chance level in every seed" in terminal


def test_each_variant_is_judged_against_its_own_chance_level():
    """A variant may train on another law of the task (compare.variants.x = {data.task_kwargs...}, or a merged
    comparison), with another chance level: every variant was judged against the first run's, so a variant at its
    own chance was named best, unmarked, under a chance row that was not its own."""
    results = comparison({"a": [0.5, 0.6, 0.55], "b": [0.92, 0.93, 0.94], "c": [0.2, 0.3, 0.25]})
    for run in results.variants["b"]:
        for row in run.lengths:
            row.chance = {"accuracy": 0.95}
    found = verdicts(results)[64]
    assert found.winner is None and found.status == "at chance" and found.at_chance == ["b"]
    assert "(0.95)" in found.reason
    text = markdown_report(results)
    assert "| b | 0.9 [0.9, 0.9]° (1x) | 0.9 [0.9, 0.9]° (1x) | 0.93 [0.92, 0.94]° (1.03x) |" in text
    assert "| chance (a) | 0.1 | 0.1 | 0.1 |" in text and "| chance (b) | 0.95 | 0.95 | 0.95 |" in text
    assert "| chance |" not in text
    fig = extrapolation_figure(results)                       # no chance line that is only some variants'
    assert not any(line.get_color() == "black" for ax in fig.axes for line in ax.get_lines())


def test_report_summarizes_the_setup_and_defines_both_means():
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    text = markdown_report(results)
    assert "at length L = mean over positions [L/2, L)" in text
    assert "## accuracy, mean over all positions [0, L)" in text and "| 0.86 [0.81, 0.91] |\n" in text
    assert "1,000 parameters" in text and "4,096 tokens in all" in text and "2 steps" in text
    assert "| variant | `model.attention.out_norm` | `model.attention.softmax_p` |" in text   # the keys that differ
    assert "- **Seeds**: 0, 1 (2 seeds per variant)" in text and "lengths 16 (1x), 32 (2x), 64 (4x)" in text
    assert "![accuracy by evaluated length and by position](extrapolation.png)" in text
    assert "![attention diagnostics by position](diagnostics.png)" in text
    # 1/w_max is of the softmax distribution, not of a p-softmax variant's weights (which do not sum to 1)
    assert "1 / max_j softmax_ij, of the softmax distribution (for p-softmax variants before" in text
    assert diagnostics_figure(results).axes[0].get_ylabel() == "1 / max_j softmax_ij (effective attended keys)"


def test_the_cells_promise_a_ratio_only_where_the_training_length_was_evaluated():
    """Evaluated only beyond the training length, the headline cells have no ratio to it, which the table's
    legend still announced."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    assert "(ratio to the mean at the training length)" in markdown_report(results)
    results.train_length = 8                                  # evaluated at 16, 32, 64 only
    text = markdown_report(results)
    assert "| a | 0.9 [0.9, 0.9] | 0.9 [0.9, 0.9] | 0.85 [0.8, 0.9] |" in text
    assert "ratio" not in text.split("## accuracy at length L")[1].split("## accuracy, mean")[0]


@pytest.mark.parametrize("train, says", [
    ({"optimizer": "adamw", "lr": 0.001}, "; adamw lr 0.001, "),
    ({"optimizer": "muon", "lr": 0.008, "muon_lr": 0.023, "muon_lr_mul": {"blocks.*.mlp.proj.weight": 4.0}},
     "; muon lr 0.023 (x4 on blocks.*.mlp.proj.weight) + adamw lr 0.008, "),
    ({"optimizer": "muon", "lr": 0.008, "muon_lr": 0.023, "adam_lr_mul": {"value_embeds.*": 75.0, "skip.*": 0.05}},
     "; muon lr 0.023 + adamw lr 0.008 (x75 on value_embeds.*, x0.05 on skip.*), "),
    ({"optimizer": "adamw", "lr": 0.001, "adam_lr_mul": {"embed.weight": 2.0}},
     "; adamw lr 0.001 (x2 on embed.weight), "),
    ({"optimizer": "normuon", "lr": 0.008, "muon_lr": 0.023, "adam_every": 2},      # seed 000's DistAdam
     "; normuon lr 0.023 + adamw lr 0.008 every 2 steps, "),
    ({"optimizer": "adamw", "lr": 0.001, "adam_every": 1}, "; adamw lr 0.001, "),
])
def test_report_names_each_optimizers_learning_rate(train, says):
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    results.config["train"].update(train)
    assert says in markdown_report(results)


def test_write_report_writes_every_embedded_plot(tmp_path):
    paths = write_report(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}), tmp_path)
    assert [p.name for p in paths] == ["report.md", "extrapolation.png", "diagnostics.png"]
    for path in paths[1:]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({path.name})" in paths[0].read_text()



def test_rewriting_a_report_leaves_no_plot_of_the_results_before(tmp_path):
    """report --out M of results without diagnostics kept M's diagnostics.png of the results reported there
    before, beside a report.md and results.json that no longer had it."""
    write_report(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}), tmp_path)
    plain = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for run in (run for runs in plain.variants.values() for run in runs):
        run.lengths[-1].diagnostics = []
    assert [p.name for p in write_report(plain, tmp_path)] == ["report.md", "extrapolation.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extrapolation.png", "report.md"]
    needle = tmp_path / "needle"                    # lengthgen needle's own map stays
    needle.mkdir()
    for name in ("needle.json", "needle.png"):
        (needle / name).write_text("x")
    write_report(plain, needle)
    write_report(plain, needle)
    assert sorted(p.name for p in needle.iterdir()) == ["extrapolation.png", "needle.json", "needle.png", "report.md"]



def _needle_plot(path) -> None:
    from lengthgen.eval import NeedleCell, NeedleMap
    from lengthgen.report import plot_needle

    cells = [NeedleCell(depth, 16, 10, 0.5, 0.5, 1.0) for depth in (0.0, 1.0)]
    plot_needle({"a": [NeedleMap("mqar", 1, [0.0, 1.0], [16], cells, 0, Provenance.capture("cpu"))]}, path)


def _theory_plot(path) -> None:
    from lengthgen.report.theory import plot_theory

    plot_theory([{"r": 2.0, "n": n, "monte_carlo": 1.5, "stderr": 0.1, "limit": 2.0} for n in (4, 8)], path)


@pytest.mark.parametrize("plot, name", [
    (lambda out: write_report(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}), out), "extrapolation.png"),
    (lambda out: _needle_plot(out / "needle.png"), "needle.png"), (lambda out: _theory_plot(out / "theory.png"),
                                                                   "theory.png")])
def test_a_plot_that_fails_while_saved_leaves_the_one_before(tmp_path, monkeypatch, plot, name):
    """Figures were saved straight into their file: a crash or a full disk mid-save left a truncated PNG."""
    import io

    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure

    open_before = plt.get_fignums()
    plot(tmp_path)
    assert plt.get_fignums() == open_before              # a saved figure is closed too
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    save = Figure.savefig

    def half_then_fail(fig, fname, **kwargs):        # a disk that fills up halfway through the file
        buffer = io.BytesIO()
        save(fig, buffer, **kwargs)
        with open(fname, "wb") as f:
            f.write(buffer.getvalue()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        plot(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and name in before
    assert plt.get_fignums() == open_before              # the failed figure is closed, not kept by pyplot


def test_retrieval_table_shows_the_seed_spread():
    """The retrieval table showed only the mean over seeds (and the worst depth): no spread, with several seeds."""
    from lengthgen.eval import NeedleCell, NeedleMap

    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for runs in results.variants.values():
        for seed, run in enumerate(runs):           # seed 0 finds 0.2 (depth 0) and 0.4 (depth 1), seed 1 twice that
            run.needle = NeedleMap("mqar", 1, [0.0, 1.0], [16], [
                NeedleCell(depth, 16, 10, (0.2 + 0.2 * depth) * (seed + 1), 0.5, 1.0) for depth in (0.0, 1.0)],
                0, Provenance.capture("cpu"), train_length=16)
    report = markdown_report(results)
    assert "| a | 0.45 [0.30, 0.60], worst depth 0.30 |" in report and "[min, max] over seeds" in report
    results.variants = {"a": results.variants["a"][:1]}
    assert "| a | 0.30, worst depth 0.20 |" in markdown_report(results)     # one seed: no range


def test_retrieval_panel_titles_fit_their_panels():
    """Long variant names ran each retrieval panel's title across its neighbours' (one line per title)."""
    from lengthgen.eval import NeedleCell, NeedleMap
    from lengthgen.report.needle import needle_figure

    for lengths in ([16], [16, 32, 64, 128, 256]):
        nmap = NeedleMap("mqar", 1, [0.0, 1.0], lengths, [NeedleCell(d, n, 10, 0.5, 0.5, 1.0) for n in lengths
                                                         for d in (0.0, 1.0)], 0, Provenance.capture("cpu"))
        fig = needle_figure({f"variant_with_a_rather_long_name_{i}": [nmap] * 3 for i in range(3)})
        fig.canvas.draw()
        for ax in fig.axes[:3]:
            assert ax.title.get_window_extent().width <= ax.get_window_extent().width, lengths
            assert ax.get_title().endswith("\n(mean of 3 seeds)")


def test_many_retrieval_maps_wrap_four_to_a_row():
    """Twelve variants' maps were one row of twelve panels, a figure 36 inches wide whose text could not be read
    once shown at a page's width."""
    from lengthgen.eval import NeedleCell, NeedleMap
    from lengthgen.report.needle import needle_figure

    lengths = [16, 32, 64]
    nmap = NeedleMap("mqar", 1, [0.0, 1.0], lengths, [NeedleCell(d, n, 10, 0.5, 0.5, 1.0) for n in lengths
                                                     for d in (0.0, 1.0)], 0, Provenance.capture("cpu"))
    four = needle_figure({f"v{i}": [nmap] for i in range(4)})
    fig = needle_figure({f"v{i}": [nmap] for i in range(10)})
    panels = {ax.get_title(): ax.get_subplotspec() for ax in fig.axes if ax.get_visible() and ax.get_title()}
    assert len(panels) == 10 and [(panels[f"v{i}"].rowspan.start, panels[f"v{i}"].colspan.start)
                                  for i in (0, 3, 4, 9)] == [(0, 0), (0, 3), (1, 0), (2, 1)]
    assert fig.get_figwidth() == four.get_figwidth()
    assert all(ax.get_ylabel() for ax in fig.axes if ax.get_title() and ax.get_subplotspec().colspan.start == 0)

# ------------------------------------------------------------------ plots


def _lines(fig) -> dict[str, list]:
    """Curve name (gid) -> its lines, over every axis."""
    out: dict[str, list] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_gid():
                out.setdefault(line.get_gid(), []).append(line)
    return out


def _assert_readable(fig) -> None:
    """Labelled axes, and a legend that covers no axis."""
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        assert not box.overlaps(ax.get_window_extent(renderer))


def test_the_by_length_axis_says_what_a_value_at_length_l_averages():
    """A per-position metric is a mean over positions [L/2, L); a per-sequence or whole-batch one (Tomita's ROC
    AUC) is over the length-L sequences, which the label once called a mean over positions too."""
    from lengthgen.report.plots import extrapolation_figure
    per_position = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    per_sequence = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for runs in per_sequence.variants.values():
        for run in runs:
            for row in run.lengths:
                row.buckets, row.chance_buckets = {}, {}
    assert "mean over positions [L/2, L)" in extrapolation_figure(per_position).axes[0].get_ylabel()
    assert "over the length-L sequences" in extrapolation_figure(per_sequence).axes[0].get_ylabel()


def test_one_colour_per_variant_in_every_panel_and_figure():
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6], "c": [0.3, 0.4]})
    styles = variant_styles(results.variants)
    assert len({s["color"] for s in styles.values()}) == len({s["marker"] for s in styles.values()}) == 3
    for fig in (extrapolation_figure(results), diagnostics_figure(results)):
        _assert_readable(fig)
        lines = _lines(fig)
        for variant, style in styles.items():
            assert len(lines[variant]) == 2                          # in both panels
            assert {(line.get_color(), line.get_marker()) for line in lines[variant]} == {
                (style["color"], style["marker"])}
        legend = {t.get_text() for t in fig.legends[0].get_texts()}
        assert {"a", "b", "c", "training length 16"} <= legend and "min-max over seeds (up to 2)" in legend
    assert _lines(diagnostics_figure(results))["b after out-norm"][0].get_linestyle() == "--"


def test_twelve_variants_have_twelve_colours():
    """Colours cycled through matplotlib's ten, so the 11th and 12th variants were drawn in the 1st's and 2nd's
    colours (baseline and a variant eleventh in the list both blue), told apart only by their markers."""
    results = comparison({f"baseline+qk_norm+v{i}": [0.5 + 0.01 * i, 0.55 + 0.01 * i] for i in range(12)})
    lines = _lines(extrapolation_figure(results))
    assert len({lines[name][0].get_color() for name in results.variants}) == 12
    assert variant_styles(results.variants)["baseline+qk_norm+v0"]["color"] == "#1f77b4"    # still C0 first


def test_seed_bands_and_chance_lines():
    fig = extrapolation_figure(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}))
    assert all(len(ax.collections) == 2 for ax in fig.axes)          # one min-max band per variant and panel
    chance = [line for ax in fig.axes for line in ax.get_lines() if line.get_color() == "black"]
    assert len(chance) == 2 and list(chance[0].get_ydata()) == [0.1, 0.1, 0.1]
    assert "chance (trivial baseline)" in {t.get_text() for t in fig.legends[0].get_texts()}
    single = extrapolation_figure(comparison({"a": [0.9], "b": [0.5]}, chance=None))
    assert all(not ax.collections for ax in single.axes)
    assert not any(line.get_color() == "black" for ax in single.axes for line in ax.get_lines())


def test_a_comparison_at_one_length_shows_its_chance_line():
    """Evaluated at one length, the chance 'line' was a single point with no marker: the legend promised a dashed
    chance line that the panel did not show."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}, dense=False)
    results.eval_lengths = [16]
    fig = extrapolation_figure(results)
    (chance,) = [line for line in fig.axes[0].get_lines() if line.get_color() == "black"]
    assert list(chance.get_ydata()) == [0.1, 0.1] and list(chance.get_xdata()) == [0, 1]     # across the panel
    assert "chance (trivial baseline)" in {t.get_text() for t in fig.legends[0].get_texts()}
    at_chance = comparison({"a": [0.0, 0.0], "b": [0.0, 0.0]}, chance=0.01, dense=False)
    at_chance.eval_lengths = [64]
    bottom, top = extrapolation_figure(at_chance).axes[0].get_ylim()     # fitted to 0 and 0.01, not 0 +- 0.055
    assert -0.001 < bottom < 0 and 0.01 < top < 0.011


def test_per_query_metrics_are_plotted_by_length_only():
    sparse = extrapolation_figure(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]}, dense=False))
    (ax,) = sparse.axes
    assert ax.get_xlabel() == "evaluated length L (tokens)" and len(_lines(sparse)["a"][0].get_xdata()) == 3
    assert len(extrapolation_figure(comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})).axes) == 2


def test_with_bases_the_rule_compares_each_bases_variants_apart():
    results = comparison({"a/x": [0.80, 0.85, 0.90, 0.85], "a/y": [0.5, 0.6, 0.7, 0.6],
                          "b/x": [0.82, 0.60, 0.95, 0.82], "b/y": [0.3, 0.4, 0.5, 0.4]})
    assert groups(results) == {"a": ["a/x", "a/y"], "b": ["b/x", "b/y"]}
    assert verdicts(results)[64].winner is None                        # a/x and b/x overlap across the bases
    assert verdicts(results, groups(results)["a"])[64].winner == "a/x"
    assert verdicts(results, groups(results)["b"])[64].winner == "b/x"
    text = terminal_table(results)
    assert "verdict (a)" in text and "verdict (b)" in text and "Among the a/ variants, at 64 tokens" in text
    assert "| best (rule) (b) |" in markdown_report(results)
    assert groups(comparison({"a/x": [0.8], "y": [0.5]})) == {"": ["a/x", "y"]}   # not all based: one group


def test_with_bases_each_base_has_its_panels_and_a_variant_one_style_across_them():
    results = comparison({"a/x": [0.8, 0.9], "a/y": [0.5, 0.6], "b/x": [0.7, 0.8], "b/y": [0.4, 0.5]})
    for fig in (extrapolation_figure(results), diagnostics_figure(results)):     # a row of 2 panels per base
        _assert_readable(fig)
        assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["a", "a", "b", "b"]
        lines = _lines(fig)
        assert {line.axes for line in lines["a/x"]} == set(fig.axes[:2])
        assert {line.axes for line in lines["b/y"]} == set(fig.axes[2:])
        assert lines["a/x"][0].get_color() == lines["b/x"][0].get_color() != lines["a/y"][0].get_color()
        legend = {t.get_text() for t in fig.legends[0].get_texts()}
        assert {"x", "y"} <= legend and not legend & set(results.variants)
    sparse = comparison({f"{base}/{v}": [0.8, 0.9] for base in "abcde" for v in "xy"}, dense=False)
    fig = extrapolation_figure(sparse)                                   # by length only: 4 panels to a row
    assert [ax.get_title()[0] for ax in fig.axes if ax.get_visible()] == list("abcde")
    assert len(fig.axes) == 8 and fig.axes[0].get_ylim() == fig.axes[4].get_ylim()


def test_position_table_shows_a_cut_last_bucket_in_the_row_where_it_starts():
    run = _run(0, {24: 0.5, 64: 0.8}, chance=None)
    text = position_table(run.lengths, "accuracy", train_length=24)
    rows = {line.split("  ")[0].strip(): line.split() for line in text.splitlines()[2:]}
    assert rows["[16, 32) *"][-2:] == ["0.5000", "0.8000"]     # length 24's last bucket is [16, 24)
    assert rows["[8, 16)"][-2:] == ["0.5000", "0.8000"] and "[32, 64) *" in rows
    assert "* = the bucket reaches beyond the training length 24" in text


def test_an_infinite_seed_is_a_cross_at_the_top_not_a_mean():
    results = comparison({"a": [0.8, 0.9, 0.85], "b": [0.5, math.inf, 0.6]})
    fig = extrapolation_figure(results)
    crosses = [line for line in fig.axes[0].get_lines() if line.get_gid() == "infinite"]   # by length
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [64]                   # b at the longest length
    mean = dict(zip(*_lines(fig)["b"][0].get_data()))
    assert math.isnan(mean.get(64, math.nan))                                           # no finite-looking mean there
    assert "a seed's value is infinite" in [t.get_text() for t in fig.legends[0].get_texts()]
    _assert_readable(fig)


def test_an_infinite_mean_has_no_ratio_to_the_training_length():
    """A loss that diverged to inf in every seed read "inf [inf, inf] (infx)" in report.md's headline table."""
    text = markdown_report(comparison({"a": [0.8, 0.9], "b": [math.inf, math.inf], "c": [math.inf, 0.6]}))
    assert "| b | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | inf [inf, inf]° |" in text
    assert "| c | 0.9 [0.9, 0.9] (1x) | 0.9 [0.9, 0.9] (1x) | inf [0.6, inf]° |" in text and "infx" not in text


def test_a_minus_infinite_seed_is_a_cross_at_the_bottom():
    """The evaluator gives a failed model's higher-is-better metric -inf (its worst value): that cross was drawn at
    the top edge, above every finite curve, where an accuracy's best values are."""
    results = comparison({"a": [0.8, 0.9, 0.85], "b": [0.5, -math.inf, 0.6]})
    crosses = [line for line in extrapolation_figure(results).axes[0].get_lines() if line.get_gid() == "infinite"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [64] and list(crosses[0].get_ydata()) == [0.0]


def test_variants_infinite_at_one_length_each_have_a_cross_in_sight():
    """Two variants whose loss diverged at the same length drew their crosses on one spot: only the last variant's
    showed, so the report's plot hid that the others had diverged too."""
    results = comparison({"a": [0.8, 0.9], "b": [math.inf, 0.6], "c": [math.inf, math.inf], "d": [-math.inf, 0.5]})
    colors = {style["color"]: name for name, style in variant_styles(results.variants).items()}
    crosses = {colors[line.get_color()]: list(line.get_ydata())
               for line in extrapolation_figure(results).axes[0].get_lines() if line.get_gid() == "infinite"}
    assert crosses == {"b": [1.0], "c": [0.95], "d": [0.0]}         # -inf at the bottom: nothing there before


def test_a_finite_blow_up_is_off_the_scale_not_a_point_that_flattens_the_others():
    """A variant whose loss blew up to a finite 1e9 was drawn on the linear y axis, flattening every other curve
    onto one line at the bottom. A lower-is-better value above OFF_SCALE x the chance level is now a triangle at the
    top edge (stacked with the crosses of infinite values) with its legend entry; the axis spans the rest."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 1e9], "c": [math.inf, 0.6]})
    results.higher_is_better = False
    fig = extrapolation_figure(results)
    colors = {style["color"]: name for name, style in variant_styles(results.variants).items()}
    for ax in fig.axes:                                       # by length and by position at the longest length
        marks = {(line.get_gid(), colors[line.get_color()]): set(line.get_ydata()) for line in ax.get_lines()
                 if line.get_gid() in ("infinite", "off-scale")}
        assert marks == {("off-scale", "b"): {1.0}, ("infinite", "c"): {0.95}}       # b drawn first
        assert ax.get_ylim()[1] < 2
    assert math.isnan(dict(zip(*_lines(fig)["b"][0].get_data()))[64])
    assert "a seed's value is off the scale (> 100 x chance; see the tables)" in [
        t.get_text() for t in fig.legends[0].get_texts()]
    _assert_readable(fig)
    results.higher_is_better = True                           # an accuracy does not blow up: its values as they are
    assert not [line for line in extrapolation_figure(results).axes[0].get_lines() if line.get_gid() == "off-scale"]


def test_a_length_without_a_value_breaks_the_curve():
    """A length where every seed's value is NaN (a metric undefined there) was skipped and the curve drawn straight
    from the length before to the one after, as if measured in between."""
    from matplotlib.collections import LineCollection

    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for run in results.variants["b"]:
        run.at(32).at_length["accuracy"] = math.nan
    line = _lines(extrapolation_figure(results))["b"][0]
    x, y = (list(values) for values in line.get_data())
    assert x == LENGTHS and math.isnan(y[1]) and not math.isnan(y[0]) and not math.isnan(y[2])
    bars = [c for c in line.axes.collections if isinstance(c, LineCollection)]
    assert [list(map(list, c.get_segments()[0])) for c in bars] == [[[64, 0.5], [64, 0.6]]]   # b's seeds at 64


def test_other_metrics_are_marked_where_their_direction_is_recorded():
    results = comparison({"a": [0.8, 0.9], "b": [0.05, 0.6]})
    results.metric, results.directions = "loss", {"loss": False, "accuracy": True}
    text = markdown_report(results)
    assert "## accuracy at length L (higher is better)" in text
    assert "| b | 0.9 [0.9, 0.9] | 0.9 [0.9, 0.9] | 0.325 [0.05, 0.6]° |" in text   # a seed at 0.05 <= chance 0.1
    results.directions = {}                                  # a file written before directions were kept
    text = markdown_report(results)
    assert "## accuracy at length L\n" in text and "°" not in text.split("## accuracy at length L")[1]


@pytest.mark.parametrize("seed_sd", [0.0, 1.0])
def test_separation_rate_without_a_difference_is_at_most_p(seed_sd):
    """No variant differs: the rule finds a separated variant (named or too few seeds) at the rate p states when
    the runs are independent, and more rarely when the runs of one seed share an effect (its batches: x = b_seed +
    e), where p is an upper bound (module docstring of `lengthgen.report.stats`). 2 variants x 3 seeds: p = 0.1."""
    rng, trials, found = random.Random(0), 4000, 0
    for _ in range(trials):
        b = [rng.gauss(0, seed_sd) for _ in range(3)]
        values = {v: [b[s] + rng.gauss(0, 1) for s in range(3)] for v in ("x", "y")}
        outcome = verdict(values, False)
        found += outcome.status in ("separated", "too few seeds")
        assert outcome.status in ("separated", "too few seeds", "not separated")
    rate, sd = found / trials, math.sqrt(0.1 * 0.9 / trials)
    if seed_sd == 0:
        assert abs(rate - 0.1) < 4 * sd, rate
    else:
        assert rate < 0.1 - 4 * sd, rate


def test_a_variant_no_panel_can_draw_says_so_in_the_legend():
    """A diverged run's attention diagnostics are NaN: its variant stood in the diagnostics legend with nothing
    drawn and no word why. Crosses (infinite values) count as drawn."""
    results = comparison({"a": [0.8, 0.9], "b": [-math.inf, -math.inf]})
    for run in results.variants["b"]:
        for layer in run.at(64).diagnostics:
            for stat, buckets in layer.items():
                layer[stat] = [dataclasses.replace(b, mean=math.nan) for b in buckets]
    legend = lambda fig: [t.get_text() for t in fig.legends[0].get_texts()][:2]  # noqa: E731
    assert legend(diagnostics_figure(results)) == ["a", "b (not drawn: no finite value)"]
    assert legend(extrapolation_figure(results)) == ["a", "b"]
    # a name with a slash: one base (compare --bases post) keeps 'post/a' in the legend, which was read as 'a'
    for names in (["post/a", "post/b"], ["x/y", "z"]):
        drawn = comparison({name: [0.8, 0.9] for name in names})
        assert legend(extrapolation_figure(drawn)) == legend(diagnostics_figure(drawn)) == names


def test_the_setup_describes_what_the_runs_trained_with():
    """The setup's lines read the comparison's base config: a lone variant (or base) that changes train.lr or
    model.norm_placement was reported with the base's values, every run having trained with its own."""
    results = comparison({"a": [0.8, 0.9]})
    results.config = {"model": {"dim": 8, "norm_placement": "pre"}, "train": {"steps": 2, "optimizer": "adamw",
                                                                              "lr": 0.003}}
    for run in results.variants["a"]:
        run.config["model"]["norm_placement"] = "post"
        run.config["train"].update(optimizer="adamw", lr=1e6)
    text = markdown_report(results)
    assert "width 8" in text and "(post)" in text and "adamw lr 1000000.0" in text and "0.003" not in text
    results.variants["b"] = [dataclasses.replace(run, config={**run.config, "train": {**run.config["train"],
                                                                                      "lr": 0.1}})
                             for run in results.variants["a"]]
    text = markdown_report(results)             # the runs differ: the base's value, the table shows theirs
    assert "adamw lr 0.003" in text and "| a | 1000000.0 |" in text and "| b | 0.1 |" in text


def test_a_blown_up_runs_rms_leaves_the_other_curves_readable():
    """A run whose training blew up (lr 300: finite losses of 1e7) had an attention-output RMS of about 4e7, drawn
    on a linear y axis that flattened every other variant's RMS onto one line at the bottom (no chance level to
    set an off-scale rule by). The diagnostics panels' y axes are logarithmic: a 2x change of the other variant's
    RMS over positions spans a visible part of the panel, and the blown-up curve stays drawn inside it."""
    results = comparison({"a": [0.8, 0.9], "c": [0.5, 0.6]})
    for name, scale in (("a", 1.0), ("c", 4e7)):
        for run in results.variants[name]:
            for layer in run.at(64).diagnostics:
                layer["rms_pre"] = [dataclasses.replace(b, mean=scale * (0.5 + 0.5 * i / 6))
                                    for i, b in enumerate(layer["rms_pre"])]
    fig = diagnostics_figure(results)
    fig.canvas.draw()
    rms = fig.axes[1]
    assert rms.get_ylabel() == "attention output RMS per head"
    height = {}
    for line in rms.get_lines():
        if line.get_gid() in ("a", "c"):
            y = rms.transAxes.inverted().transform(rms.transData.transform(line.get_xydata()))[:, 1]
            assert 0 <= y.min() and y.max() <= 1                       # drawn, inside the panel
            height[line.get_gid()] = y.max() - y.min()
    assert height["a"] > 0.02 and height["c"] > 0.02                   # linear: a's 2x spanned 1e-8 of the height
    _assert_readable(fig)


def test_the_variants_table_spells_values_as_config_show_does():
    """The variants table printed Python's spelling (None, False, ['x']) where `lengthgen config show` and the
    configs write TOML's (none, false, ["x"]); config show quotes a string, which tells out_norm's 'none' from a
    key that is not set."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for name, final_norm, stages, kwargs in (("a", False, [[0, 8], [1, 16]], {"names": ["x"]}), ("b", None, [], {})):
        for run in results.variants[name]:
            run.config["model"]["final_norm"] = final_norm
            run.config["train"]["stages"] = stages
            run.config["data"] = {"task_kwargs": kwargs}
    text = markdown_report(results)
    assert ("| variant | `data.task_kwargs.names` | `model.attention.out_norm` | `model.attention.softmax_p` "
            "| `model.final_norm` | `train.stages` |") in text
    assert '| a | ["x"] | "none" | 1.0 | false | [[0, 8], [1, 16]] |' in text
    assert '| b | none | "head_layer" | 2.0 | none | [] |' in text


def test_the_task_line_spells_task_arguments_as_config_show_does():
    """The Task line printed a task's arguments in Python's spelling (``(digits=None, key='a')``)."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for runs in results.variants.values():
        for run in runs:
            run.config["data"] = {"task_kwargs": {"digits": None, "key": "a", "exact": True}}
    assert '- **Task**: `mqar` (digits=none, key="a", exact=true); headline `accuracy`' in markdown_report(results)


def test_the_task_line_names_a_researchers_own_task_class():
    """A task given as module:Class was named by its ``name`` alone, so one named like a built-in (``counting``) read
    as the built-in task: the line adds the class."""
    results = comparison({"a": [0.8, 0.9], "b": [0.5, 0.6]})
    for runs in results.variants.values():
        for run in runs:
            run.config["data"] = {"task": "my_tasks:Counting", "task_kwargs": {"width": 3}}
    results.source = "counting"
    text = markdown_report(results)
    assert "- **Task**: `counting` (class `my_tasks:Counting`, width=3); headline `accuracy`" in text
