"""A config's [compare] section: variants and bases as config changes, seed 000's pretrain-then-finetune
protocol in one command, BEMA weights evaluated beside the live ones, and the errors."""

from __future__ import annotations

import json

import pytest
from helpers import TINY_RUN_WARNINGS

from lengthgen.cli import main
from lengthgen.config import ConfigError
from lengthgen.eval import Comparison
from lengthgen.experiments.compare import base_config, plan, run_compare

TINY = ["data.task=counting", "data.length=8", "train.steps=2", "model.dim=16", "model.heads=2", "model.layers=1",
        "train.batch_size=4", "compare.eval_lengths=[8, 16]", "compare.eval_tokens=32"]
PLACEMENTS = 'compare.variants={pre = {model.norm_placement = "pre"}, post = {model.norm_placement = "post"}}'
BASES = 'compare.bases={rope = {}, nope = {model.attention.position = "nope"}}'
VARIANTS = 'compare.variants={l1 = {}, avnorm = {model.attention.out_norm = "head_layer"}}'
QUIET = dict(progress=False, log=lambda _: None)


@TINY_RUN_WARNINGS
def test_variants_and_bases_are_config_changes(tmp_path):
    cfg = base_config(None, TINY + [PLACEMENTS, BASES])
    results = run_compare(cfg, tmp_path, **QUIET)
    assert list(results.variants) == ["rope/pre", "rope/post", "nope/pre", "nope/post"]
    for name, (run,) in results.variants.items():
        base, variant = name.split("/")
        assert run.config["model"]["norm_placement"] == variant
        assert run.config["model"]["attention"]["position"] == ("nope" if base == "nope" else "rope")
        assert results.specs[name]["position"] == run.config["model"]["attention"]["position"]
    assert (tmp_path / "runs" / "nope" / "post-seed0" / "latest.json").is_file()
    # --variants / --bases select among them; attention presets still work beside them
    selected = plan(cfg, ["post", "l2"], ["nope"])
    assert list(selected.runs) == ["nope/post", "nope/l2"]
    assert selected.config("nope/l2", 0).model.attention.softmax_p == 2.0


@TINY_RUN_WARNINGS
def test_pretrain_protocol_finetunes_every_variant_from_its_base_and_evaluates_bema(tmp_path):
    """Seed 000: pretrain each base, then finetune every variant from it (the unchanged one is 'continued')."""
    cfg = base_config(None, TINY + [BASES, "compare.pretrain_steps=3", "train.bema.enabled=true",
                                    VARIANTS])
    results = run_compare(cfg, tmp_path, **QUIET)
    assert list(results.variants) == ["rope/l1", "rope/l1+bema", "rope/avnorm", "rope/avnorm+bema", "nope/l1",
                                      "nope/l1+bema", "nope/avnorm", "nope/avnorm+bema"]
    assert [run.bema for run in results.variants["nope/avnorm+bema"]] == [True]
    assert results.variants["nope/avnorm"][0].bema is False
    for base in ("rope", "nope"):
        folder = tmp_path / "pretrain" / f"{base}-seed0"
        assert json.loads((folder / "latest.json").read_text())["step"] == 3
        pretrained = json.loads((folder / "config.json").read_text())
        assert pretrained["train"]["steps"] == 3 and pretrained["model"]["attention"]["out_norm"] == "none"
        for variant in ("l1", "avnorm"):
            run = results.variants[f"{base}/{variant}"][0]
            assert run.config["train"]["init_from"] == str(folder) and run.config["train"]["steps"] == 2
            assert run.config["model"]["attention"]["out_norm"] == ("head_layer" if variant == "avnorm" else "none")
    assert results.retrofit["pretrain_steps"] == 3 and results.retrofit["finetune_steps"] == 2
    assert results.retrofit["bases"] == {"rope": {}, "nope": {"model": {"attention": {"position": "nope"}}}}
    report = (tmp_path / "report.md").read_text()
    assert "retrofit protocol" in report
    training = next(line for line in report.splitlines() if line.startswith("- **Training**"))
    assert "before" not in training and "pretrained 3 steps" in training, training   # no 'before' variant here
    assert Comparison.load(tmp_path / "results.json") == results



@TINY_RUN_WARNINGS
def test_a_finetune_keeps_the_bases_checkpoints_so_resume_continues_it(tmp_path):
    """A compare's finetunes were checkpointed at their end only (`finetune_config` sets 0 for `retrofit`), so a
    finetune cut short (preempted, killed) restarted from step 0 on --resume even where the config asks for
    checkpoints (seed 000's preset: every 500 of its 1000 finetuning steps); they keep the base's setting."""
    cfg = base_config(None, TINY + [BASES, "compare.pretrain_steps=3", "train.checkpoint_every=1", VARIANTS])
    finetune = plan(cfg).config("rope/avnorm", 0, pretrained=tmp_path)
    assert finetune.train.checkpoint_every == 1 and finetune.train.init_from == str(tmp_path)
    results = run_compare(cfg, tmp_path / "c", **QUIET)
    assert results.variants["rope/avnorm"][0].config["train"]["checkpoint_every"] == 1
    steps = sorted(p.name for p in (tmp_path / "c" / "runs" / "rope" / "avnorm-seed0" / "checkpoints").iterdir())
    assert len(steps) == 2, steps

def test_protocol_is_one_command_from_a_config(tmp_path, capsys):
    config = tmp_path / "protocol.toml"
    config.write_text('name = "tiny-protocol"\n[model]\ndim = 16\nheads = 2\nlayers = 1\n'
                      '[train]\nsteps = 1\nbatch_size = 4\n[data]\ntask = "counting"\nlength = 8\n'
                      '[compare]\neval_lengths = [8, 16]\neval_tokens = 32\n'
                      'bases = {pe = {}, nope = {model.attention.position = "nope"}}\n'
                      'variants = {l1 = {}, rms = {model.attention.out_norm = "head_rms"}}\n')
    out = tmp_path / "out"
    assert main(["compare", "--config", str(config), "--pretrain-steps", "1", "--bases", "nope", "--variants",
                 "l1,rms", "--seeds", "2", "--out", str(out), "--no-progress"]) == 0
    results = Comparison.load(out / "results.json")
    assert list(results.variants) == ["nope/l1", "nope/rms"] and len(results.variants["nope/rms"]) == 2
    assert (out / "pretrain" / "nope-seed1").is_dir() and not (out / "pretrain" / "pe-seed0").exists()
    assert "nope/rms" in capsys.readouterr().out


@TINY_RUN_WARNINGS
def test_workers_give_the_sequential_results(tmp_path):
    """compare.workers=2 trains the pretraining and finetuning runs two at a time in their own processes; every
    evaluation (and BEMA's) equals the sequential comparison's, in the same order, and every run's log lines
    are logged."""
    cfg = base_config(None, TINY + [BASES, "compare.pretrain_steps=2", "train.bema.enabled=true", "train.threads=1",
                                    "compare.seeds=[0, 1]", VARIANTS])
    one = run_compare(cfg, tmp_path / "one", bases=["nope"], **QUIET)
    lines = []
    two = run_compare(cfg.override("compare.workers=2"), tmp_path / "two", bases=["nope"], progress=False,
                      log=lines.append)
    assert list(two.variants) == list(one.variants) and len(one.variants) == 4
    for name, runs in one.variants.items():
        for a, b in zip(runs, two.variants[name], strict=True):
            assert (b.seed, b.lengths, b.final_train_loss, b.train_tokens) == \
                (a.seed, a.lengths, a.final_train_loss, a.train_tokens), name
            assert b.run_dir.startswith(str(tmp_path / "two" / "runs"))
    assert sum("trained in" in line for line in lines) == 2 + 4
    assert any(line.startswith("[nope/avnorm+bema seed 1] abs_error at length 8:") for line in lines)


def test_workers_need_each_runs_threads():
    with pytest.raises(ConfigError, match=r"compare.workers=2 runs several runs at once: set train.threads"):
        plan(base_config(None, TINY + ["compare.workers=2", "train.threads=0"]))


@pytest.mark.parametrize("override, match", [
    ('compare.variants={bad = {model.norm_placement = "middle"}}',
     r"compare.variants.bad: model.norm_placement='middle' is not valid"),
    ("compare.variants={bad = 3}", r"compare.variants.bad=3 is not valid; it must be a table of config changes"),
    ("compare.nonsense=1", r"compare.nonsense is not a valid key; valid keys: variants, bases"),
    ("compare.seeds=[]", r"compare.seeds=\[\] is not valid"),
])
def test_bad_compare_sections_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        plan(base_config(None, TINY + [override]))


def test_unknown_names_exit_2_before_training(tmp_path, capsys):
    args = ["compare", "--out", str(tmp_path)] + [x for s in TINY + [BASES] for x in ("--set", s)]
    assert main(args + ["--bases", "alibi"]) == 2
    assert "unknown base 'alibi'; the config's compare.bases: rope, nope" in capsys.readouterr().err
    assert main(args + ["--variants", "post"]) == 2
    assert "unknown variant 'post'; choose among baseline" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@TINY_RUN_WARNINGS
def test_each_run_is_evaluated_on_its_own_data(tmp_path):
    """Bases may change the data (e.g. one Tomita grammar each): a run's numbers are `lengthgen eval`'s."""
    from lengthgen.experiments.eval_run import eval_run

    cfg = base_config(None, TINY + ["compare.bases={two = {data.task_kwargs.vocab_size = 2}, "
                                    "eight = {data.task_kwargs.vocab_size = 8}}"])
    results = run_compare(cfg, tmp_path, variants=["baseline"], **QUIET)
    for base in ("two", "eight"):
        (run,) = results.variants[f"{base}/baseline"]
        assert run.config["data"]["task_kwargs"]["vocab_size"] == {"two": 2, "eight": 8}[base]
        again = eval_run(run.run_dir, lengths=[8, 16], tokens=32)
        assert [r.at_length for r in again.lengths] == [r.at_length for r in run.lengths]
