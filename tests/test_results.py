"""The results model: typed results survive a save/load round trip; bad files fail with one line naming them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lengthgen.eval import SCHEMA, Bucket, Comparison, LengthEval, Provenance, ResultsError, RunEval


def _run(seed: int = 0) -> RunEval:
    row = LengthEval(length=8, batch_size=2, batch="2 sampled sequences", at_length={"loss": 1.5},
                     mean={"loss": 1.25}, buckets={"loss": [Bucket(0, 1, 1.0, 2), Bucket(4, 8, math.inf, 8)]},
                     prefix={"loss": [Bucket(0, 8, 1.25, 16)]},
                     diagnostics=[{"inv_wmax": [Bucket(0, 1, 1.0, 1)]}], chance={"loss": 2.0},
                     chance_buckets={"loss": [Bucket(0, 1, 1.5, 1), Bucket(4, 8, 2.0, 4)]})
    return RunEval([row], eval_seed=seed, provenance=Provenance.capture("cpu"), config={"train": {"seed": seed}},
                   seed=seed, run_dir="runs/x", final_train_loss=0.5, train_seconds=1.0, eval_seconds=0.5,
                   parameters=1234, train_tokens=4096)


def _comparison() -> Comparison:
    return Comparison(title="lengthgen compare: counting", source="counting", metric="loss",
                      higher_is_better=False, train_length=8, eval_lengths=[8], config={"name": "x"},
                      provenance=Provenance.capture("cpu"), specs={"baseline": {"softmax_p": 1.0}},
                      variants={"baseline": [_run(0), _run(1)]})


def test_run_and_comparison_round_trip(tmp_path):
    run = _run()
    assert RunEval.load(run.save(tmp_path / "eval.json")) == run
    comparison = _comparison()
    comparison.save(tmp_path / "results.json")
    assert Comparison.load(tmp_path / "results.json") == comparison
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "comparison"
    assert set(data["provenance"]) == {"lengthgen", "torch", "device", "date", "git_commit"}
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "plain.txt").write_text("x")   # saved like any new file, not private to its owner
    assert (tmp_path / "results.json").stat().st_mode == (tmp_path / "plain.txt").stat().st_mode


def test_provenance_names_versions_and_device():
    p = Provenance.capture("cpu")
    import torch

    import lengthgen

    assert (p.lengthgen, p.torch, p.device) == (lengthgen.__version__, torch.__version__, "cpu")
    assert p.git_commit is None or len(p.git_commit) == 40


@pytest.mark.parametrize("content, message", [
    ("", "truncated or not JSON"),
    ('{"schema": 1, "kind": "comparison", "title": "x"', "truncated or not JSON"),
    (b"\xff\xfe\x00 garbage", "truncated or not JSON"),
    ("[1, 2]", "no schema version"),
    ('{"kind": "comparison"}', "no schema version"),
    ('{"schema": 99, "kind": "comparison"}', "schema version 99; this lengthgen reads version 1"),
    ('{"schema": 1, "kind": "run"}', "holds a 'run' result, expected a 'comparison' result"),
    ('{"schema": 1, "kind": "comparison", "title": "x"}', "malformed comparison result"),
])
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, content, message):
    path = tmp_path / "results.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ResultsError, match=message) as err:
        Comparison.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results file at .*nothing.json"):
        RunEval.load(tmp_path / "nothing.json")


def test_merge_refuses_other_lengths():
    a, b = _comparison(), _comparison()
    b.variants = {"l2": b.variants.pop("baseline")}
    a.merge(b)
    assert list(a.variants) == ["baseline", "l2"]
    b.eval_lengths = [8, 16]
    with pytest.raises(ResultsError, match="cannot merge"):
        a.merge(b)


def test_files_without_the_chance_and_size_fields_still_load(tmp_path):
    """Chance levels, parameter count and tokens trained were added without a schema change: older files
    load with them empty."""
    comparison = _comparison()
    data = json.loads(comparison.save(tmp_path / "results.json").read_text())
    assert data["variants"]["baseline"][0]["lengths"][0]["chance"] == {"loss": 2.0}
    for run in data["variants"]["baseline"]:
        del run["parameters"], run["train_tokens"]
        for row in run["lengths"]:
            del row["chance"], row["chance_buckets"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Comparison.load(tmp_path / "old.json")
    run = old.variants["baseline"][0]
    assert run.parameters is None and run.train_tokens is None and run.lengths[0].chance == {}
    assert run.lengths[0].chance_buckets == {} and run.lengths[0].at_length == {"loss": 1.5}


def test_merge_compares_what_a_batch_holds_not_its_wording():
    from lengthgen.eval.results import _batch_kind

    old, new = "28 long documents (val split)", "28 long documents (val split; all there are, the same for every seed)"
    assert _batch_kind(old) == _batch_kind(new) == "val"
    assert _batch_kind("1 long document (train split, which the run trained on)") == "train"
    assert _batch_kind("4 packed rows (no document of 128 tokens)") == "packed row"
    assert _batch_kind("4 sampled sequences") == _batch_kind("1 sampled sequence") == "sampled sequence"
    assert _batch_kind("1 sampled sequences") == "sampled sequence"     # older versions' wording at one sequence
    assert _batch_kind("2 long documents (val split)") != _batch_kind("2 long documents (train split)")


def _retrofit_protocol(out: str, seeds: list[int], pretrain_steps: int = 600) -> Comparison:
    """Seed 000's protocol: each seed finetuned from its own pretraining run under ``out/pretrain``."""
    runs = []
    for seed in seeds:
        run = _run(seed)
        run.config = {"train": {"seed": seed, "init_from": f"{out}/pretrain/pe-seed{seed}"}}
        runs.append(run)
    return dataclasses.replace(_comparison(), variants={"baseline": runs}, retrofit={
        "pretrain_steps": pretrain_steps, "finetune_steps": 200, "bases": {"pe": {}},
        "base_runs": {f"pe-seed{seed}": f"{out}/pretrain/pe-seed{seed}" for seed in seeds}})


def test_merge_takes_more_seeds_of_seed_000s_retrofit_protocol():
    """Each seed of seed 000's protocol starts from its own pretraining run (train.init_from), in its own --out:
    merging a second comparison's seeds refused them as 'run differently (train.init_from: ...)'."""
    a, b = _retrofit_protocol("/a", [0, 1]), _retrofit_protocol("/b", [2, 3])
    a.merge(b)
    assert [run.seed for run in a.variants["baseline"]] == [0, 1, 2, 3]
    assert a.retrofit["base_runs"] == {"pe-seed0": "/a/pretrain/pe-seed0", "pe-seed1": "/a/pretrain/pe-seed1",
                                       "pe-seed2": "/b/pretrain/pe-seed2", "pe-seed3": "/b/pretrain/pe-seed3"}
    with pytest.raises(ResultsError, match="pretrain_steps: 600 here, 300 there"):
        a.merge(_retrofit_protocol("/c", [4], pretrain_steps=300))
    plain = _comparison()                    # elsewhere a run's init_from is part of how it was run
    other = _comparison()
    for run in other.variants["baseline"]:
        run.seed, run.config = run.seed + 2, {"train": {"seed": run.seed + 2, "init_from": "/ckpt"}}
    with pytest.raises(ResultsError, match="train.init_from"):
        plain.merge(other)


def test_merge_refuses_another_kind_of_experiment():
    """A retrofit's results merged into a comparison (or one of seed 000's protocol into either): the report told
    the first one's story (title, protocol, 'Training' line) about every run, e.g. a finetuned 'after' as if trained
    1 step from scratch."""
    retrofit = {"checkpoint": "run/checkpoints/step_2", "overrides": ["model.attention.out_norm=head_layer"],
                "steps": 1, "added_parameters": []}
    kinds = {"comparison": _comparison(), "retrofit": dataclasses.replace(_comparison(), retrofit=retrofit),
             "comparison finetuned from pretrained bases": _retrofit_protocol("/a", [0])}
    for kind, results in kinds.items():
        for other_kind, other in kinds.items():
            if kind != other_kind:
                other = dataclasses.replace(other, variants={"other": other.variants["baseline"]})
                with pytest.raises(ResultsError, match=f"x: holds a {other_kind}, here a {kind}; cannot merge"):
                    results.merge(other, "x")
