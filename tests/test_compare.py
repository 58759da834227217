"""`lengthgen compare` / `report` end to end on a tiny setting, and their errors."""

import dataclasses
import re
import warnings

import pytest
from helpers import TINY_RUN_WARNINGS

from lengthgen.cli import main
from lengthgen.config import ConfigWarning
from lengthgen.data.tasks import make_task
from lengthgen.eval import Comparison, RunEval
from lengthgen.experiments.compare import base_config, parse_variants, run_compare
from lengthgen.report import markdown_report, verdicts, write_report
from lengthgen.report.tables import conclusion, value_rows

TINY = ["data.task=counting", "train.steps=3", "model.dim=16", "model.heads=2", "model.layers=1", "train.batch_size=4"]


def test_parse_variants_errors_name_the_choices():
    assert parse_variants("baseline, l2") == ["baseline", "l2"]
    with pytest.raises(ValueError, match="unknown variant 'nope2'.*baseline"):
        parse_variants("baseline,nope2")
    with pytest.raises(ValueError, match="no variants"):
        parse_variants(" , ")


def test_unknown_variant_lists_a_config_variant_named_like_a_preset_once():
    with pytest.raises(ValueError) as err:
        parse_variants("l2wn", {"baseline": {}, "l2win": {}})
    choices = str(err.value).split("choose among ")[1].split(", ")
    assert choices[:3] == ["baseline", "l2win", "l2"] and choices.count("baseline") == 1


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    cfg = base_config(None, TINY + ["data.length=8", "compare.seeds=[0, 1]", "compare.eval_tokens=64"])
    with pytest.warns(ConfigWarning) as caught:         # what a 3-step comparison of 2 seeds rightly says
        results = run_compare(cfg, out, variants=["baseline", "avnorm"], progress=False, log=lambda _: None)
    assert {str(w.message).partition(":")[0] for w in caught} == {"train.warmup_steps=20 > train.steps=3",
                                                                  "compare.seeds"}
    return out, results


def test_compare_writes_all_four_report_files(tiny_compare):
    out, results = tiny_compare
    for name in ("results.json", "report.md", "extrapolation.png", "diagnostics.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "extrapolation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = Comparison.load(out / "results.json")
    assert saved == results
    assert saved.eval_lengths == [8, 16, 32, 64, 128]
    assert set(saved.variants) == {"baseline", "avnorm"}
    assert [run.seed for run in saved.variants["avnorm"]] == [0, 1]
    assert saved.specs["avnorm"]["out_norm"] == "head_layer"
    run = saved.variants["avnorm"][1]
    assert run.config["train"]["seed"] == 1 and run.config["model"]["attention"]["out_norm"] == "head_layer"
    assert run.provenance.device == "cpu" and run.provenance.torch and saved.title == "lengthgen compare: counting"


def test_report_table_matches_the_results(tiny_compare):
    out, results = tiny_compare
    rows = {row[0]: row for row in value_rows(results, "abs_error", ratio=True)}
    values = [run.lengths[2].at_length["abs_error"] for run in results.variants["baseline"]]
    assert rows["variant"][3] == "32 (4x)"
    assert rows["baseline"][3].startswith(f"{sum(values) / 2:.4g} [{min(values):.4g}, {max(values):.4g}]")
    assert rows["baseline"][1].endswith("(1x)")
    chance = make_task("counting").chance("abs_error", 32)[16:].mean()
    assert rows["chance"][3] == f"{float(chance):.4g}"
    text = (out / "report.md").read_text()
    assert "| baseline |" in text and "| avnorm |" in text and "128 (16x)" in text
    assert conclusion(results) in text and f"| best (rule) | {verdicts(results)[8].short()} |" in text
    assert "![abs_error by evaluated length and by position](extrapolation.png)" in text
    assert "![attention diagnostics by position](diagnostics.png)" in text


def test_compare_records_what_was_trained_and_the_chance_level(tiny_compare):
    from lengthgen.model import GPT
    from lengthgen.train.config import RunConfig

    _, results = tiny_compare
    task = make_task("counting")
    for runs in results.variants.values():
        for run in runs:
            assert run.train_tokens == 3 * 4 * 8                    # steps x batch x length
            assert run.parameters == GPT(RunConfig.from_dict(run.config).model).num_parameters()
            row = run.at(128)
            assert row.chance["abs_error"] == pytest.approx(float(task.chance("abs_error", 128)[64:].mean()))
            assert [b.hi for b in row.chance_buckets["abs_error"]] == [b.hi for b in row.buckets["abs_error"]]
            assert "rel_error" not in row.chance


def test_report_command_rebuilds_the_report(tiny_compare, tmp_path, capsys):
    out, results = tiny_compare
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == markdown_report(results)
    assert (tmp_path / "diagnostics.png").is_file()
    text = capsys.readouterr().out
    assert "abs_error at length L" in text
    # what it wrote, as compare's last line says it (it named report.md alone)
    assert text.splitlines()[-1] == (f"report: {tmp_path / 'report.md'} (plots diagnostics.png, extrapolation.png; "
                                     "raw results.json)")


def test_report_command_missing_results_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no results file at" in capsys.readouterr().err


def test_compare_command_bad_variant_exits_2(tmp_path, capsys):
    assert main(["compare", "--variants", "baseline,bogus", "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_compare_command_bad_metric_exits_2_before_training(tmp_path, capsys):
    """The line names the key --metric sets (it named none: ``metric 'accuracy' is not reported by ...``)."""
    assert main(["compare", "--task", "counting", "--metric", "accuracy", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("lengthgen compare: error: compare.metric='accuracy' is not reported by "
                                       "'counting'; choose loss, abs_error, sq_error, rel_error\n")
    assert not (tmp_path / "runs").exists()


def test_task_flag_on_a_text_config_exits_2_before_training(tmp_path, capsys):
    """--task (compare) or --set data.task (train) on a config of text data set data.task, which text never reads:
    the run trained on the corpus while the command line named a task, without a word."""
    sets = ["data.kind=text", 'data.text={corpus="stdlib"}', *TINY[1:]]
    assert main(["compare", "--task", "mqar", "--out", str(tmp_path / "out")]
                + [x for s in sets for x in ("--set", s)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "lengthgen compare: error: data.task='mqar' is set, but data.kind='text' trains on the corpus in data.text "
        "and does not read it: set data.kind=task (and data.text={}), or leave data.task out"]
    assert not (tmp_path / "out").exists()
    # train read --set data.task on text the same way, and said nothing
    assert main(["train", "--out", str(tmp_path / "run")] + [x for s in [*sets, "data.task=dyck"]
                                                               for x in ("--set", s)]) == 2
    assert "error: data.task='dyck' is set, but data.kind='text'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # a task config switched to text keeps the task it does not read: nothing on the command line named it
    assert main(["train", "--out", str(tmp_path / "text"), "--no-progress"]
                + [x for s in [*sets, "train.steps=1", "train.eval_batches=0"] for x in ("--set", s)]) == 0


def test_a_task_may_headline_another_metric_it_reports():
    """Tomita's headline became the ROC AUC; its accuracy, still reported, can be a comparison's headline."""
    from lengthgen.experiments.compare import check_metric
    tomita = make_task("tomita")
    assert check_metric(tomita, None) == ("roc_auc", True) and check_metric(tomita, "accuracy") == ("accuracy", True)
    assert check_metric(tomita, "loss") == ("loss", False)
    dyck = make_task("dyck")
    assert check_metric(dyck, None) == ("tvd", False)
    assert check_metric(dyck, "legal_accuracy") == ("legal_accuracy", True)
    with pytest.raises(ValueError, match="choose loss, roc_auc, accuracy"):
        check_metric(tomita, "score")
    counting = make_task("counting")      # seed 001's MSE, reported in every counting comparison
    assert check_metric(counting, "sq_error") == ("sq_error", False)
    assert check_metric(counting, "rel_error") == ("rel_error", False)


@TINY_RUN_WARNINGS
def test_default_compare_headlines_loss_and_reports_the_task_metric_too(tmp_path):
    from lengthgen.experiments.compare import default_metric

    cfg = base_config(None, [s for s in TINY if not s.startswith("data.task")] + ["data.length=8"])
    assert cfg.data.task == "dyck" and default_metric(cfg) == "loss"
    cfg = cfg.override("compare.eval_lengths=[8, 16]", "compare.eval_tokens=32",
                       f"compare.metric={default_metric(cfg)}")
    results = run_compare(cfg, tmp_path / "loss", variants=["baseline"], progress=False, log=lambda _: None)
    text = (tmp_path / "loss" / "report.md").read_text()
    assert "## loss at length L (lower is better)" in text and "## tvd at length L (lower is better)" in text
    assert "## legal_accuracy at length L (higher is better)" in text
    assert results.metric == "loss" and not results.higher_is_better
    assert results.directions == {"loss": False, "tvd": False, "legal_accuracy": True}
    # a metric that is not the task's headline keeps its own direction (legal_accuracy: higher is better)
    cfg = cfg.override("compare.metric=legal_accuracy")
    results = run_compare(cfg, tmp_path / "legal", variants=["baseline"], progress=False, log=lambda _: None)
    assert results.metric == "legal_accuracy" and results.higher_is_better


def test_compare_command_tiny_run_and_eval_command(tmp_path, capsys):
    args = ["compare", "--variants", "l2", "--task", "mqar", "--train-length", "16", "--eval-lengths", "16,32",
            "--eval-tokens", "64", "--out", str(tmp_path), "--no-progress"] + \
        [x for s in TINY if not s.startswith("data.task=") for x in ("--set", s)]      # --task sets data.task
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "accuracy at length L" in text
    # one name for the run on every line: its steps said [l2-seed0] (its folder), the rest [l2 seed 0]
    assert {line.partition("]")[0] for line in text.splitlines() if line.startswith("[")} == {"[l2 seed 0"}
    assert main(["eval", str(tmp_path / "runs" / "l2-seed0"), "--lengths", "16,32", "--tokens", "64",
                 "--out", str(tmp_path / "eval.json")]) == 0
    rows = RunEval.load(tmp_path / "eval.json").lengths
    assert [r.length for r in rows] == [16, 32] and "accuracy" in rows[0].at_length
    # one evaluator, one seeding rule: `lengthgen eval` of a compare run reproduces compare's numbers
    compared = Comparison.load(tmp_path / "results.json").variants["l2"][0].lengths
    assert [r.at_length for r in rows] == [r.at_length for r in compared]


def test_too_few_seeds_for_a_winner_are_warned_before_training(tmp_path, capsys):
    """3 seeds can never name a variant best (p >= 2 / C(6, 3) = 0.1 > 0.05): the comparison says so at its start,
    not only in its report; 4 seeds can (p = 0.029) and are not warned about."""
    sets = [x for s in TINY for x in ("--set", s)] + ["--set", "train.steps=1", "--eval-lengths", "16",
                                                      "--eval-tokens", "16", "--no-progress",
                                                      "--variants", "baseline,l2"]
    assert main(["compare", "--seeds", "3", "--out", str(tmp_path / "three"), *sets]) == 0
    assert ("lengthgen compare: warning: compare.seeds: no variant can be named best: 3 seeds separate two variants at "
            "p = 0.1 at best (2 / C(6, 3)), above 0.05; run 4 seeds or more") in capsys.readouterr().err
    assert main(["compare", "--seeds", "4", "--out", str(tmp_path / "four"), *sets]) == 0
    assert "compare.seeds" not in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_a_workers_warnings_are_the_commands_one_line_warnings(tmp_path, capsys, workers):
    """With compare.workers > 1 a run's warnings were printed by its worker process as two-line Python warnings
    ('.../trainer.py:311: ConfigWarning: ...' and the source line) that the command never saw. With one worker
    each run showed it again: every `warnings.catch_warnings` (one per run in its length checks) resets Python's
    record of the warnings it has shown."""
    import json

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(40)))
    text = f'data.text={{corpus="{corpus}", tokenizer="byte", split="val", val_fraction=0.5, cache=false}}'
    sets = [s for s in TINY if not s.startswith("data.task=")] + ["data.kind=text", text, "data.length=16",
                                                                   "train.threads=1"]
    assert main(["compare", "--variants", "baseline", "--seeds", "2", "--workers", str(workers), "--eval-lengths",
                 "16", "--eval-tokens", "32", "--out", str(tmp_path / "out"), "--no-progress"]
                + [x for s in sets for x in ("--set", s)]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "validation split" in line] == [
        "lengthgen compare: warning: the run trains on the validation split (data.text.split='val'): long documents "
        "are evaluated on the text it trained on"]     # once: both runs' warnings say the same


@pytest.mark.parametrize("workers", [1, 2])
def test_a_once_per_length_warning_comes_once_with_workers_too(tmp_path, capsys, workers):
    """The warning that a length is evaluated on the training text comes once per length (`LongDocuments`, shared
    by the runs of a comparison); with compare.workers > 1 each run's worker had its own and the comparison's
    terminal showed it once per run. A warning an earlier run showed alike is now not shown again."""
    import json

    from lengthgen.data.text.corpus import split_of

    corpus = tmp_path / "docs.jsonl"        # the val split's documents are short, the train split's long
    docs = [f"short {i}. " * 3 if split_of(f"docs.jsonl#{i}", 0.5) == "val" else f"long document {i}. " * 30
            for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    text = f'data.text={{corpus="{corpus}", tokenizer="byte", val_fraction=0.5, cache=false}}'
    sets = [s for s in TINY if not s.startswith("data.task=")] + ["data.kind=text", text, "data.length=16",
                                                                   "train.threads=1"]
    assert main(["compare", "--variants", "baseline", "--seeds", "2", "--workers", str(workers), "--eval-lengths",
                 "16,128", "--eval-tokens", "256", "--out", str(tmp_path / "out"), "--no-progress"]
                + [x for s in sets for x in ("--set", s)]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "no document" in line] == [
        "lengthgen compare: warning: no document of the val split has 128 tokens: length 128 is evaluated on 2 long "
        "documents (train split, which the run trained on)"]


@TINY_RUN_WARNINGS
def test_compare_evaluates_under_the_runs_autocast(tmp_path, monkeypatch):
    import torch

    from lengthgen.model import GPT

    seen: list[bool] = []
    original = GPT.forward

    def forward(self, tokens, doc_ids=None):
        if not self.training:
            seen.append(torch.is_autocast_enabled("cpu"))
        return original(self, tokens, doc_ids)

    monkeypatch.setattr(GPT, "forward", forward)
    cfg = base_config(None, TINY + ["data.length=8", "train.steps=1", "train.dtype=bfloat16",
                                    "compare.eval_lengths=[8, 16]", "compare.eval_tokens=32"])
    run_compare(cfg, tmp_path, variants=["baseline"], progress=False, log=lambda _: None)
    assert len(seen) == 3 and all(seen)        # two lengths and the diagnostics pass, all under bf16 autocast


def test_eval_lengths_the_data_cannot_generate_fail_before_training(tmp_path, capsys):
    # MQAR with 256 tokens generates at most 4 * 128 + 3 = 515 (the default lengths stop there)
    args = ["compare", "--task", "mqar", "--train-length", "64", "--out", str(tmp_path / "c"), "--no-progress",
            "--eval-lengths", "64,600"]
    args += [x for s in TINY if not s.startswith("data.task=") for x in ("--set", s)]     # --task sets data.task
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if ": warning: " not in line]
    assert err == ["lengthgen compare: error: compare.eval_lengths: length 600 exceeds the data's maximum length 515"]
    assert not (tmp_path / "c").exists()                      # nothing was trained


def test_a_window_no_length_reaches_is_one_warning_naming_the_key_and_lengths(tmp_path):
    """A window at least as long as every trained and evaluated length hides no key: that variant is its base in
    disguise, once warned about; a window shorter than the longest length is not."""
    windows = "compare.variants={baseline = {}, wide = {model.attention.window = 16}, narrow = " \
              "{model.attention.window = 8}}"
    cfg = base_config(None, TINY + ["data.length=8", "compare.eval_lengths=[8, 16]", "compare.eval_tokens=32",
                                    "train.warmup_steps=0", windows])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_compare(cfg, tmp_path / "out", progress=False, log=lambda _: None)
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert said == ["variant wide: model.attention.window=16 has no effect at lengths 8, 16: it hides no key, so its "
                    "layers are full causal attention, as without a window; set a window below 16"]


def test_each_variant_is_warned_once_about_what_its_run_never_reaches_before_anything_trains(tmp_path, capsys,
                                                                                              monkeypatch):
    """A key a variant sets without effect (tau without a distance term, a p-RoPE fraction without p-RoPE, a Muon
    schedule with AdamW) is one warning naming the variants that set it; the base's own note is said once, unnamed."""
    class Trained(Exception):
        pass

    def run(self, jobs):                # nothing trains: the warnings come first
        raise Trained

    monkeypatch.setattr("lengthgen.experiments.compare.Runner.run", run)
    variants = "compare.variants={baseline = {}, tau = {model.attention.tau = 2.0}, prope = " \
               "{model.attention.prope_fraction = 0.5}, muon = {train.muon_momentum_warmup = 3}, both = " \
               "{model.attention.tau = 2.0, train.muon_momentum_warmup = 3}}"
    overrides = [*TINY, "data.length=8", "compare.eval_lengths=[8, 16]", "train.warmup_steps=4", variants]
    with pytest.raises(Trained):
        main(["compare", *(a for o in overrides for a in ("--set", o)), "--out", str(tmp_path / "c"), "--no-progress"])
    said = [line.removeprefix("lengthgen compare: warning: ") for line in capsys.readouterr().err.splitlines()]
    assert said == ["train.warmup_steps=4 > train.steps=3: the learning rate only reaches 0.75 x train.lr",
                    "variants tau, both: model.attention.tau=2.0 has no effect: it is read only with distance "
                    "scale_invariant or log_bias",
                    "variant prope: model.attention.prope_fraction=0.5 has no effect: it is read only with position "
                    "prope",
                    "variants muon, both: train.muon_momentum_warmup=3: no effect with train.optimizer='adamw' "
                    "(Muon's keys, read only with muon or normuon)"]


@TINY_RUN_WARNINGS
def test_a_variant_that_diverges_in_one_seed_is_reported_as_diverged_and_the_comparison_finishes(tmp_path,
                                                                                                 monkeypatch):
    """A run whose loss turned NaN ended the whole comparison (NonFiniteLossError): the other variants' runs were
    thrown away, --resume diverged again, and leaving the variant out was refused (its run folder was kept). Now it
    counts as the worst value at every length, is never named best, and the report says it diverged."""
    import torch

    from lengthgen.model import GPT

    original = GPT.loss

    def loss(self, output, batch):      # variant bad, seed 1 only (the trainer seeds torch with train.seed)
        value, per = original(self, output, batch)
        return (value * float("nan"), per) if self.config.mlp_ratio == 3.0 and torch.initial_seed() == 1 else \
            (value, per)

    monkeypatch.setattr(GPT, "loss", loss)
    cfg = base_config(None, TINY + ["data.length=8", "compare.seeds=[0, 1]", "compare.eval_tokens=32",
                                    "compare.eval_lengths=[8, 16]",
                                    "compare.variants={good = {}, bad = {model.mlp_ratio = 3.0}}"])
    lines: list[str] = []
    results = run_compare(cfg, tmp_path, progress=False, log=lines.append)
    good, bad = results.variants["good"], results.variants["bad"]
    assert [run.diverged for run in good + bad] == [None, None, None, "training loss is nan at step 0"]
    assert all(bad[1].at(n).at_length["loss"] == float("inf") for n in (8, 16))
    assert all(bad[0].at(n).at_length["loss"] < float("inf") for n in (8, 16))
    assert "[bad seed 1] diverged (training loss is nan at step 0)" in "\n".join(lines)
    assert all(found.best != "bad" for found in verdicts(results).values())
    text = (tmp_path / "report.md").read_text()
    assert "bad seed 1 (training loss is nan at step 0)" in text and "| bad | 1 |" in text
    assert Comparison.load(tmp_path / "results.json").variants["bad"][1].diverged == bad[1].diverged
    again = run_compare(cfg, tmp_path, progress=False, log=lambda _: None, resume=True)
    assert again.variants["bad"][1].diverged == bad[1].diverged
    assert [r.at_length for run in again.variants["good"] for r in run.lengths] == \
        [r.at_length for run in good for r in run.lengths]


@pytest.mark.parametrize("tau, names", [(0, ["v", "v+bema"]), (5, ["v"])])
def test_a_diverged_run_with_bema_has_a_bema_run_where_its_finished_seeds_have_one(tmp_path, tau, names):
    """Its finished seeds have a ``+bema`` evaluation once BEMA started (train.steps >= tau): so has the diverged
    one, each variant keeping a run per seed, and no ``+bema`` variant of the diverged run alone otherwise."""
    from lengthgen.experiments.jobs import Job, diverged_run

    cfg = base_config(None, TINY + ["data.length=8", "train.bema.enabled=true", f"train.bema.tau={tau}"])
    out = diverged_run(Job(cfg, tmp_path, "[v]", "v", (8, 16), 32), "training loss is nan at step 1", {})
    assert [name for name, _ in out] == names and all(run.diverged for _, run in out)
    assert [run.bema for _, run in out] == [False, True][:len(names)]
    assert all(run.at(n).at_length["loss"] == float("inf") for _, run in out for n in (8, 16))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_diverged_pretraining_run_is_named_in_the_error_line(tmp_path, capsys, workers):
    """A pretraining run (compare.pretrain_steps) that diverges still ends the comparison (its variants have no
    weights to start from), but its error line said only 'gradient norm is nan at step 1; ...', not which run: with
    several workers its log lines never came back. It now names the run as the log does."""
    sets = TINY + ["data.length=8", "train.lr=1e30", "train.threads=1"]
    code = main(["compare", "--variants", "baseline", "--seeds", "2", "--pretrain-steps", "2", "--workers",
                 str(workers), "--eval-lengths", "8", "--eval-tokens", "32", "--out", str(tmp_path / "c"),
                 "--no-progress"] + [x for s in sets for x in ("--set", s)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert code == 1 and err.startswith("lengthgen compare: error: [pretrain base seed 0] ") and "nan" in err, err


def test_a_diverged_runs_evaluation_silences_only_its_not_finite_warnings(tmp_path):
    """The evaluation of a diverged run ignored every warning, not only each length's 'output is not finite': a
    text comparison whose first run diverged lost the once-per-length warning that a length is evaluated on the
    training split (`LongDocuments.sample` marks it warned), for every run after it too."""
    from lengthgen.eval import evaluate
    from lengthgen.experiments.jobs import evaluate_diverged
    from lengthgen.train.setup import resolve

    cfg, source = resolve(base_config(None, TINY + ["data.length=8"]))

    def evaluator(model):
        warnings.warn("a warning of the evaluation's own", ConfigWarning)
        return evaluate(model, source, [8], tokens_per_length=32, seed=0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = evaluate_diverged(cfg, evaluator, "training loss is nan at step 1")
    assert run.at(8).at_length["loss"] == float("inf")
    assert [str(w.message) for w in caught] == ["a warning of the evaluation's own"]


def test_an_error_a_run_raises_in_a_worker_names_the_run(tmp_path):
    """With compare.workers > 1 an error that ends the comparison (a config error found only when a run starts,
    a damaged checkpoint on --resume, out of memory) came back from the worker naming no run, its log lines (which
    name it) lost. `Runner.run` now gives it the run's label as ``run_label``, its type and message kept."""
    from lengthgen.config import ConfigError
    from lengthgen.experiments.jobs import Job, Runner

    cfg = base_config(None, TINY + ["data.length=8", "train.threads=1"])
    jobs = [Job(cfg, tmp_path / "good", "good seed 0", "good", (8,), 32, progress=False),
            Job(cfg.override("model.vocab_size=2"), tmp_path / "bad", "bad seed 0", "bad", (8,), 32, progress=False)]
    with pytest.raises(ConfigError, match="^model.vocab_size=2 ") as caught, Runner(2, lambda line: None) as runner:
        runner.run(jobs)
    assert caught.value.run_label == "bad seed 0"


def test_a_failed_worker_jobs_warnings_and_log_lines_come_before_its_error(tmp_path):
    """With compare.workers > 1 the warnings and log lines of a run that raised were dropped (they came back only
    with a result): the run's '[l2 seed 0] training ...' line and the warnings that may explain its error were
    lost, where one worker shows them before the error. They now come with the error, before it."""
    import json

    from lengthgen.config import ConfigError
    from lengthgen.experiments.jobs import Job, Runner, run_job

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(40)))
    text = f'data.text={{corpus="{corpus}", tokenizer="byte", split="val", val_fraction=0.5, cache=false}}'
    cfg = base_config(None, [s for s in TINY if not s.startswith("data.task=")]
                      + ["data.kind=text", text, "data.length=16", "train.threads=1"])
    job = Job(cfg, tmp_path / "run", "l2 seed 0", "l2", (16,), 32, progress=False)
    with warnings.catch_warnings(record=True):
        run_job(job, lambda line: None, {})
    lines: list[str] = []
    with pytest.raises(ConfigError, match="tokens_per_length") as caught, \
            pytest.warns(ConfigWarning, match="the run trains on the validation split"), \
            Runner(2, lines.append) as runner:       # evaluating it fails (no tokens), after its log line
        runner.run([dataclasses.replace(job, resume=True, tokens=0)])
    assert caught.value.run_label == "l2 seed 0"
    assert lines == [f"[l2 seed 0] reused the finished run {tmp_path / 'run'}"]


def test_a_resumed_runs_log_says_only_what_it_does(tmp_path):
    """compare --resume logged '[l2 seed 0] training 3 steps at length 8 (resuming)' before 'reused the finished
    run' for a finished run, which trains nothing; an interrupted run's line now says the step it resumes from, and
    its end line the steps it trained and how long (not 'resumed at step 1' again)."""
    from lengthgen.experiments.jobs import Job, run_job
    from lengthgen.train import train

    cfg = base_config(None, TINY + ["data.length=8"])
    train(cfg, tmp_path / "run", progress=False, stop_at=1)
    job = Job(cfg, tmp_path / "run", "l2 seed 0", "l2", (8,), 16, progress=False, resume=True)
    lines: list[str] = []
    run_job(job, lines.append, {})
    assert lines[0] == "[l2 seed 0] training 3 steps at length 8 (resuming from step 1)"
    assert re.fullmatch(r"\[l2 seed 0\] trained steps 2-3 in \d+ s", lines[1]), lines   # was: 'resumed at step 1 RUN'
    lines.clear()
    run_job(job, lines.append, {})
    assert lines[0] == f"[l2 seed 0] reused the finished run {tmp_path / 'run'}"
    assert len(lines) == 2 and lines[1].startswith("[l2 seed 0] loss at length 8: ")


class _TwoPartError(Exception):
    """An error pickle cannot rebuild (its ``args`` are its message alone), as third-party ones may be."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


class _FailingConfig:
    """A job's config whose reading in the worker raises `_TwoPartError` (importable there: a module-level class)."""

    @property
    def train(self):
        raise _TwoPartError("tokenizer", "the download failed")


def test_an_error_pickle_cannot_rebuild_is_not_taken_for_a_killed_worker(tmp_path):
    """A run's error that pickle cannot rebuild broke the pool in the comparison's process: compare said a worker
    was killed (by the system, out of memory?) and that --resume continues, the error itself lost. It now comes
    back as a RuntimeError naming its type and message (its traceback shows it), named by the run."""
    from lengthgen.experiments.jobs import Job, Runner

    with pytest.raises(RuntimeError, match="^_TwoPartError: tokenizer: the download failed$") as caught, \
            Runner(2, lambda line: None) as runner:
        runner.run([Job(_FailingConfig(), tmp_path / "run", "l2 seed 0", "l2", (8,), 32, progress=False)])
    assert caught.value.run_label == "l2 seed 0"


def test_the_error_line_names_the_run_it_came_from(tmp_path, capsys, monkeypatch):
    """The one-line error shows `Runner.run`'s ``run_label`` for errors the CLI words itself too (out of memory:
    ``error: out of memory (...)`` named no run)."""
    from lengthgen.experiments import jobs

    def out_of_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(jobs, "Trainer", out_of_memory)
    code = main(["compare", "--variants", "baseline", "--seeds", "1", "--eval-lengths", "16", "--eval-tokens", "32",
                 "--out", str(tmp_path / "c"), "--no-progress"] + [x for s in TINY for x in ("--set", s)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert code == 1 and err.startswith("lengthgen compare: error: [baseline seed 0] out of memory (MemoryError)"), err


@TINY_RUN_WARNINGS
def test_resuming_a_finished_comparison_leaves_its_results_and_report_as_they_were(tmp_path):
    """compare --resume of a finished comparison rewrote results.json and report.md with the new evaluation date
    and seconds as their only change, and said nothing about it. Both are now kept byte for byte, and the log says
    so; a resume whose results differ (here one more seed) still writes them."""
    cfg = base_config(None, TINY + ["data.length=8", "compare.eval_tokens=16", "compare.eval_lengths=[8, 16]"])
    run_compare(cfg, tmp_path, variants=["baseline"], progress=False, log=lambda _: None)
    saved = Comparison.load(tmp_path / "results.json")
    saved.provenance.date = saved.variants["baseline"][0].provenance.date = "2000-01-01T00:00:00+00:00"
    saved.variants["baseline"][0].eval_seconds = 1234.5
    saved.save(tmp_path / "results.json")          # as if evaluated at another time, at another speed
    write_report(saved, tmp_path)
    files = {name: (tmp_path / name).read_bytes() for name in ("results.json", "report.md")}
    lines: list[str] = []
    run_compare(cfg, tmp_path, variants=["baseline"], progress=False, resume=True, log=lines.append)
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    assert lines[-1] == "nothing changed: every run was finished and evaluates as before; results.json and " \
                        "report.md are as they were"
    lines.clear()
    more = cfg.override("compare.seeds=[0, 1]")
    run_compare(more, tmp_path, variants=["baseline"], progress=False, resume=True, log=lines.append)
    assert len(Comparison.load(tmp_path / "results.json").variants["baseline"]) == 2
    assert not any(line.startswith("nothing changed") for line in lines)


def test_workers_flush_denormals_as_the_comparisons_process_does():
    """The lengthgen command flushes float32 denormals (ALiBi's far keys made Intel CPUs 3x slower); compare's
    spawned workers started with the default instead, so ``--workers 2`` computed otherwise than one process."""
    from lengthgen.experiments.jobs import Runner
    from lengthgen.train.setup import denormals_flushed, flush_denormals

    assert not denormals_flushed()
    for flush in (True, False):
        flush_denormals(flush)
        try:
            with Runner(2, lambda line: None) as runner:
                assert runner.pool.submit(denormals_flushed).result() is flush
        finally:
            flush_denormals(False)
