"""`lengthgen compare` / `report` end to end on a tiny setting, and their errors."""

import pytest

from lengthgen.attention import PRESETS, AttentionSpec
from lengthgen.cli import main
from lengthgen.eval import Comparison, RunEval
from lengthgen.experiments.compare import base_config, parse_variants, run_compare, variant_spec
from lengthgen.report import markdown_report, summarize

TINY = ["data.task=counting", "train.steps=3", "model.dim=16", "model.heads=2", "model.layers=1", "train.batch_size=4"]


def test_variant_spec_applies_preset_on_top_of_the_base():
    base = AttentionSpec(position="nope", window=32)
    spec = variant_spec(base, "l2")
    assert spec.softmax_p == 2.0 and spec.position == "nope" and spec.window == 32
    assert variant_spec(base, "baseline") == base
    assert variant_spec(AttentionSpec(), "avnorm") == PRESETS["avnorm"]


def test_parse_variants_errors_name_the_choices():
    assert parse_variants("baseline, l2") == ["baseline", "l2"]
    with pytest.raises(ValueError, match="unknown variant 'nope2'.*baseline"):
        parse_variants("baseline,nope2")
    with pytest.raises(ValueError, match="no variants"):
        parse_variants(" , ")


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    cfg = base_config(None, TINY + ["data.length=8"])
    results = run_compare(cfg, out, variants=["baseline", "avnorm"], seeds=[0, 1], eval_tokens=64,
                          progress=False, log=lambda _: None)
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
    rows = {row["variant"]: row for row in summarize(results)}
    runs = results.variants["baseline"]
    expected = sum(run.lengths[2].at_length["abs_error"] for run in runs) / 2
    assert rows["baseline"]["lengths"][32]["abs_error"][0] == pytest.approx(expected)
    assert rows["baseline"]["lengths"][8]["ratio"] == pytest.approx(1.0)
    text = (out / "report.md").read_text()
    assert "| baseline |" in text and "| avnorm |" in text and "128 (16x)" in text
    assert "has the lowest abs_error" in text


def test_report_command_rebuilds_the_report(tiny_compare, tmp_path, capsys):
    out, results = tiny_compare
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == markdown_report(results)
    assert (tmp_path / "diagnostics.png").is_file()
    assert "abs_error by evaluation length" in capsys.readouterr().out


def test_report_command_missing_results_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no results file at" in capsys.readouterr().err


def test_compare_command_bad_variant_exits_2(tmp_path, capsys):
    assert main(["compare", "--variants", "baseline,bogus", "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_compare_command_bad_metric_exits_2_before_training(tmp_path, capsys):
    assert main(["compare", "--task", "counting", "--metric", "accuracy", "--out", str(tmp_path)]) == 2
    assert "choose loss or abs_error" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_default_compare_headlines_loss_and_reports_the_task_metric_too(tmp_path):
    from lengthgen.experiments.compare import default_metric

    cfg = base_config(None, [s for s in TINY if not s.startswith("data.task")] + ["data.length=8"])
    assert cfg.data.task == "dyck" and default_metric(cfg) == "loss"
    run_compare(cfg, tmp_path, variants=["baseline"], eval_lengths=[8, 16], eval_tokens=32,
                metric=default_metric(cfg), progress=False, log=lambda _: None)
    text = (tmp_path / "report.md").read_text()
    assert "## loss by evaluation length" in text and "## legal_accuracy by evaluation length" in text


def test_compare_command_tiny_run_and_eval_command(tmp_path, capsys):
    args = ["compare", "--variants", "l2", "--task", "mqar", "--train-length", "16", "--eval-lengths", "16,32",
            "--eval-tokens", "64", "--out", str(tmp_path), "--no-progress"] + [x for s in TINY for x in ("--set", s)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "accuracy by evaluation length" in text
    assert main(["eval", str(tmp_path / "runs" / "l2-seed0"), "--lengths", "16,32", "--tokens", "64",
                 "--out", str(tmp_path / "eval.json")]) == 0
    rows = RunEval.load(tmp_path / "eval.json").lengths
    assert [r.length for r in rows] == [16, 32] and "accuracy" in rows[0].at_length
    # one evaluator, one seeding rule: `lengthgen eval` of a compare run reproduces compare's numbers
    compared = Comparison.load(tmp_path / "results.json").variants["l2"][0].lengths
    assert [r.at_length for r in rows] == [r.at_length for r in compared]


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
    cfg = base_config(None, TINY + ["data.length=8", "train.steps=1", "train.dtype=bfloat16"])
    run_compare(cfg, tmp_path, variants=["baseline"], eval_lengths=[8, 16], eval_tokens=32, progress=False,
                log=lambda _: None)
    assert len(seen) == 3 and all(seen)        # two lengths and the diagnostics pass, all under bf16 autocast


def test_eval_lengths_the_data_cannot_generate_fail_before_training(tmp_path, capsys):
    # MQAR with 256 tokens generates at most 4 * 128 + 3 = 515; the default 16x of 64 is 1024
    args = ["compare", "--task", "mqar", "--train-length", "64", "--out", str(tmp_path / "c"), "--no-progress"]
    assert main(args + [x for s in TINY for x in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err == ("lengthgen compare: error: --eval-lengths (default 64 x 1,2,4,8,16): length 1024 exceeds the "
                   "data's maximum length 515\n")
    assert not (tmp_path / "c").exists()                      # nothing was trained
    assert main(args + ["--eval-lengths", "64,600"] + [x for s in TINY for x in ("--set", s)]) == 2
    assert "--eval-lengths: length 600 exceeds the data's maximum length 515" in capsys.readouterr().err
