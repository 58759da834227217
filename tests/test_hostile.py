"""A hostile but realistic user (issue 12): every case that lost data, was silently wrong or ended in a traceback,
one test each, named after it; then concurrent writers, kill -9 and a fuzz over configs.

A user error ends in one line ``lengthgen <cmd>: error: ...`` naming the key or file, exit status 2, with nothing
written or lost."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthgen.cli import main
from lengthgen.config import ConfigError, describe, set_key
from lengthgen.eval import Comparison, NeedleMap, ResultsError, RunEval
from lengthgen.experiments.compare import plan, run_compare
from lengthgen.experiments.eval_run import eval_run
from lengthgen.model import GPT, GPTConfig
from lengthgen.optional import MissingPackageError
from lengthgen.train import load_run, train
from lengthgen.train.config import RunConfig, save_config
from lengthgen.train.run_folder import LOCK, RunFolderError, RunFolderWarning, check_fresh, load_newest, lock
from lengthgen.train.setup import resolve

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=4", "train.lr=3e-3",
        "train.batch_size=4", "train.eval_batches=0", "data.task=counting", "data.task_kwargs={vocab_size = 4}",
        "data.length=8", "train.threads=1", "train.log_every=1"]


def config(*overrides: str) -> RunConfig:
    return RunConfig().override(*TINY, *overrides)


def sets(*overrides: str) -> list[str]:
    return [a for o in (*TINY, *overrides) for a in ("--set", o)]


def text_sets(*overrides: str) -> list[str]:
    """`sets` for text data: TINY without its data.task, which text does not read (naming it is an error)."""
    return [a for o in TINY if not o.startswith("data.task=") for a in ("--set", o)] + sets(*overrides)[len(TINY) * 2:]


def cli(capsys, *args: str) -> tuple[int, str]:
    """(exit status, the error line) of ``lengthgen ARGS``; asserts that an error is one line."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_:          # argparse
        code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if ": warning: " not in line]
    if code:
        assert len(err) == 1 and err[0].startswith(f"lengthgen {args[0]}: error: "), err
    return code, err[0] if err else ""


def files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (but the lock file) and its content."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK}


def losses(folder: Path) -> list[tuple[int, float]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(e["step"], e["loss"]) for e in map(json.loads, lines) if "loss" in e]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, list[float]]:
    """A run of 4 steps stopped after step 3 (checkpoints at steps 2 and 3) and the losses of the whole run."""
    root = tmp_path_factory.mktemp("stopped")
    full = train(config(), root / "full", progress=False)
    train(config("train.checkpoint_every=1"), root / "run", progress=False, stop_at=3)
    return root / "run", full.history


def copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def resume(run: Path, *overrides: str, **kwargs: Any):
    return train(config("train.checkpoint_every=1", *overrides), run, progress=False, resume=True, **kwargs)


# ---------------------------------------------------------------------------------------------------
# data loss


def test_two_concurrent_writers_cannot_share_a_folder(tmp_path, capsys, stopped):
    run = copy(stopped[0], tmp_path)
    before = files(run)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lengthgen.train.run_folder import lock; "
         "held = lock(sys.argv[1]); print('locked', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "locked\n"
        for args in (["train", *sets(), "--out", run, "--resume"], ["train", *sets(), "--out", run, "--overwrite"],
                     ["compare", "--variants", "baseline", "--out", run, "--resume", *sets()],
                     ["retrofit", stopped[0], "--set", "model.attention.out_norm=head_layer", "--steps", "1",
                      "--out", run, "--overwrite"],
                     ["eval", stopped[0], "--out", run / "eval2.json"]):
            code, err = cli(capsys, *args)
            assert code == 2 and f"{run} is in use by another lengthgen process (pid {holder.pid} on " in err, err
        assert files(run) == before
    finally:
        holder.kill()            # kill -9: the kernel drops its lock, nothing is stale
        holder.wait()
    assert resume(run).step == 4
    with lock(run), pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):
        resume(run)              # a second writer in this process is refused too


def test_second_training_into_a_used_folder_is_refused_and_loses_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(capsys, "train", *sets(), "--out", out, "--no-progress")[0] == 0
    before = files(out)
    code, err = cli(capsys, "train", *sets("train.seed=1"), "--out", out, "--no-progress")
    assert code == 2 and "already holds" in err and "--resume" in err and "--overwrite" in err
    assert files(out) == before
    assert cli(capsys, "train", *sets("train.seed=1", "train.steps=3"), "--out", out, "--overwrite",
               "--no-progress")[0] == 0
    assert [s for s, _ in losses(out)] == [1, 2, 3]          # only the new run's entries
    assert json.loads((out / "config.json").read_text())["train"]["seed"] == 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000003"]


# ---------------------------------------------------------------------------------------------------
# silently wrong: the run folder


def _killed_before_first_checkpoint(tmp_path: Path) -> Path:
    """A run folder as a run killed before its first checkpoint leaves it: config.json and 2 metrics entries."""
    run = tmp_path / "run"
    train(config(), run, progress=False, stop_at=2)
    shutil.rmtree(run / "checkpoints")
    (run / "latest.json").unlink()
    return run


def test_resume_before_the_first_checkpoint_cuts_stale_metrics(tmp_path, stopped):
    run = _killed_before_first_checkpoint(tmp_path)
    result = resume(run)
    assert result.history == stopped[1]
    assert losses(run) == list(enumerate(stopped[1], start=1))


def test_restart_with_another_config_before_the_first_checkpoint_is_refused(tmp_path):
    run = _killed_before_first_checkpoint(tmp_path)
    before = files(run)
    with pytest.raises(RunFolderError, match="already holds config.json, metrics.jsonl"):
        train(config("train.seed=1"), run, progress=False)
    with pytest.raises(ConfigError, match=r"train\.seed: config\.json 0, now 1"):
        resume(run, "train.seed=1")
    assert files(run) == before
    train(config("train.seed=1"), run, progress=False, overwrite=True)
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]


TRAJECTORY = ["train.seed=1", "train.batch_size=8", "train.tokens_per_step=64", "train.stages=[[0, 8], [3, 16]]",
              "train.optimizer=muon", "train.schedule=wsd", "train.steps=6", "train.lr=1e-3", "train.grad_accum=2",
              "model.attention=l2", "data.task_kwargs={vocab_size = 5}"]


@pytest.mark.parametrize("change", TRAJECTORY)
def test_resume_refuses_a_change_of_the_trajectory_and_keeps_config_json(tmp_path, stopped, change):
    run = copy(stopped[0], tmp_path)
    before = files(run)
    key = change.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"cannot resume .*{key.replace('.', '[.]')}"):
        resume(run, change)
    assert files(run) == before                       # config.json still claims the run's own values


def test_resume_accepts_changes_that_keep_the_trajectory(tmp_path, stopped):
    run = copy(stopped[0], tmp_path)
    result = resume(run, "train.eval_every=1", "train.keep_checkpoints=3", "train.threads=2", "name=renamed")
    assert result.history == stopped[1]


def test_train_resume_of_a_finished_run_says_nothing_was_trained(tmp_path, capsys, stopped):
    """Found by a probe: train --resume of a finished run printed "trained 4 steps", as if it had trained them
    again; it says that there was nothing to train, and leaves the folder as it was."""
    run = copy(stopped[0], tmp_path)
    resume(run)
    before = files(run)
    capsys.readouterr()
    assert main(["train", *sets("train.checkpoint_every=1"), "--out", str(run), "--resume", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("nothing to train: the run finished its 4 steps before; final loss ")
    assert files(run) == before


def test_train_resume_says_which_steps_it_trained(tmp_path, capsys, stopped):
    """train --resume of a run stopped at step 2 of 4 ended with "trained 4 steps", as if it had trained the whole
    run in this session (its start line said "resuming at step 2"); it names the steps it trained."""
    run = copy(stopped[0], tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    capsys.readouterr()
    assert main(["train", *sets("train.checkpoint_every=1"), "--out", str(run), "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "resuming at step 2" in out.splitlines()[0]
    assert out.splitlines()[-1].startswith("trained steps 3-4; final loss "), out


def test_a_finished_run_resumed_evaluates_what_its_folder_lacks(tmp_path):
    """Resuming a finished run evaluates again when eval.json is of other eval lengths or eval_bema.json is
    missing (a kill between the two files), and leaves both alone when they are current."""
    evals = ("train.eval_batches=1", "train.bema.enabled=true", "train.bema.tau=1")
    run = train(config(*evals, "train.eval_lengths=[8, 16]"), tmp_path / "run", progress=False).run_dir
    kept = files(run)
    resume(run, *evals, "train.eval_lengths=[8, 16]")
    assert {k: v for k, v in files(run).items() if k.startswith("eval")} == \
        {k: v for k, v in kept.items() if k.startswith("eval")}
    # lengthgen eval --out RUN/eval.json replaced it at the same lengths with fewer tokens (found by a probe: only
    # the lengths were compared, so the resume kept it as the run's final evaluation)
    sizes = lambda: [row.batch_size for row in RunEval.load(run / "eval.json").lengths]      # noqa: E731
    want = sizes()
    assert main(["eval", str(run), "--lengths", "8,16", "--tokens", "32", "--out", str(run / "eval.json")]) == 0
    assert sizes() != want
    resume(run, *evals, "train.eval_lengths=[8, 16]")
    assert sizes() == want
    resume(run, *evals, "train.eval_lengths=[8, 32]")
    for name in ("eval.json", "eval_bema.json"):
        assert [row.length for row in RunEval.load(run / name).lengths] == [8, 32]
    (run / "eval_bema.json").unlink()
    resume(run, *evals, "train.eval_lengths=[8, 32]")
    assert RunEval.load(run / "eval_bema.json").bema
    # lengthgen eval --out RUN/eval.json replaced it with other lengths (its config still names [8, 32])
    assert main(["eval", str(run), "--lengths", "16", "--tokens", "32", "--out", str(run / "eval.json")]) == 0
    resume(run, *evals, "train.eval_lengths=[8, 32]")
    assert [row.length for row in RunEval.load(run / "eval.json").lengths] == [8, 32]


def test_a_finished_run_resumed_on_another_rank_count_warns_only_of_steps_it_trains(tmp_path):
    """Found by a probe: resuming a finished run (nothing to train) written under torchrun in one process warned
    that "the steps from here differ from an uninterrupted run's"; it says so now only when steps are left."""
    from lengthgen.config import ConfigWarning
    from lengthgen.train.checkpoint import DIGESTS, complete_checkpoints, file_digest

    run = train(config("model.dropout=0.1"), tmp_path / "run", progress=False).run_dir
    ckpt = complete_checkpoints(run)[0]             # as if written on 2 ranks
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "world": 2}))
    digests = json.loads((ckpt / DIGESTS).read_text())
    (ckpt / DIGESTS).write_text(json.dumps({**digests, "state.json": file_digest(ckpt / "state.json")}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert train(config("model.dropout=0.1"), run, progress=False, resume=True).step == 4
    with pytest.warns(ConfigWarning, match="written on 2 ranks, this run has 1 rank"):
        train(config("model.dropout=0.1", "train.steps=5"), run, progress=False, resume=True, extend=True)


def test_more_steps_need_extend_and_the_extension_is_recorded(tmp_path, stopped, capsys):
    run = copy(stopped[0], tmp_path)
    resume(run)
    with pytest.raises(ConfigError, match=r"train\.steps: state\.json 4, now 6 \(--extend changes train\.steps\)"):
        resume(run, "train.steps=6")
    with pytest.raises(ConfigError, match="needs more steps than the checkpoint's 4"):
        resume(run, "train.steps=3", extend=True)
    assert cli(capsys, "train", *sets("train.steps=6"), "--out", run, "--extend")[0] == 2     # needs --resume
    result = resume(run, "train.steps=6", extend=True)
    assert result.step == 6 and len(result.history) == 6
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "extended": {"train.steps": [4, 6]}} in entries
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 6


def test_an_extension_interrupted_before_its_first_checkpoint_is_recorded_once(tmp_path, stopped):
    """Found by a probe: a --extend stopped before its first checkpoint and resumed with --extend again left two
    ``extended`` entries at the checkpoint's step in metrics.jsonl, the first for steps the run never trained to."""
    run = copy(stopped[0], tmp_path)
    resume(run)
    resume(run, "train.steps=8", "train.checkpoint_every=0", extend=True, stop_at=6)
    shutil.rmtree(run / "checkpoints" / "step_00000006")      # as if killed between steps 4 and 6
    resume(run, "train.steps=10", extend=True)
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in entries if "extended" in e] == [{"step": 4, "extended": {"train.steps": [4, 10]}}]
    assert [s for s, _ in losses(run)] == list(range(1, 11))


@pytest.mark.parametrize("content", ['{"starts": [', "", "[]", '{"starts": 5}'])
def test_a_damaged_run_json_is_a_one_line_error(tmp_path, capsys, stopped, content):
    """Found by a probe: resuming a run whose run.json was truncated or edited ended in a traceback."""
    run = copy(stopped[0], tmp_path)
    (run / "run.json").write_text(content)
    code, err = cli(capsys, "train", *sets("train.checkpoint_every=1"), "--out", run, "--resume")
    assert code == 2 and f"{run / 'run.json'} is unreadable" in err
    assert (run / "run.json").read_text() == content


@pytest.mark.filterwarnings("ignore:corpus .* has no validation split")      # a one-file corpus: expected
def test_resume_on_edited_corpus_files_is_refused(tmp_path):
    """Resuming after the corpus files changed trained on, and silently mixed in, other data."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document number {j} with some text\n\n" for j in range(50)))
    text = ["data.kind=text", f"data.text={{corpus = {json.dumps(str(corpus))}, cache = false}}",
            "data.task_kwargs={}", "train.checkpoint_every=1"]
    run = train(config(*text), tmp_path / "run", progress=False, stop_at=2).run_dir
    copied = tmp_path / "copy.txt"                  # the same text in another file: the same data
    shutil.copy(corpus, copied)
    corpus.write_text(corpus.read_text().replace("document", "DOCUMENT"))
    with pytest.raises(ConfigError, match=r"its training data differ from the data here \(token digest"):
        train(config(*text), run, progress=False, resume=True, stop_at=3)
    # the same text at another path (the corpus moved, the cache switched on) resumes: the digest says it is the
    # same data; other text there, or another data key, is refused
    moved = [f"data.text={{corpus = {json.dumps(str(copied))}, cache = true, cache_dir = "
             f"{json.dumps(str(tmp_path / 'cache'))}}}"]
    with pytest.raises(ConfigError, match=r"data\.text\.max_documents: state\.json None, now 40"):
        train(config(*text, *moved, "data.text.max_documents=40"), run, progress=False, resume=True)
    assert train(config(*text, *moved), run, progress=False, resume=True, stop_at=3).step == 3
    copied.write_text(corpus.read_text())                 # the edited text, now at the new path
    with pytest.raises(ConfigError, match=r"its training data differ from the data here \(token digest"):
        train(config(*text, *moved), run, progress=False, resume=True)
    corpus.write_text(copied.read_text().replace("DOCUMENT", "document"))
    assert train(config(*text), run, progress=False, resume=True).step == 4


def test_a_moved_corpus_resumes_only_with_the_same_evaluation_text(tmp_path):
    """The training digest alone let a resume move the corpus to a copy whose validation text differed: the
    run's evaluations then changed data mid-run. Each checkpoint now keeps the evaluation text's digest too."""
    docs = lambda word: "".join(f"{word} number {j} with some text\n\n" for j in range(40))  # noqa: E731
    for name, word in (("train.txt", "document"), ("val.txt", "held out"), ("other.txt", "changed")):
        (tmp_path / name).write_text(docs(word))
    data = lambda train, val: ["data.kind=text", "data.task_kwargs={}", "train.checkpoint_every=1",  # noqa: E731
                               f"data.text={{corpus = {json.dumps(str(tmp_path / train))}, "
                               f"val_corpus = {json.dumps(str(tmp_path / val))}, cache = false}}"]
    run = train(config(*data("train.txt", "val.txt")), tmp_path / "run", progress=False, stop_at=2).run_dir
    shutil.copy(tmp_path / "train.txt", tmp_path / "moved.txt")
    with pytest.raises(ConfigError, match=r"data\.text\.val_corpus: state\.json '.*val\.txt', now '.*other\.txt'"):
        train(config(*data("moved.txt", "other.txt")), run, progress=False, resume=True)
    shutil.copy(tmp_path / "val.txt", tmp_path / "val_copy.txt")
    assert train(config(*data("moved.txt", "val_copy.txt")), run, progress=False, resume=True).step == 4


def test_resume_without_latest_json_continues_from_the_newest_checkpoint(tmp_path, stopped):
    run = copy(stopped[0], tmp_path)
    (run / "latest.json").unlink()
    assert resume(run).history == stopped[1]
    # pruning then keeps this run's newest checkpoints
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    assert json.loads((run / "latest.json").read_text())["step"] == 4


def test_garbage_latest_json_is_ignored(tmp_path, stopped):
    run = copy(stopped[0], tmp_path)
    (run / "latest.json").write_text("{garbage")
    assert load_run(run)[0].train.steps == 4
    assert resume(run).history == stopped[1]


# ---------------------------------------------------------------------------------------------------
# silently wrong: arguments


@pytest.mark.parametrize("argument", [["--steps", "0"], ["--train-length", "0"], ["--eval-tokens", "0"],
                                      ["--seeds", "0"], ["--steps", "-3"]])
def test_compare_zero_or_negative_arguments_are_errors_before_anything_is_written(tmp_path, capsys, argument):
    code, err = cli(capsys, "compare", "--variants", "baseline", "--out", tmp_path / "c", *argument)
    assert code == 2 and f"argument {argument[0]}" in err
    assert not (tmp_path / "c").exists()


def test_compare_checks_eval_lengths_and_variants_before_training(tmp_path):
    cfg = config("data.task=mqar", "data.task_kwargs={vocab_size = 16}", "data.length=16")
    with pytest.raises(ConfigError, match="eval_lengths: length 64 exceeds the data's maximum length 35"):
        run_compare(cfg.override("compare.eval_lengths=[16, 64]"), tmp_path / "c", variants=["baseline"],
                    progress=False)
    with pytest.raises(ValueError, match="unknown variant 'bogus'"):
        run_compare(cfg, tmp_path / "c", variants=["baseline", "bogus"], progress=False)
    with pytest.raises(ConfigError, match="eval_tokens=0"):
        run_compare(cfg.override("compare.eval_tokens=0"), tmp_path / "c", variants=["baseline"], progress=False)
    with pytest.raises(ConfigError, match="seeds"):
        run_compare(cfg.override("compare.seeds=[]"), tmp_path / "c", variants=["baseline"], progress=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("key, changes, message", [
    ("variants", "{data.length = 16}", "compare.variants.x trains on task 'counting' at length 16, the comparison "
                                       "on task 'counting' at length 8"),
    ("variants", "{train.stages = [[1, 16]]}", "compare.variants.x trains on task 'counting' at length 16"),
    ("variants", '{data.task = "mqar", data.task_kwargs.vocab_size = 16}',
     "compare.variants.x trains on task 'mqar'"),
    ("bases", "{data.length = 16}", "compare.bases.x trains on task 'counting' at length 16")])
def test_compare_refuses_a_variant_or_base_of_another_length_or_task(tmp_path, key, changes, message):
    """A variant setting data.length 16 was reported beside the others at "16x the training length" 8; one setting
    another task trained its runs, then failed (a KeyError on the headline metric, or its data could not generate
    the comparison's eval lengths). Both are refused before anything trains."""
    cfg = config(f"compare.{key}.x={changes}", "compare.eval_tokens=32")
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_compare(cfg, tmp_path / "c", variants=["baseline"] if key == "bases" else ["x"], progress=False)
    assert not (tmp_path / "c").exists()
    same = "{data.task_kwargs = {vocab_size = 5}}"       # another law of the same task and length: compared
    run_compare(config(f"compare.{key}.x={same}", "compare.eval_tokens=32"), tmp_path / "ok",
                variants=["baseline"] if key == "bases" else ["x"], progress=False, log=lambda _: None)


@pytest.mark.parametrize("name", ["", ".", "..", " "])
def test_compare_base_or_variant_names_stay_inside_runs(name):
    """A base named "" (["compare.bases".""] in TOML) put its runs' folders at /VARIANT-seedN (runs/ +
    "/VARIANT-seedN"), one named ".." beside runs/ in --out, where --resume does not look for them; a variant
    named "" was dropped without a word."""
    for key in ("bases", "variants"):
        cfg = dataclasses.replace(config(), compare={key: {name: {"model": {"norm_placement": "post"}}}})
        with pytest.raises(ConfigError, match=rf"^compare\.{key}\..*not blank, '\.' or '\.\.'"):
            plan(cfg)           # checked before anything trains (run_compare plans first)


@pytest.mark.parametrize("name", ["../escaped", "/abs", "a/b", "a\\b", ".", "..", " "])
def test_a_run_name_is_a_plain_folder_name(tmp_path, capsys, monkeypatch, name):
    """``train`` without --out writes runs/<name>: name=../x trained beside runs/, /abs at an absolute path and "."
    into runs/ itself."""
    monkeypatch.chdir(tmp_path)
    code, err = cli(capsys, "train", *sets(f"name={json.dumps(name)}"))
    assert code == 2 and err.endswith(f"name={name!r} is not valid; it must be a plain folder name (no '/' or '\\', "
                                      "not blank, '.' or '..'), or '' for none"), err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^compare\.variants\..*not blank, '\.' or '\.\.'"):
        plan(dataclasses.replace(config(), compare={"variants": {name: {"model": {"norm_placement": "post"}}}}))


@pytest.mark.parametrize("tokens", ["0", "-100", "x"])
def test_eval_tokens_zero_or_negative_is_an_error(stopped, capsys, tokens):
    code, err = cli(capsys, "eval", stopped[0], "--tokens", tokens)
    assert code == 2 and "argument --tokens" in err
    with pytest.raises(ConfigError, match="tokens=-100"):
        eval_run(stopped[0], tokens=-100)


def test_tokens_per_step_below_one_sequence_is_an_error():
    with pytest.raises(ConfigError, match=r"^train\.tokens_per_step=7: 7 tokens per step hold no sequence of the "
                                          r"longest training length \(8"):
        config("train.tokens_per_step=7")
    # a stage longer than batch_size x data.length failed only when it started (batch 0), after the steps before
    with pytest.raises(ConfigError, match=r"^train\.batch_size=4: 32 tokens per step hold no sequence of the "
                                          r"longest training length \(40: data.length and train.stages\)"):
        config("train.stages=[[2, 40]]")
    with pytest.raises(ConfigError, match=r"train\.tokens_per_step=12: .*\(16"):
        config("train.tokens_per_step=12", "train.stages=[[0, 8], [2, 16]]")
    assert config("train.tokens_per_step=16", "train.stages=[[0, 8], [2, 16]]").batch_size_at(3) == 1


def test_overrides_are_checked_once_all_are_applied():
    """model.heads=3 then model.dim=6 failed on heads=3 against the default dim."""
    for order in (["model.heads=3", "model.dim=6"], ["model.dim=6", "model.heads=3"]):
        assert (config(*order).model.dim, config(*order).model.heads) == (6, 3)
    with pytest.raises(ConfigError, match=r"^model\.heads=5 is not valid; it must be a divisor of dim=16"):
        config("model.heads=5")
    assert config("model.attention=l2", "model.attention.window=4").model.attention.softmax_p == 2.0
    # a preset set while the config is invalid for a moment (heads=3 of dim 16) is kept when a later key changes it
    spec = config("model.heads=3", "model.attention=l2", "model.attention.window=4", "model.dim=6").model.attention
    assert (spec.softmax_p, spec.window) == (2.0, 4)


def _compare(out: Path, *overrides: str, seeds=(0,), variants=("baseline",), tokens=16) -> Comparison:
    cfg = config("train.steps=2", *overrides, f"compare.seeds={list(seeds)}", "compare.eval_lengths=[8, 16]",
                 f"compare.eval_tokens={tokens}")
    return run_compare(cfg, out, variants=list(variants), progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def two_compares(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Compares of the same variant: A (seed 0), B (seed 1, same config), C (seed 1, another lr)."""
    root = tmp_path_factory.mktemp("compares")
    _compare(root / "a")
    _compare(root / "b", seeds=(1,))
    _compare(root / "c", "train.lr=1e-2", seeds=(1,))
    return root / "a", root / "b", root / "c"


def test_report_refuses_to_merge_different_configs_under_one_variant(tmp_path, capsys, two_compares):
    a, _, c = two_compares
    before = files(a)
    code, err = cli(capsys, "report", a, c, "--out", tmp_path / "m")
    assert code == 2 and "variant 'baseline' was run differently (train.lr: 0.003 here, 0.01 there)" in err
    assert files(a) == before and not (tmp_path / "m" / "report.md").exists()


def test_report_merges_results_written_before_a_key_existed(tmp_path, capsys, two_compares):
    """A results.json from before a config key or spec field was added lacks it; its runs had the key's default
    (the earlier behaviour), so it merges with newer results, unless those set the key otherwise."""
    a, b, _ = two_compares
    old = tmp_path / "old"
    shutil.copytree(b, old)
    data = json.loads((old / "results.json").read_text())
    for runs in data["variants"].values():
        for run in runs:
            del run["config"]["train"]["muon_momentum_cooldown"], run["config"]["model"]["attention"]["gate_width"]
    for spec in data["specs"].values():
        del spec["gate_width"]
    (old / "results.json").write_text(json.dumps(data))
    assert cli(capsys, "report", a, old, "--out", tmp_path / "m")[0] == 0
    newer = Comparison.load(a / "results.json")
    for run in newer.variants["baseline"]:
        run.config["train"]["muon_momentum_cooldown"] = 5
    newer.save(tmp_path / "n" / "results.json")
    code, err = cli(capsys, "report", tmp_path / "n", old, "--out", tmp_path / "m2")
    assert code == 2 and "(train.muon_momentum_cooldown: 5 here, 0 there)" in err


def test_report_refuses_to_merge_evaluations_of_other_tokens(tmp_path, capsys, two_compares):
    a = two_compares[0]
    other = _compare(tmp_path / "d", seeds=(1,), tokens=32)
    assert [row.batch_size for row in other.variants["baseline"][0].lengths] == [4, 2]
    code, err = cli(capsys, "report", a, tmp_path / "d", "--out", tmp_path / "m")
    assert code == 2 and "evaluated at length 8 on 4 sampled sequences, here on 2 sampled sequences; cannot merge " \
        "evaluations of other text or of another number of sequences (compare --eval-tokens)" in err
    assert not (tmp_path / "m" / "report.md").exists()


def test_report_of_several_folders_writes_to_its_own_out(tmp_path, capsys, two_compares):
    a, b, _ = two_compares
    before = files(a)
    assert "needs --out" in cli(capsys, "report", a, b)[1]
    assert "holds one of the merged" in cli(capsys, "report", a, b, "--out", a)[1]
    assert cli(capsys, "report", a, b, "--out", tmp_path / "m")[0] == 0
    assert files(a) == before
    merged = Comparison.load(tmp_path / "m" / "results.json")
    assert [run.seed for run in merged.variants["baseline"]] == [0, 1]
    assert (tmp_path / "m" / "report.md").is_file()
    with pytest.raises(ResultsError, match="seed"):
        merged.merge(Comparison.load(b / "results.json"), "b")


def test_compare_resume_never_drops_runs_from_the_report(tmp_path, capsys):
    """--resume with fewer variants (or seeds) than the folder holds rewrote results.json and the report without
    the others. Now refused with nothing touched; naming them all reuses the finished runs and adds the new."""
    out = tmp_path / "c"
    args = ["compare", "--eval-lengths", "8,16", "--eval-tokens", "16", "--out", out, "--no-progress",
            *sets("train.steps=2")]
    assert cli(capsys, *args, "--variants", "baseline,l2")[0] == 0
    before = files(out)
    code, err = cli(capsys, *args, "--variants", "l2", "--resume")
    assert code == 2 and "holds runs this --resume does not plan (baseline-seed0)" in err
    assert files(out) == before
    assert cli(capsys, *args, "--variants", "baseline,l2,avnorm", "--resume")[0] == 0
    assert set(Comparison.load(out / "results.json").variants) == {"baseline", "l2", "avnorm"}
    assert [s for s, _ in losses(out / "runs" / "baseline-seed0")] == [1, 2]          # reused, not retrained


def test_compare_resume_with_pretraining_takes_another_spelling_of_out(tmp_path, monkeypatch):
    """The finetuning runs start from the comparison's own pretraining: --out relative, absolute or from another
    working directory is the same comparison (train.init_from was compared as spelled)."""
    monkeypatch.chdir(tmp_path)
    first = _compare(Path("c"), "compare.pretrain_steps=2")
    monkeypatch.chdir(tmp_path / "c")
    again = run_compare(config("train.steps=2", "compare.pretrain_steps=2", "compare.seeds=[0]",
                               "compare.eval_lengths=[8, 16]", "compare.eval_tokens=16"), Path("..") / "c",
                        variants=["baseline"], progress=False, resume=True, log=lambda _: None)
    assert again.variants["baseline"][0].lengths == first.variants["baseline"][0].lengths


@pytest.mark.parametrize("change", ["train.steps=3", "compare.pretrain_steps=3"])
def test_compare_resume_with_other_steps_names_what_to_do(tmp_path, capsys, change):
    """compare has no --extend, which the resume message suggested."""
    _compare(tmp_path / "c", "compare.pretrain_steps=2")
    before = files(tmp_path / "c")
    with pytest.raises(ConfigError, match=r"trains 2 steps, now 3; a comparison's steps stay as they were") as err:
        run_compare(config("train.steps=2", "compare.pretrain_steps=2", change, "compare.seeds=[0]",
                           "compare.eval_lengths=[8, 16]", "compare.eval_tokens=16"), tmp_path / "c",
                    variants=["baseline"], progress=False, resume=True, log=lambda _: None)
    assert "--extend" not in str(err.value) and files(tmp_path / "c") == before


@pytest.mark.parametrize("pretrain", [[], ["compare.pretrain_steps=2"]])
def test_compare_resume_with_another_training_key_trains_nothing(tmp_path, capsys, pretrain):
    """Found by a probe: compare --resume with another train.lr and a variant added (listed first) trained the new
    variant's runs at the new lr, then refused the finished ones: the folder held runs of both lrs and resumed with
    neither. Every run's saved config is now checked before anything trains; more seeds and variants still go."""
    out = tmp_path / "c"
    args = ["compare", "--eval-lengths", "8,16", "--eval-tokens", "16", "--out", out, "--no-progress",
            *sets("train.steps=2", *pretrain)]
    assert cli(capsys, *args, "--variants", "baseline")[0] == 0
    before = files(out)
    code, err = cli(capsys, *args, "--variants", "l2,baseline", "--seeds", "2", "--resume", "--set", "train.lr=1e-3")
    assert code == 2 and "train.lr: config.json 0.003, now 0.001" in err
    assert files(out) == before
    assert cli(capsys, *args, "--variants", "l2,baseline", "--seeds", "2", "--resume")[0] == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["baseline-seed0", "baseline-seed1", "l2-seed0",
                                                                "l2-seed1"]


@pytest.mark.parametrize("key", ["variants", "bases"])
def test_compare_overwrite_with_a_variant_of_bad_data_keeps_the_comparison(tmp_path, capsys, key):
    """Found by a probe: a variant (or base) whose data arguments fail only when its run is built (data.task_kwargs)
    was found at its turn: compare --overwrite had deleted the finished comparison and trained the variants before
    it. It is now a one-line error naming it before anything is written."""
    out = tmp_path / "c"
    args = ["compare", "--eval-lengths", "8,16", "--eval-tokens", "16", "--out", out, "--no-progress",
            *sets("train.steps=2")]
    assert cli(capsys, *args, "--variants", "baseline")[0] == 0
    before = files(out)
    bad = "{bad = {data = {task_kwargs = {vocab_size = 0}}}}"
    which = ["--variants", "baseline,bad"] if key == "variants" else ["--variants", "baseline"]
    code, err = cli(capsys, *args, *which, "--set", f"compare.{key}={bad}", "--overwrite")
    assert code == 2 and f"compare.{key}.bad: data.task_kwargs.vocab_size=0 is not valid" in err
    assert files(out) == before


def test_resume_takes_another_spelling_of_init_from(tmp_path, stopped):
    start = stopped[0] / "checkpoints" / "step_00000003"
    run = train(config(f"train.init_from={json.dumps(str(start))}"), tmp_path / "run", progress=False,
                stop_at=2).run_dir
    respelled = os.path.relpath(start, Path.cwd())
    assert respelled != str(start)
    assert resume(run, f"train.init_from={json.dumps(respelled)}", "train.checkpoint_every=0").step == 4


def test_compare_rerun_after_moving_a_finished_variant_away_never_appends(tmp_path, capsys):
    out = tmp_path / "c"
    args = ["compare", "--variants", "baseline,l2", "--eval-lengths", "8,16", "--eval-tokens", "16", "--out", out,
            "--no-progress", *sets("train.steps=2")]
    assert cli(capsys, *args)[0] == 0
    shutil.move(out / "runs" / "baseline-seed0", tmp_path / "moved")
    shutil.rmtree(out / "runs" / "l2-seed0" / "checkpoints")        # l2 as if killed before its checkpoint
    (out / "runs" / "l2-seed0" / "latest.json").unlink()
    code, err = cli(capsys, *args)
    assert code == 2 and "already holds" in err and "--resume" in err
    assert cli(capsys, *args, "--resume")[0] == 0
    for name in ("baseline-seed0", "l2-seed0"):
        assert [s for s, _ in losses(out / "runs" / name)] == [1, 2], name


# ---------------------------------------------------------------------------------------------------
# tracebacks: configs, checkpoints, metrics, results files, optional packages


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e39"])
def test_lr_nan_inf_or_beyond_float32_is_a_config_error(tmp_path, capsys, value):
    code, err = cli(capsys, "train", *sets(f"train.lr={value}"), "--out", tmp_path / "run")
    shown = {"1e39": "1e+39"}.get(value, value)                  # 1e39 overflowed in AdamW with a traceback
    assert code == 2 and f"train.lr={shown} is not valid; it must be a finite float32 number" in err
    assert not (tmp_path / "run").exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


DAMAGE = {"model.safetensors": _truncate, "optimizer.pt": _truncate, "state.json": lambda p: p.write_text("not json {")}


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "state.json"])
def test_a_damaged_checkpoint_falls_back_to_the_older_one(tmp_path, stopped, damaged):
    run = copy(stopped[0], tmp_path)
    DAMAGE[damaged](run / "checkpoints" / "step_00000003" / damaged)
    if damaged != "optimizer.pt":                                   # load_run reads the weights only
        with pytest.warns(RunFolderWarning, match=rf"step_00000003/{damaged} is unreadable.*step_00000002"):
            assert load_run(run)[0].train.steps == 4               # reading: falls back, changes nothing
        assert (run / "checkpoints" / "step_00000003").is_dir()
    with pytest.warns(RunFolderWarning, match=rf"{damaged} is unreadable.*kept aside as step_00000003.corrupt"):
        result = resume(run)
    assert result.history == stopped[1]                            # exact, from step 2
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step_00000003.corrupt" / damaged).is_file()


def test_eval_of_a_run_with_a_damaged_checkpoint_warns_once(tmp_path, stopped, capsys):
    """lengthgen eval (and needle) looked for the newest checkpoint twice, for the weights and again for the
    training data's digest (check_trained_data of the run folder), so the damaged one was warned about twice."""
    run = copy(stopped[0], tmp_path)
    DAMAGE["state.json"](run / "checkpoints" / "step_00000003" / "state.json")
    assert main(["eval", str(run), "--lengths", "8", "--tokens", "8"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
    assert len(warned) == 1 and re.fullmatch(r"lengthgen eval: warning: .*step_00000003/state.json is unreadable "
                                             r"\(.*\); using the older checkpoint step_00000002", warned[0]), warned


def test_a_checkpoint_missing_its_started_bema_falls_back_to_the_older_one(tmp_path):
    """BEMA restarted silently from the current weights when bema.safetensors was gone."""
    bema = ("train.bema.enabled=true", "train.checkpoint_every=1")
    full = train(config(*bema), tmp_path / "full", progress=False)
    train(config(*bema), tmp_path / "run", progress=False, stop_at=3)
    (tmp_path / "run" / "checkpoints" / "step_00000003" / "bema.safetensors").unlink()
    with pytest.warns(RunFolderWarning, match=r"bema.safetensors is unreadable \(missing: BEMA had started, step 3"):
        result = train(config(*bema), tmp_path / "run", progress=False, resume=True)
    assert result.history == full.history
    for a, b in zip(result.trainer.bema_state_dict().values(), full.trainer.bema_state_dict().values()):
        assert torch.equal(a, b)


def test_a_checkpoint_rotated_away_while_read_reads_the_new_one(tmp_path, stopped):
    """eval of a run that is training (keep_checkpoints=1) failed with 'no readable checkpoint' when the writer
    replaced the checkpoint being read."""
    import warnings

    from lengthgen.train import checkpoint as ckpt_io

    run = copy(stopped[0], tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    old, new = run / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000004"

    def read(ckpt):
        if ckpt == old:                       # the writer saves step 4 and removes step 3 during this read
            shutil.copytree(old, new)
            shutil.rmtree(old)
        return ckpt_io.read_state(ckpt)

    with warnings.catch_warnings():
        warnings.simplefilter("error")        # a rotated checkpoint is not a damaged one
        found, state = load_newest(run, read)
    assert found == new and state["step"] == 3


def test_every_checkpoint_damaged_is_a_one_line_error(tmp_path, stopped, capsys):
    run = copy(stopped[0], tmp_path)
    for step in (2, 3):
        _truncate(run / "checkpoints" / f"step_0000000{step}" / "model.safetensors")
    before = files(run)
    code, err = cli(capsys, "train", *sets("train.checkpoint_every=1"), "--out", run, "--resume")
    assert code == 2 and "no readable checkpoint in" in err and "step_00000002/model.safetensors" in err
    code, err = cli(capsys, "eval", run / "checkpoints" / "step_00000003")
    assert code == 2 and "step_00000003/model.safetensors is unreadable" in err
    assert files(run) == before


def test_partial_last_metrics_line_does_not_block_resume(tmp_path, stopped):
    run = copy(stopped[0], tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    assert resume(run).history == stopped[1]
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]


def test_resume_with_another_optimizer_names_it(tmp_path, stopped, capsys):
    run = copy(stopped[0], tmp_path)
    code, err = cli(capsys, "train", *sets("train.checkpoint_every=1", "train.optimizer=muon"), "--out", run,
                    "--resume")
    assert code == 2 and "train.optimizer: state.json 'adamw', now 'muon'" in err


def test_eval_bema_on_a_run_without_bema(stopped, capsys, tmp_path):
    code, err = cli(capsys, "eval", stopped[0], "--bema")
    assert code == 2 and "train.bema.enabled = false" in err
    # BEMA on but not started (step < tau): its weights are the model's
    run = train(config("train.bema.enabled=true", "train.bema.tau=100"), tmp_path / "b", progress=False).run_dir
    torch.testing.assert_close(load_run(run, bema=True)[1].state_dict(), load_run(run)[1].state_dict())


@pytest.mark.parametrize("content, message", [
    ('{"schema": 1, "kind": "comparison", "ti', "truncated or not JSON"), ("", "truncated or not JSON"),
    ('{"schema": 1, "kind": "comparison"}', "malformed comparison result"), ("{}", "no schema version")])
def test_report_of_a_truncated_empty_or_keyless_results_file(tmp_path, capsys, content, message):
    (tmp_path / "results.json").write_text(content)
    code, err = cli(capsys, "report", tmp_path)
    assert code == 2 and str(tmp_path / "results.json") in err and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(variants={}), "(no variants)"),
    (lambda d: d["variants"].update(baseline=[]), "(variant 'baseline' has no runs)"),
    (lambda d: d.update(eval_lengths=[8, 16, 32]), "(variants.baseline[0] was not evaluated at length 32)"),
    (lambda d: d.update(train_length=0), "(train_length 0 and eval_lengths [8, 16]: need positive lengths)"),
    (lambda d: d.update(train_length="8"), "(train_length: expected int, got '8')"),
    (lambda d: d.update(train_length=True), "(train_length: expected int, got True)"),
    (lambda d: d["variants"]["baseline"][0]["lengths"][1]["at_length"].update(loss="abc"),
     "(variants.baseline[0].lengths[1].at_length.loss: expected a number, got 'abc')"),
    (lambda d: d["variants"]["baseline"][0]["lengths"][0]["buckets"]["loss"][0].update(mean=None),
     "(variants.baseline[0].lengths[0].buckets.loss[0].mean: expected a number, got None)"),
    (lambda d: d.update(variants=[]), "(variants: expected an object, got [])"),
    (lambda d: d.pop("provenance"), "(the file: missing key 'provenance')"),
    (lambda d: d.update(extra=1), "(the file: unknown key 'extra')"),
    (lambda d: d.update(eval_lengths=[8, 16, 16]), "(eval_lengths [8, 16, 16] repeat length 16)"),
    (lambda d: d.update(eval_lengths=[16, 8]), "(eval_lengths [16, 8] are not in ascending order)"),
    (lambda d: d["variants"]["baseline"].append(d["variants"]["baseline"][0]),
     "(variants.baseline[1] repeats seed 0 of variants.baseline[0])"),
    (lambda d: d["variants"]["baseline"][0]["lengths"].append(d["variants"]["baseline"][0]["lengths"][1]),
     "(variants.baseline[0] was evaluated twice at length 16)"),
    (lambda d: d.update(metric="accuracy"), "(metric 'accuracy' is not among the values of variants.baseline[0] at "
                                            "length 8: loss, abs_error, sq_error, rel_error)")])
def test_report_of_a_results_file_with_a_bad_value_names_it(tmp_path, capsys, two_compares, edit, message):
    data = json.loads((two_compares[0] / "results.json").read_text())
    edit(data)
    (tmp_path / "results.json").write_text(json.dumps(data))
    code, err = cli(capsys, "report", tmp_path)
    assert code == 2 and f"{tmp_path / 'results.json'}: malformed comparison result {message}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_nan_value_is_read_and_reported(tmp_path, capsys, two_compares):
    """A diverged run's NaN loss is a value of the results model, not a malformed file."""
    data = json.loads((two_compares[0] / "results.json").read_text())
    data["variants"]["baseline"][0]["lengths"][1]["at_length"]["loss"] = float("nan")
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert cli(capsys, "report", tmp_path)[0] == 0 and (tmp_path / "report.md").is_file()


def test_compare_seeds_zero_writes_nothing(tmp_path, capsys):
    code, err = cli(capsys, "compare", "--seeds", "0", "--out", tmp_path / "c")
    assert code == 2 and "--seeds" in err and not (tmp_path / "c").exists()


@pytest.mark.parametrize("module, text, hint", [
    ("pyarrow", '{corpus = "CORPUS", cache = false}', "pip install pyarrow"),
    ("tiktoken", '{tokenizer = "gpt2", cache = false}', "pip install tiktoken")])
def test_optional_packages_give_an_install_hint(tmp_path, capsys, monkeypatch, module, text, hint):
    monkeypatch.setitem(sys.modules, module, None)            # import fails as if it were not installed
    monkeypatch.setitem(sys.modules, f"{module}.parquet", None)
    (tmp_path / "a.parquet").write_bytes(b"")
    text = text.replace("CORPUS", str(tmp_path / "a.parquet"))
    code, err = cli(capsys, "train", *text_sets('data.kind="text"', "data.task_kwargs={}", f"data.text={text}"),
                    "--out", tmp_path / "run")
    assert code == 2 and hint in err


# ---------------------------------------------------------------------------------------------------
# an interrupted compare, kill -9, stale temporaries, permissions


def test_interrupted_compare_continues_with_resume(tmp_path, monkeypatch):
    import lengthgen.experiments.jobs as jobs

    reference = _compare(tmp_path / "reference", variants=("baseline", "l2"))
    original = jobs.Trainer.fit

    class Killed(BaseException):
        pass

    def interrupted(self, stop_at=None):      # l2 stops after step 1 (with a checkpoint), as if killed
        if self.run_dir.name.startswith("l2"):
            original(self, stop_at=1)
            raise Killed
        return original(self, stop_at)

    monkeypatch.setattr(jobs.Trainer, "fit", interrupted)
    with pytest.raises(Killed):
        _compare(tmp_path / "c", variants=("baseline", "l2"))
    monkeypatch.setattr(jobs.Trainer, "fit", original)
    finished = files(tmp_path / "c" / "runs" / "baseline-seed0")
    cfg = config("train.steps=2", "compare.eval_lengths=[8, 16]", "compare.eval_tokens=16")
    results = run_compare(cfg, tmp_path / "c", variants=["baseline", "l2"], progress=False, log=lambda _: None,
                          resume=True)
    assert files(tmp_path / "c" / "runs" / "baseline-seed0") == finished          # reused, not retrained
    for variant in ("baseline", "l2"):
        got, want = results.variants[variant][0], reference.variants[variant][0]
        assert got.final_train_loss == want.final_train_loss and got.lengths == want.lengths, variant
    # training time is the run's own, kept in its checkpoints and summed over sessions: not lost by reuse or resume
    from lengthgen.train.checkpoint import complete_checkpoints, read_state
    for variant in ("baseline", "l2"):
        state = read_state(complete_checkpoints(tmp_path / "c" / "runs" / f"{variant}-seed0")[0])
        assert results.variants[variant][0].train_seconds == state["train_seconds"] > 0, variant
    assert Comparison.load(tmp_path / "c" / "results.json") == results


def test_kill_9_then_resume_is_bit_exact(tmp_path):
    cfg = ["train.steps=60", "train.checkpoint_every=1"]
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lengthgen", "train", *sets(*cfg), "--out", str(run),
                             "--no-progress"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and len(list((run / "checkpoints").glob("step_*"))) < 2:
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    full = train(config("train.steps=60"), tmp_path / "full", progress=False)
    resumed = train(config("train.steps=60"), run, progress=False, resume=True)   # checkpoint_every may change
    assert resumed.history == full.history
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert losses(run) == list(enumerate(full.history, start=1))
    assert not list(run.rglob("*.tmp*"))


def _killed_at(call: str, n: int) -> str:
    """A `_python_m_lengthgen` prelude: the process kills itself (SIGKILL: no handler runs) as ``call``
    (``module:Class.method``) is called for the ``n``-th time."""
    module, name = call.split(":")
    owner, method = name.split(".")
    return (f"import os, signal, {module}\n"
            f"owner = {module}.{owner}\nbefore, calls = owner.{method}, []\n"
            "def killing(*args, **kwargs):\n"
            "    calls.append(1)\n"
            f"    if len(calls) == {n}:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return before(*args, **kwargs)\n"
            f"owner.{method} = killing")


@pytest.mark.parametrize("evaluation", [1, 2])
def test_kill_9_in_an_evaluation_after_its_checkpoint_logs_it_on_resume(tmp_path, evaluation):
    """A kill during the evaluation at a checkpoint's step (the checkpoint is written first) lost that evaluation:
    the resumed run went on from the step after it, so metrics.jsonl never had it, and a finished run resumed
    returned the earlier evaluation as its metrics. The resume now evaluates that step first."""
    cfg = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=2", "train.eval_batches=1",
           "train.eval_batch_size=2", "train.eval_lengths=[8, 16]"]
    run = tmp_path / "run"
    killed = _python_m_lengthgen(_killed_at("lengthgen.train.trainer:Trainer._evaluations", evaluation),
                                 "train", *sets(*cfg), "--out", str(run), "--no-progress")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    full = train(config(*cfg), tmp_path / "full", progress=False)
    resumed = train(config(*cfg), run, progress=False, resume=True)
    evaluations = lambda folder: [e for e in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                                  if "eval" in e]  # noqa: E731
    assert evaluations(run) == evaluations(tmp_path / "full") and [e["step"] for e in evaluations(run)] == [2, 4]
    assert resumed.metrics == full.metrics and resumed.history == full.history
    assert RunEval.load(run / "eval.json").lengths == full.evaluation.lengths


def test_overwrite_after_a_kill_9_in_a_comparison_runs_atomic_write(tmp_path):
    """compare --overwrite after a kill as a run wrote latest.json refused the folder: the write's temporary
    (runs/NAME-seed0/.latest.json.XXXXXXXX.tmp) was taken for a file lengthgen did not write. Only the folder
    being locked had its temporaries removed, not its runs'; they are lengthgen's, deleted with the rest."""
    out = tmp_path / "c"
    kill = ("import os, signal\nreplace = os.replace\n"
            "def killing(src, dst, *args, **kwargs):\n"
            "    if str(dst).endswith('latest.json'):\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return replace(src, dst, *args, **kwargs)\n"
            "os.replace = killing")
    args = ["compare", "--variants", "baseline", *sets("train.checkpoint_every=1"), "--out", str(out), "--no-progress"]
    killed = _python_m_lengthgen(kill, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p.name for p in out.rglob("*.tmp")] and not (out / "results.json").exists()
    done = _python_m_lengthgen("", *args, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert (out / "results.json").is_file() and not list(out.rglob("*.tmp*"))


def test_stale_temporaries_are_removed_at_start(tmp_path, stopped):
    run = copy(stopped[0], tmp_path)
    (run / "checkpoints" / "step_00000004.tmp-dead").mkdir()
    (run / "checkpoints" / "step_00000004.tmp-dead" / "model.safetensors").write_bytes(b"half")
    (run / ".latest.json.x1y2_3z4.tmp").write_text("{")        # lengthgen.atomic's (tempfile's 8 characters)
    (run / ".notes.tmp").write_text("another program's")          # found by a probe: removed too
    resume(run)
    assert [p.name for p in run.rglob("*.tmp*")] == [".notes.tmp"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_run_files_follow_the_umask(tmp_path):
    saved = os.umask(0o002)
    try:
        result = train(config("train.eval_lengths=[8, 16]", "train.eval_batches=1"), tmp_path / "run",
                       progress=False)
    finally:
        os.umask(saved)
    paths = [p for p in result.run_dir.rglob("*")]
    names = {p.name for p in paths}
    assert {"model.safetensors", "optimizer.pt", "state.json", "latest.json", "eval.json", LOCK} <= names
    for path in paths:
        assert path.stat().st_mode & 0o777 == (0o775 if path.is_dir() else 0o664), path


# ---------------------------------------------------------------------------------------------------
# fuzz: any invalid config raises ConfigError naming a key, never another exception, before training


def _choices(hint: Any) -> set[str]:
    if typing.get_origin(hint) is typing.Literal:
        return {a for a in typing.get_args(hint) if isinstance(a, str)}
    return set().union(*map(_choices, typing.get_args(hint)))


KEYS = [(key, what) for key, what, _, _ in describe(RunConfig) if what != "a table"]
WORDS = sorted({w for _, what in KEYS if what.startswith("one of") for w in what[7:].replace(",", "").split()}
               | {"l2", "avnorm", "none", "", "counting", "mqar", "dyck", "byte", "gpt2", "hf:/nope", "bin:/nope/*.bin",
                  "/nope.parquet"})
SMALL = st.one_of(st.none(), st.booleans(), st.integers(-2, 40), st.floats(-2, 1e3), st.sampled_from(WORDS),
                  st.lists(st.integers(-1, 40), max_size=3), st.lists(st.lists(st.integers(-1, 40), max_size=3),
                                                                       max_size=2),
                  st.dictionaries(st.sampled_from(["vocab_size", "length", "num_keys", "x", "corpus", "tokenizer",
                                                   "split"]), st.integers(-2, 40) | st.sampled_from(WORDS),
                                  max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([k for k, _ in KEYS]), SMALL), min_size=1, max_size=3))
def test_fuzz_configs_raise_only_config_errors(assignments):
    """Everything a run checks before its first step (`resolve`, the model) fails only with `ConfigError` naming
    an assigned key (or with the install hint of a missing optional package). Text data starts from a corpus
    that is not there, so that no fuzzed config tokenizes a real one."""
    data = config().to_dict()
    data["data"]["text"] = {"corpus": "/nonexistent/corpus.txt", "cache": False}
    for key, value in assignments:
        data = set_key(data, key, value, RunConfig)
    try:
        cfg, _ = resolve(data)
        GPT(cfg.model)
    except ConfigError as err:
        assert (err.key and str(err).startswith(err.key)) or any(k in str(err) for k, _ in assignments), \
            (assignments, str(err))
    except MissingPackageError as err:
        assert "pip install" in str(err)


def test_a_diverged_run_ends_in_one_line_with_status_1(tmp_path, capsys, monkeypatch):
    from lengthgen.model import GPT

    original = GPT.loss

    def loss(self, output, batch):
        value, per = original(self, output, batch)
        return value * float("nan"), per

    monkeypatch.setattr(GPT, "loss", loss)
    code, err = cli(capsys, "train", *sets("train.steps=3"), "--out", tmp_path / "nan", "--no-progress")
    assert code == 1 and "training loss is nan at step 0" in err


def test_a_reader_that_leaves_early_is_not_a_traceback():
    import subprocess
    import sys

    shown = subprocess.run(f"{sys.executable} -m lengthgen config show counting | head -1", shell=True,
                           capture_output=True, text=True, timeout=120)
    assert shown.stdout.count("\n") == 1 and "Traceback" not in shown.stderr and "Error" not in shown.stderr


# ---------------------------------------------------------------------------------------------------
# the second probe: overwrites that lost another experiment, flags that did nothing, tracebacks


def test_overwrite_refuses_the_checkpoint_the_run_starts_from(tmp_path, capsys, stopped):
    run = copy(stopped[0], tmp_path)
    before = files(run)
    code, err = cli(capsys, "train", *sets(f"train.init_from={json.dumps(str(run))}"), "--out", run, "--overwrite")
    assert code == 2 and "(train.init_from), which this run starts from" in err and files(run) == before


@pytest.mark.parametrize("flag,action", [("--overwrite", "--overwrite replaces only"),
                                         ("--resume", "--resume continues only")])
def test_overwrite_and_resume_take_only_their_own_kind_of_folder(tmp_path, capsys, stopped, two_compares, flag,
                                                                 action):
    comparison, run = tmp_path / "a", copy(stopped[0], tmp_path)
    shutil.copytree(two_compares[0], comparison)
    before = files(comparison), files(run)
    code, err = cli(capsys, "train", *sets(), "--out", comparison, flag)
    assert code == 2 and f"holds a comparison (runs), not a training run; {action}" in err
    code, err = cli(capsys, "compare", "--variants", "baseline", *sets(), "--out", run, flag)
    assert code == 2 and f"holds a training run (checkpoints, config.json), not a comparison; {action}" in err
    assert (files(comparison), files(run)) == before


def test_report_out_refuses_another_experiments_folder(tmp_path, capsys, two_compares):
    a, b, _ = two_compares
    target = tmp_path / "a"
    shutil.copytree(a, target)
    before = files(target)
    code, err = cli(capsys, "report", b, "--out", target)
    assert code == 2 and "holds another experiment (runs)" in err and files(target) == before


def test_report_needle_and_theory_out_stay_out_of_folders_lengthgen_wrote(tmp_path, capsys, two_compares):
    """report --out a comparison's runs/ (or a run's tb/, or a new folder in a run) wrote its results.json, report
    and lock file there, which the owner's --overwrite then refused as 'files lengthgen did not write'. The refusal
    did not name --out."""
    comparison = tmp_path / "cmp"
    shutil.copytree(two_compares[0], comparison)
    run = next((comparison / "runs").iterdir())
    before = files(comparison)
    for command in (["report", two_compares[1]], ["needle", run, "--lengths", "8", "--samples", "1"], ["theory"]):
        for out, inside in ((comparison / "runs", comparison), (comparison / "merged", comparison),
                            (run / "tb", run), (run / "new", run)):
            code, err = cli(capsys, *command, "--out", out)
            assert (code, err) == (2, f"lengthgen {command[0]}: error: --out {out} is inside the folder {inside} "
                                      "that lengthgen wrote (its runs, checkpoints, logs); choose a folder outside it")
    assert files(comparison) == before and not (run / "new").exists()


def test_report_needle_and_theory_out_never_replace_a_users_files(tmp_path, capsys, two_compares):
    """Found by a probe: report --out DIR and needle --out DIR replaced a report.md or needle.md that the user kept
    in DIR, a folder lengthgen never wrote (no lock file, no results file). A shared results folder, whose lock
    file did not travel with it, is still reported in place."""
    run = tmp_path / "run"
    train(config("data.task=mqar", "data.task_kwargs={vocab_size = 16}"), run, progress=False)
    for command, held in ((["report", two_compares[0]], "report.md"),
                          (["needle", run, "--lengths", "16", "--samples", "2", "--no-progress"], "needle.md")):
        mine = tmp_path / command[0]
        mine.mkdir()
        (mine / held).write_text("mine")
        code, err = cli(capsys, *command, "--out", mine)
        assert code == 2 and err.endswith(f"--out {mine} holds {held}, which lengthgen did not write (the folder has "
                                          f"no {LOCK} and no results file); choose another folder"), err
        assert files(mine) == {held: b"mine"} and not (mine / LOCK).exists()
        (mine / held).unlink()
        assert cli(capsys, *command, "--out", mine)[0] == 0
    shared = tmp_path / "shared"
    shutil.copytree(two_compares[0], shared, ignore=shutil.ignore_patterns(LOCK, "runs"))
    assert cli(capsys, "report", shared)[0] == 0
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "theory.png").write_text("mine")                     # theory likewise
    code, err = cli(capsys, "theory", "--out", tmp_path / "plots")
    assert code == 2 and f"--out {tmp_path / 'plots'} holds theory.png, which lengthgen did not write" in err


def test_needle_and_report_never_replace_each_others_retrieval_map(tmp_path, capsys):
    """Found by a probe: needle --out a comparison's folder replaced its needle.png (the variants' map that its
    report.md embeds) with one run's map, and report --out a needle folder replaced the needle.png that needle.md
    embeds with the variants' map, both silently and without --overwrite."""
    mqar = ("data.task=mqar", "data.task_kwargs={vocab_size = 16}")
    _compare(tmp_path / "cmp", *mqar, "compare.needle_depths=[0, 1]", "compare.needle_samples=2")
    needle = ["needle", tmp_path / "cmp" / "runs" / "baseline-seed0", "--lengths", "16", "--depths", "0.5",
              "--samples", "2", "--no-progress"]
    assert cli(capsys, *needle, "--out", tmp_path / "map")[0] == 0
    before = files(tmp_path / "cmp"), files(tmp_path / "map")
    assert "needle.png" in before[0] and "needle.png" in before[1]
    code, err = cli(capsys, *needle, "--out", tmp_path / "cmp")
    assert code == 2 and err.endswith(f"--out {tmp_path / 'cmp'} holds a comparison's report (results.json), whose "
                                      "needle.png this map would replace; choose another folder"), err
    code, err = cli(capsys, "report", tmp_path / "cmp", "--out", tmp_path / "map")
    assert code == 2 and err.endswith(f"--out {tmp_path / 'map'} holds a retrieval map of lengthgen needle "
                                      "(needle.json), whose needle.png this report's map would replace; choose "
                                      "another folder"), err
    assert (files(tmp_path / "cmp"), files(tmp_path / "map")) == before
    assert cli(capsys, "report", tmp_path / "cmp")[0] == 0            # its own report is rebuilt in place


def test_eval_out_refuses_another_runs_eval_json(tmp_path, capsys, stopped):
    run, other = copy(stopped[0], tmp_path), tmp_path / "other"
    shutil.copytree(run, other)
    (other / "eval.json").write_text("{}")
    code, err = cli(capsys, "eval", run, "--lengths", "8", "--out", other / "eval.json")
    assert code == 2 and "is another run's eval.json" in err and (other / "eval.json").read_text() == "{}"
    assert cli(capsys, "eval", run, "--lengths", "8", "--out", run / "eval.json")[0] == 0   # its own: replaced


def test_eval_out_replaces_only_an_earlier_evaluation(tmp_path, capsys, stopped, two_compares):
    """``eval --out FILE`` replaced any file: notes, a JSON file of the user's, a comparison's results.json."""
    run = copy(stopped[0], tmp_path)
    results = tmp_path / "results.json"
    shutil.copy(two_compares[0] / "results.json", results)
    for path, text in ((tmp_path / "mine.json", '{"kind": "run"}'), (run / "notes.json", "{}"),
                       (results, results.read_text())):
        path.write_text(text)
        code, err = cli(capsys, "eval", run, "--lengths", "8", "--tokens", "64", "--out", path)
        assert code == 2 and err.endswith(f"--out {path} exists and is not an earlier evaluation (a results file of "
                                          "lengthgen eval); choose another file name"), err
        assert path.read_text() == text
    earlier = tmp_path / "eval.json"
    for _ in range(2):          # written, then replaced
        assert cli(capsys, "eval", run, "--lengths", "8", "--tokens", "64", "--out", earlier)[0] == 0
    assert RunEval.load(earlier).lengths[0].length == 8


def test_eval_out_keeps_a_runs_live_and_bema_evaluations_apart(tmp_path, capsys):
    """Found by a probe: eval RUN --bema --out RUN/eval.json wrote the BEMA weights' evaluation as the run's eval.json,
    and eval RUN --out RUN/eval_bema.json the live weights' as its eval_bema.json; a resume kept both as current."""
    run = train(config("train.bema.enabled=true", "train.bema.tau=1"), tmp_path / "run", progress=False).run_dir
    before = files(run)
    for name, flags, fix in (("eval.json", ["--bema"], "leave out --bema"), ("eval_bema.json", [], "add --bema")):
        code, err = cli(capsys, "eval", run, "--lengths", "8", "--tokens", "64", *flags, "--out", run / name)
        assert code == 2 and err.endswith(f"--out {run / name}: the run's {name} holds the evaluation of its "
                                          f"{'BEMA' if 'bema' in name else 'live'} weights; {fix} or choose "
                                          "another file name"), err
    assert files(run) == before
    for name, flags in (("eval.json", []), ("eval_bema.json", ["--bema"])):
        assert cli(capsys, "eval", run, "--lengths", "8", "--tokens", "64", *flags, "--out", run / name)[0] == 0
        assert RunEval.load(run / name).bema == bool(flags)


@pytest.mark.parametrize("name", ["notes.txt", "results", "eval.JSON"])
def test_eval_out_is_a_json_file_name(tmp_path, capsys, stopped, name):
    """``eval --out results`` wrote its evaluation, which a second ``eval --out results`` then refused to replace
    as 'not an earlier evaluation' (only .json files are read as results); a user's notes.txt was named so too."""
    out = tmp_path / name
    for mine in (None, "mine"):
        if mine:
            out.write_text(mine)
        code, err = cli(capsys, "eval", stopped[0], "--lengths", "8", "--tokens", "64", "--out", out)
        assert code == 2 and err.endswith(f"--out {out}: give a file name ending in .json, the results' format (an "
                                          "earlier evaluation is replaced only under such a name)")
        assert (out.read_text() if out.exists() else None) == mine


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "byte"]])
@pytest.mark.parametrize("command", ["eval", "needle"])
def test_hf_given_a_run_folder_names_it_and_leaves_no_folder(tmp_path, capsys, stopped, command, tokenizer):
    """--hf RUN went to transformers' ValueError (or a missing tokenizer.json), and needle left its --out
    folder behind holding only a lock file."""
    out = tmp_path / ("out.json" if command == "eval" else "out")
    code, err = cli(capsys, command, "--hf", stopped[0], *tokenizer, "--out", out)
    assert code == 2 and f"HF model path '{stopped[0]}' is a lengthgen run folder: give it as the run" in err
    assert not out.exists()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 8}')
    code, err = cli(capsys, command, "--hf", tmp_path / "model", *tokenizer, "--out", out)
    assert code == 2 and "its config.json has no model_type" in err and not out.exists()


def test_a_failed_command_removes_only_the_folder_it_created(tmp_path):
    with pytest.raises(ValueError), lock(tmp_path / "new" / "out"):
        raise ValueError
    assert not (tmp_path / "new" / "out").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError), lock(tmp_path / "kept"):
        raise ValueError
    with pytest.raises(ValueError), lock(tmp_path / "written") as held:
        (held.folder / "results.json").write_text("{}")
        raise ValueError
    assert (tmp_path / "kept").is_dir() and (tmp_path / "written" / "results.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("train.init_from='nowhere'", "no run folder or checkpoint at nowhere"),
    ("train.muon_lr_mul={'*' = 2.0}", "train.muon_lr_mul applies only with train.optimizer=muon or normuon")])
def test_train_refused_once_its_folder_is_locked_removes_the_folder_it_created(tmp_path, capsys, override,
                                                                              message):
    """Errors found after train locked its new --out (the weights to start from, the optimizers' keys) left the
    folder behind with only the lock file in it; an existing folder stays."""
    code, err = cli(capsys, "train", *sets(override), "--out", tmp_path / "new")
    assert code == 2 and message in err and not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    assert cli(capsys, "train", *sets(override), "--out", tmp_path / "kept")[0] == 2
    assert (tmp_path / "kept").is_dir()


@pytest.mark.parametrize("override", ["train.init_from='nowhere'", "train.muon_lr_mul={'*' = 2.0}"])
def test_overwrite_refused_by_a_late_config_error_keeps_the_run(tmp_path, capsys, stopped, override):
    """train --overwrite deleted the run in --out, then found the weights to start from missing or an optimizer
    key that does not apply: a typo cost the earlier run."""
    run = copy(stopped[0], tmp_path)
    before = files(run)
    assert cli(capsys, "train", *sets(override), "--out", run, "--overwrite")[0] == 2
    assert files(run) == before


@pytest.mark.parametrize("override, message", [
    ("train.init_from='nowhere'", "no run folder or checkpoint at nowhere"),
    ("train.muon_lr_mul={'*' = 2.0}", "train.muon_lr_mul applies only with train.optimizer=muon or normuon"),
    ("train.adam_lr_mul={'nothing.*' = 2.0}", "train.adam_lr_mul: pattern 'nothing.*' matches no AdamW parameter")])
def test_compare_checks_the_optimizer_keys_and_init_from_before_overwriting(tmp_path, capsys, two_compares,
                                                                             override, message):
    """compare --overwrite emptied the comparison, then its first run found the weights to start from missing or
    an optimizer key that does not apply (without --overwrite: after the runs before it had trained)."""
    out = tmp_path / "a"
    shutil.copytree(two_compares[0], out)
    before = files(out)
    code, err = cli(capsys, "compare", *sets("train.steps=2", override), "--variants", "baseline", "--seeds", "1",
                    "--eval-lengths", "8,16", "--eval-tokens", "16", "--out", out, "--overwrite")
    assert code == 2 and message in err and files(out) == before


def test_retrofit_checks_the_optimizer_keys_before_overwriting(tmp_path, capsys, stopped):
    """retrofit --overwrite emptied its folder and evaluated the checkpoint before the control's finetuning found
    an optimizer key that does not apply."""
    out = tmp_path / "retrofit"
    args = ["retrofit", stopped[0], "--set", "model.attention.out_norm=head_layer", "--steps", "1",
            "--eval-lengths", "8", "--eval-tokens", "8", "--out", out, "--no-progress"]
    assert cli(capsys, *args)[0] == 0
    before = files(out)
    code, err = cli(capsys, *args, "--set", "train.adam_lr_mul={'nothing' = 2.0}", "--overwrite")
    assert code == 2 and "train.adam_lr_mul: pattern 'nothing' matches no AdamW parameter" in err
    assert files(out) == before


@pytest.mark.parametrize("args, message", [
    (["--hf", "somewhere"], "give a run folder or checkpoint, or --hf PATH"),
    (["--corpus", "stdlib"], "--corpus and --tokenizer apply only with --hf"),
    (["--tokenizer", "gpt2"], "--corpus and --tokenizer apply only with --hf"),
])
@pytest.mark.parametrize("command", ["eval", "needle"])
def test_eval_and_needle_refuse_flags_they_would_ignore(capsys, stopped, command, args, message):
    code, err = cli(capsys, command, stopped[0], *args)
    assert code == 2 and message in err


@pytest.mark.parametrize("command", ["eval", "needle"])
def test_bema_with_hf_is_refused(tmp_path, capsys, command):
    """--hf DIR --bema evaluated the HF model's only weights without a word."""
    code, err = cli(capsys, command, "--hf", tmp_path, "--bema", "--out", tmp_path / "out")
    assert code == 2 and "--bema applies to a run's BEMA weights; an --hf model has none" in err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe[model]", "is not UTF-8 text"), (None, "is a folder; give a TOML or JSON file")])
def test_config_file_that_is_binary_or_a_folder(tmp_path, capsys, content, message):
    path = tmp_path / "c.toml"
    path.write_bytes(content) if content is not None else path.mkdir()
    code, err = cli(capsys, "train", "--config", path, "--out", tmp_path / "o")
    assert code == 2 and err.startswith(f"lengthgen train: error: config file {path} {message}")
    (tmp_path / "c.json").write_text('{"model":')
    code, err = cli(capsys, "config", "show", tmp_path / "c.json")
    assert code == 2 and "c.json: invalid JSON" in err


@pytest.mark.parametrize("suffix, text", [(".toml", "[train]\nsteps = 7\n"), (".json", '{"train": {"steps": 7}}')])
def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path, capsys, suffix, text):
    """A UTF-8 byte-order mark (Windows editors write one) was 'Invalid statement (line 1, column 1)'."""
    path = tmp_path / f"c{suffix}"
    path.write_text("\ufeff" + text, encoding="utf-8")
    code, err = cli(capsys, "config", "show", path)
    assert code == 0, err
    from lengthgen.train.config import load_config
    assert load_config(path).train.steps == 7


def test_a_results_file_given_as_a_config_is_named(tmp_path, capsys):
    """train --config results.json said 'schema is not a valid key'."""
    (tmp_path / "results.json").write_text('{"schema": "lengthgen-results/1", "kind": "comparison", "runs": []}')
    code, err = cli(capsys, "train", "--config", tmp_path / "results.json", "--out", tmp_path / "o")
    assert code == 2 and err.endswith(f"{tmp_path / 'results.json'} is a lengthgen results file (comparison), not a "
                                      "config; a run's config is the config.json in its folder")


def test_config_show_of_a_folder_of_another_kind_names_it(tmp_path, capsys, stopped):
    """config show of a comparison, a retrofit, a checkpoint or an empty folder said 'config file not found:
    FOLDER/config.json', and of an exported Hugging Face model 'architectures is not a valid key'."""
    run = stopped[0]
    for folder in ("cmp/runs/baseline-seed0", "retro/finetune", "empty"):
        (tmp_path / folder).mkdir(parents=True)
    for folder in ("cmp/runs/baseline-seed0", "retro/finetune"):
        save_config(config(), tmp_path / folder)
        (tmp_path / folder / LOCK).touch()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["LengthgenForCausalLM"], "model_type": '
                                                 '"lengthgen", "gpt": {}}')
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    for what, says in [
            (tmp_path / "cmp", f"{tmp_path / 'cmp'} holds a comparison, not a run: each of its runs (in "
                               f"{tmp_path / 'cmp/runs'}) has its own config, e.g. lengthgen config show "
                               f"{tmp_path / 'cmp/runs/baseline-seed0'}"),
            (tmp_path / "retro", f"{tmp_path / 'retro'} holds a retrofit, not a run: each of its runs (in "
                                 f"{tmp_path / 'retro/finetune'}) has its own config, e.g. lengthgen config show "
                                 f"{tmp_path / 'retro/finetune'}"),
            (checkpoint, f"{checkpoint} is a checkpoint of the run {run}: lengthgen config show {run} shows its "
                         "config"),
            (run / "checkpoints", f"{run / 'checkpoints'} is the checkpoints folder of the run {run}: lengthgen "
                                  f"config show {run} shows its config"),
            (tmp_path / "empty", f"{tmp_path / 'empty'} holds no config.json, so it is not a run folder; give a run "
                                 "folder, a config file or a name in configs/"),
            (tmp_path / "hf", f"{tmp_path / 'hf/config.json'} is a Hugging Face model's config (model_type "
                              "lengthgen), not a run config; a run's config is the config.json in its run folder")]:
        assert cli(capsys, "config", "show", what) == (2, f"lengthgen config: error: {says}")
    code, err = cli(capsys, "train", "--config", tmp_path / "hf" / "config.json", "--out", tmp_path / "o")
    assert code == 2 and "is a Hugging Face model's config (model_type lengthgen)" in err


@pytest.mark.parametrize("command", [["train"], ["compare"], ["retrofit", "run", "--steps", "1"], ["needle", "run"],
                                     ["export", "run"], ["report", "a"], ["report", "a", "b"], ["theory"]])
def test_out_that_is_a_file_or_under_one(tmp_path, capsys, command):
    """compare, train, retrofit, needle and report said only 'FILE: file exists' (or 'not a directory'), without
    naming --out, where theory named it."""
    (tmp_path / "f").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "f" / "x")      # a link to nothing under a file
    for out, says in ((tmp_path / "f", f"--out {tmp_path / 'f'} is a file; give a folder"),
                      (tmp_path / "f" / "sub", f"--out {tmp_path / 'f' / 'sub'}: {tmp_path / 'f'} is a file, not a "
                                                "folder"),
                      (tmp_path / "link", f"--out {tmp_path / 'link'}: {tmp_path / 'f'} is a file, not a folder")):
        code, err = cli(capsys, *command, "--out", out)
        assert code == 2 and err.endswith(says)
    assert (tmp_path / "f").read_text() == "keep"


def test_train_default_folder_that_is_a_file_or_under_one(tmp_path, capsys, monkeypatch):
    """train without --out, its default runs/<name> a file (or runs/ one), said only 'runs/run: file exists';
    compare's and theory's defaults were named as a given --out."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for command in ("compare", "theory"):
        (tmp_path / "runs" / command).write_text("keep")
        code, err = cli(capsys, command)
        assert code == 2 and err.endswith(f"runs/{command} (the default --out) is a file; give a folder with --out")
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run").write_text("keep")
    code, err = cli(capsys, "train", *sets())
    assert code == 2 and err.endswith("runs/run (the default --out) is a file; give a folder with --out")
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "runs").write_text("keep")
    code, err = cli(capsys, "train", *sets())
    assert code == 2 and err.endswith("runs/run (the default --out): runs is a file, not a folder; give another "
                                      "folder with --out")
    assert (tmp_path / "runs").read_text() == "keep"


def test_out_that_is_a_link_to_nothing_writes_the_folder_it_names(tmp_path, capsys, two_compares):
    """A symbolic link to nothing as --out (or on the way to eval's --out file, found after the evaluation) said
    only 'LINK: file exists' (export followed it): the folder it names is now written, the link stays; a command
    that fails leaves it as it was (its error said 'not a directory'); links in a loop are one line naming --out,
    not a traceback."""
    run = tmp_path / "made" / "train"
    for command in (["train", "--no-progress", *sets()], ["report", two_compares[0]], ["theory"],
                    ["retrofit", run, "--steps", "1", "--set", "model.attention.softmax_p=2.0", "--eval-lengths", "8",
                     "--eval-tokens", "64", "--no-progress"],
                    ["compare", "--variants", "baseline", "--eval-lengths", "8", "--no-progress", *sets()]):
        link = tmp_path / f"{command[0]}-link"
        link.symlink_to(tmp_path / "made" / command[0])
        assert cli(capsys, *command, "--out", link) == (0, "")
        assert link.is_symlink() and (tmp_path / "made" / command[0] / LOCK).exists()
    (tmp_path / "eval-link").symlink_to(tmp_path / "made" / "eval")           # eval writes a file under it
    assert cli(capsys, "eval", run, "--lengths", "8", "--out", tmp_path / "eval-link" / "e.json") == (0, "")
    assert (tmp_path / "made" / "eval" / "e.json").is_file() and (tmp_path / "eval-link").is_symlink()
    (tmp_path / "needle-link").symlink_to(tmp_path / "made" / "needle")
    code, err = cli(capsys, "needle", run, "--lengths", "8", "--out", tmp_path / "needle-link")
    assert code == 2 and err.endswith("'counting' has no needles to retrieve; retrieval maps need a retrieval task "
                                      "(passkey, mqar) or text data")
    assert (tmp_path / "needle-link").is_symlink() and not (tmp_path / "made" / "needle").exists()
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out in (tmp_path / "loop", tmp_path / "loop" / "sub"):
        code, err = cli(capsys, "theory", "--out", out)
        assert code == 2 and err.endswith(f"--out {out}: its symbolic links lead in a loop; give another path")


def test_a_file_out_under_a_file_is_refused_before_the_work(tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    # bench and eval write one file: a file in its path was found only after the benchmark had run
    for command in (["bench", "attention", "--device", "cpu", "--lengths", "16", "--head-dims", "8",
                     "--variants", "baseline", "--backends", "dense", "--time-budget", "0.001"], ["eval", "run"]):
        out = tmp_path / "f" / "x.json"
        code, err = cli(capsys, *command, "--out", out)
        assert code == 2 and err.endswith(f"--out {out}: {tmp_path / 'f'} is a file, not a folder")


@pytest.mark.skipif(sys.platform != "linux", reason="/sys, where even root cannot create a file, is Linux's")
def test_out_where_nothing_can_be_written_is_refused_before_the_work(tmp_path, capsys, monkeypatch, stopped):
    """``eval --out`` in a forbidden (or read-only) folder evaluated every length, then failed to write."""
    def not_now(*args, **kwargs):
        raise AssertionError("the work began")

    monkeypatch.setattr("lengthgen.experiments.eval_run.eval_run", not_now)
    monkeypatch.setattr("lengthgen.experiments.theory.main_theory", not_now)
    (tmp_path / "link").symlink_to("/sys/lengthgen-test")      # a link to nothing: where it leads is checked
    for command, out in ((["eval", stopped[0], "--lengths", "8"], "/sys/lengthgen-test/eval.json"),
                         (["theory"], "/sys/lengthgen-test"), (["theory"], tmp_path / "link")):
        code, err = cli(capsys, *command, "--out", out)
        assert code == 2 and err.endswith(f"--out {out}: nothing can be written in /sys (permission denied); "
                                          "choose another path"), err


@pytest.mark.parametrize("args", [["--heads", "0"], ["--reps", "0"], ["--time-budget", "-1"], ["--lengths", "0"],
                                  ["--device", "tpu"], ["--variants", "foo"], ["--backends", "foo"],
                                  ["--backends", "auto"],     # auto picks per case: not a benchmarked backend
                                  ["--dtype", "int8"], ["--batch", "-1"]])
def test_bench_arguments_are_checked(capsys, args):
    code, err = cli(capsys, "bench", "attention", *args)
    assert code == 2 and args[0] in err


@pytest.mark.parametrize("command, after", [
    ("train", "no checkpoint was written yet: --resume starts it again from step 0"),
    ("train-checkpointed", "the run continues from its last checkpoint with --resume"),
    ("compare", "the comparison continues with --resume: finished runs are reused"),
    ("retrofit", "retrofit has no --resume: run it again with --overwrite")])
def test_ctrl_c_is_one_line_saying_how_the_command_goes_on(tmp_path, capsys, monkeypatch, stopped, command, after):
    """An interrupted retrofit pointed to a --resume it does not have; a run without a checkpoint yet, to a
    --resume that starts over."""
    from lengthgen.train import trainer

    fit = trainer.Trainer.fit

    checkpointed = command == "train-checkpointed"

    def interrupted(self, *args, **kwargs):
        if checkpointed:
            fit(self, stop_at=1)
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer.Trainer, "fit", interrupted)
    args = {"train": sets(), "train-checkpointed": sets(), "compare": ["--variants", "baseline", *sets()],
            "retrofit": [stopped[0], "--steps", "1", "--set", "model.attention.softmax_p=2.0"]}
    command = command.removesuffix("-checkpointed")
    code = main([command, *map(str, args[command]), "--out", str(tmp_path / "r"), "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if ": warning: " not in line]
    assert code == 130 and err == [f"lengthgen {command}: interrupted ({after})"]


def test_ctrl_c_of_report_says_to_run_it_again(tmp_path, capsys, monkeypatch, two_compares):
    """An interrupted report (its results.json and a plot written, report.md not yet) said only 'interrupted'."""
    import lengthgen.report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(lengthgen.report, "markdown_report", interrupted)       # after the plots
    assert main(["report", str(two_compares[0]), "--out", str(tmp_path / "r")]) == 130
    assert capsys.readouterr().err == ("lengthgen report: interrupted (the results it reads are intact: run it again "
                                       "to write the whole report)\n")
    monkeypatch.undo()
    assert main(["report", str(two_compares[0]), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.md").is_file()


def _python_m_lengthgen(prelude: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m lengthgen ARGS`` (runpy, as the shell runs it) after the Python code ``prelude``."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = ['lengthgen', *{list(args)!r}]\n" \
           "runpy.run_module('lengthgen', run_name='__main__', alter_sys=True)\n"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("module", ["torch", "numpy"])
def test_ctrl_c_while_the_command_line_imports_is_one_line(module):
    """Ctrl-C in the first seconds (the imports, before main's handler) printed a KeyboardInterrupt traceback;
    while torch imported numpy the command ignored it and ran on (torch's start swallows it). Ctrl-C is sent here
    as Python looks for ``module``."""
    hook = ("import os, signal, sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, *rest):\n"
            f"        if name == {module!r}:\n"
            "            sys.meta_path.remove(self)\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Interrupt())")
    done = _python_m_lengthgen(hook, "config", "show")
    assert (done.returncode, done.stderr, done.stdout) == (
        130, "lengthgen: interrupted while starting; nothing was written\n", "")


def test_ctrl_c_before_the_command_starts_is_one_line(capsys, monkeypatch):
    """The parser (it imports each command's options' choices) ran outside main's Ctrl-C handler."""
    import lengthgen.cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(lengthgen.cli, "build_parser", interrupted)
    try:
        code = main(["config", "show"])
    except KeyboardInterrupt:
        code = "a KeyboardInterrupt"
    assert code == 130
    assert capsys.readouterr().err == "lengthgen: interrupted while starting; nothing was written\n"


def test_ctrl_c_once_the_command_is_over_changes_nothing():
    """Ctrl-C as the interpreter exited after a finished command printed a traceback from an atexit callback
    (or the process died of SIGINT): the command's work is done, its exit status stands."""
    late = "import atexit, os, signal\natexit.register(lambda: [os.kill(os.getpid(), signal.SIGINT), sum(range(9))])"
    done = _python_m_lengthgen(late, "config", "show", "counting")
    assert (done.returncode, done.stderr) == (0, "") and "task = \"counting\"" in done.stdout


def test_a_backend_that_cannot_train_here_is_refused_before_the_folder_exists(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = cli(capsys, "train", *sets("model.attention_backend=flex"), "--out", out)
    assert code == 2 and "model.attention_backend='flex' cannot train layer 0's attention on cpu" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_compare_refuses_a_backend_that_cannot_train_before_its_folder_exists(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, err = cli(capsys, "compare", "--variants", "baseline", *sets("model.attention_backend=flex"), "--out", out)
    assert code == 2 and "model.attention_backend='flex' cannot train layer 0's attention on cpu" in err
    assert not out.exists()


def test_unreachable_stages_warmup_and_task_doc_masking_are_one_line_warnings(tmp_path, capsys):
    """A stage that starts at or after the last step, a warmup longer than the run, and document masking on a
    task (one document per sequence) are valid (a smoke run of a staged config) but have no effect: train and
    compare say so in one line each, then run."""
    late = ("train.stages=[[0, 8], [4, 16]]", "train.warmup_steps=8")
    assert main(["train", *sets(*late), "--out", str(tmp_path / "run")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
    assert warned == ["lengthgen train: warning: train.stages [[4, 16]] start at or after train.steps=4 (steps "
                      "count from 0): never used",
                      "lengthgen train: warning: train.warmup_steps=8 > train.steps=4: the learning rate only "
                      "reaches 0.5 x train.lr"]
    assert main(["train", *sets("train.stages=[[0, 8], [3, 16]]", "train.warmup_steps=4"), "--out",
                 str(tmp_path / "reached")]) == 0
    assert ": warning: " not in capsys.readouterr().err
    assert main(["train", *sets("model.attention.doc_masking=true"), "--out", str(tmp_path / "task")]) == 0
    assert "lengthgen train: warning: model.attention.doc_masking=True has no effect on data.kind='task' " \
        "(counting): a task's sequences are one document each\n" in capsys.readouterr().err
    assert main(["train", *sets("train.bema.enabled=true", "train.bema.tau=4"), "--out", str(tmp_path / "bema")]) == 0
    assert "lengthgen train: warning: train.bema.tau=4 >= train.steps=4: BEMA never starts" in capsys.readouterr().err


def test_attention_fields_no_layer_reads_are_one_line_warnings(tmp_path, capsys):
    """A p-RoPE fraction on a NoPE model, a distance scale without a distance term: valid, read by no layer (one
    warning each, once per rule); a hybrid placement's own QK-norm reads the QK-norm eps."""
    assert main(["train", *sets("model.attention.position=nope", "model.attention.prope_fraction=0.5",
                                "model.layer_attention=[{every = 1, spec = {tau = 2.0}}]"),
                 "--out", str(tmp_path / "run")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
    assert warned == ["lengthgen train: warning: model.layer_attention.tau=2.0 has no effect: it is read only with "
                      "distance scale_invariant or log_bias",
                      "lengthgen train: warning: model.layer_attention.prope_fraction=0.5 has no effect: it is read "
                      "only with position prope"]
    eps = "model.attention.qk_norm_eps=0.01"
    assert not GPTConfig.from_dict({"norm_placement": "hybrid", "attention": {"qk_norm_eps": 0.01}}).unused()
    assert main(["train", *sets(eps), "--out", str(tmp_path / "pre")]) == 0
    assert "warning: model.attention.qk_norm_eps=0.01 has no effect: it is read only with a qk_norm\n" \
        in capsys.readouterr().err


def test_a_window_no_length_reaches_is_a_train_warning_and_compare_checks_its_own_lengths(tmp_path, capsys,
                                                                                           monkeypatch):
    """A window at least as long as every length a run trains and evaluates at (data.length, train.eval_lengths)
    is full attention: train says so in one line. Compare checks the base at its own lengths (compare.eval_lengths),
    once: no warning for a window its evaluation reaches, one unnamed for a window none reaches."""
    window = "model.attention.window=16 has no effect at lengths 8, 16: it hides no key, so its layers are full " \
             "causal attention, as without a window; set a window below 16"
    assert main(["train", *sets("model.attention.window=16", "train.eval_lengths=[8, 16]"), "--out",
                 str(tmp_path / "run")]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line] == \
        [f"lengthgen train: warning: {window}"]
    assert main(["train", *sets("model.attention.window=8", "train.eval_lengths=[8, 16]"), "--out",
                 str(tmp_path / "reached")]) == 0
    assert ": warning: " not in capsys.readouterr().err

    class Trained(Exception):
        pass

    def run(self, jobs):                # nothing trains: the warnings come first
        raise Trained

    monkeypatch.setattr("lengthgen.experiments.compare.Runner.run", run)
    for size, warned in ((12, []), (16, [f"lengthgen compare: warning: {window}"])):
        with pytest.raises(Trained):
            main(["compare", "--variants", "baseline,l2", *sets(f"model.attention.window={size}",
                  "compare.eval_lengths=[8, 16]", "train.warmup_steps=0"), "--out", str(tmp_path / f"c{size}")])
        assert [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line] == warned


@pytest.mark.parametrize("override, message", [
    ('data.text={corpus = "stdlib"}', "data.text is set, but data.kind='task' does not read it: set data.kind=text "
                                      "or data.text={}"),
    ("data.kind=text", "data.task_kwargs is set, but data.kind='text' does not read it: set data.kind=task or "
                       "data.task_kwargs={}"),
])
def test_data_arguments_of_the_other_kind_are_a_config_error(tmp_path, capsys, override, message):
    """They were ignored: a text corpus named under a task run trained on the task without a word."""
    code, err = cli(capsys, "train", *(text_sets if "kind=text" in override else sets)(override), "--out",
                    tmp_path / "run")
    assert code == 2 and err == f"lengthgen train: error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_full_disk_while_training_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    """A checkpoint write that found the disk full (ENOSPC) ended in a traceback; now one line (exit 1) saying so
    and how the run goes on. Nothing partial is left: the last complete checkpoint is the run's latest, and
    --resume finishes the run."""
    import errno

    import lengthgen.train.checkpoint as checkpoint

    writes, save = [], checkpoint.save_model

    def fills_up(*args, **kwargs):
        writes.append(1)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_model", fills_up)
    args = ["train", *sets("train.steps=4", "train.checkpoint_every=2"), "--out", tmp_path / "run", "--no-progress"]
    code, err = cli(capsys, *args)
    assert code == 1 and err == ("lengthgen train: error: no space left on device; free some space (the run "
                                 "continues from its last checkpoint with --resume)")
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002"]
    monkeypatch.setattr(checkpoint, "save_model", save)
    assert cli(capsys, *args, "--resume")[0] == 0
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 4
    monkeypatch.setattr(checkpoint, "save_model", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(OSError, match="I/O"):                 # other OS errors still raise
        main([str(a) for a in ["train", *sets("train.steps=2", "train.checkpoint_every=1"), "--out",
                               tmp_path / "other", "--no-progress"]])


CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 512000000 bytes. Error code 12 (Cannot allocate memory)")   # torch 2.13's own words


@pytest.mark.parametrize("error, what", [
    (RuntimeError(CPU_OOM), "tried to allocate 488 MiB"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 "
                            "GiB of which 3.2 GiB is free."), "CUDA out of memory. Tried to allocate 20.00 GiB"),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API "
                  "call, so the stacktrace below might be incorrect."), "CUDA error: out of memory"),
    (MemoryError(), "MemoryError"),
])
def test_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, error, what):
    """A huge eval length ran out of memory with a traceback; now one line (exit 1: not bad input as such, the
    machine's limit) saying what was tried and what to shrink. Other RuntimeErrors still raise."""
    train(config(), tmp_path / "run", progress=False)
    capsys.readouterr()

    def forward(self, *args, **kwargs):
        raise error
    monkeypatch.setattr(GPT, "forward", forward)
    code, err = cli(capsys, "eval", tmp_path / "run", "--lengths", "64")
    assert code == 1 and err == (f"lengthgen eval: error: out of memory ({what}); use shorter lengths, fewer tokens "
                                 "or a smaller batch")
    monkeypatch.setattr(GPT, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["eval", str(tmp_path / "run"), "--lengths", "64"])
    # train: --resume is suggested only once the run folder exists (here the model did not fit)
    monkeypatch.setattr(GPT, "__init__", forward)
    code, err = cli(capsys, "train", *sets(), "--out", tmp_path / "new")
    assert code == 1 and err.endswith("or a smaller batch") and not (tmp_path / "new").exists()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through Linux's /proc")
def test_compare_workers_end_with_a_killed_parent(tmp_path):
    """kill -9 of `lengthgen compare --workers 2` left both workers training on as orphans; they now exit."""
    out = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "lengthgen", "compare", "--variants", "baseline,l2", "--workers",
                             "2", "--out", str(out), "--no-progress", *sets("train.steps=100000")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and \
                len(list(out.glob("runs/*/metrics.jsonl"))) < 2:
            time.sleep(0.05)
        workers = _children(proc.pid)               # the two workers (and multiprocessing's resource tracker)
        assert proc.poll() is None and len(list(out.glob("runs/*/metrics.jsonl"))) == 2, "the runs did not start"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert workers and not left, f"orphaned workers {left} of {workers}"


def _start_two_workers(out: Path, *flags: str) -> tuple[subprocess.Popen, list[int]]:
    """`lengthgen compare --workers 2` of two long runs in its own session (Ctrl-C reaches its process group, as
    from a terminal), once both runs train; and the two worker processes."""
    proc = subprocess.Popen([sys.executable, "-m", "lengthgen", "compare", "--variants", "baseline,l2", "--workers",
                             "2", "--out", str(out), "--no-progress", *flags, *sets("train.steps=100000")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, workers = time.monotonic() + 120, []
    while proc.poll() is None and time.monotonic() < deadline and \
            (len(list(out.glob("runs/*/metrics.jsonl"))) < 2 or len(workers) < 2):
        time.sleep(0.05)
        workers = [pid for pid in _children(proc.pid) if b"spawn_main" in _cmdline(pid)]
    if proc.poll() is not None or len(workers) != 2:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the runs did not start: {proc.communicate()[1]}")
    return proc, workers


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    """(exit status, stderr) of ``proc`` within 60 s (its runs have 100000 steps to go); killed and failed else."""
    try:
        return proc.wait(60), proc.stderr.read()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("compare went on after its workers were interrupted or lost")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through Linux's /proc")
def test_compare_workers_ctrl_c_and_a_killed_worker_end_in_one_line(tmp_path):
    """Ctrl-C of compare --workers 2 printed a KeyboardInterrupt traceback from every worker (SIGINT to the parent
    alone waited for the running runs to finish), and a worker killed with -9 (the system's out-of-memory killer)
    ended compare in a BrokenProcessPool traceback. Now: the workers ignore SIGINT, the parent ends them at once,
    and each case is one line; --resume continues from the checkpoints."""
    out = tmp_path / "c"
    proc, workers = _start_two_workers(out)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = _ended(proc)
    assert code == 130 and "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "lengthgen compare: interrupted"), err
    assert not any(map(_alive, workers))
    proc, workers = _start_two_workers(out, "--resume")
    os.kill(workers[0], signal.SIGKILL)
    code, err = _ended(proc)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("lengthgen compare: error: a worker process ended abruptly"), err
    assert "--resume continues" in err and not any(map(_alive, workers))


def test_a_shipped_config_named_without_its_path(tmp_path, capsys, monkeypatch):
    """``--config counting`` said only "not found"; from a clone it is configs/counting.toml, as for lengthgen
    config show (one rule for both); the library's load_config points at it."""
    from lengthgen.train.config import load_config

    monkeypatch.chdir(ROOT)
    assert main(["train", "--config", "counting", *sets("train.steps=1"), "--out", str(tmp_path / "named")]) == 0
    assert json.loads((tmp_path / "named" / "config.json").read_text())["name"] == "counting"
    with pytest.raises(FileNotFoundError, match=r"config file not found: counting \(did you mean "
                                                r"configs/counting.toml\?\)"):
        load_config("counting")
    code, err = cli(capsys, "train", "--config", "no_such_config", "--out", tmp_path / "run")
    assert (code, err) == (2, "lengthgen train: error: config file not found: no_such_config (a name of configs/, "
                              "listed by lengthgen config list, or a path)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["variants", "bases"])
def test_a_variant_may_not_set_the_seed(tmp_path, capsys, key):
    """A variant (or base) setting train.seed replaced every compare seed: its n runs, named seed0..seedN, were n
    copies of one run with zero spread, which the winner rule took as a clean separation."""
    code, err = cli(capsys, "compare", *sets(f'compare.{key}={{b = {{model.attention = "l2", train.seed = 7}}}}'),
                    "--out", tmp_path / "c")
    assert (code, err) == (2, f"lengthgen compare: error: compare.{key}.b sets train.seed, which compare.seeds sets "
                              "for every run (each seed is one run); leave it out")
    assert not (tmp_path / "c").exists()


def test_out_never_lands_in_another_run_or_in_a_checkpoint(tmp_path, capsys):
    """Found by a probe: ``needle A --out B`` replaced run B's own retrieval map; ``eval --out`` could replace a
    checkpoint's model.safetensors (resuming then found it damaged); ``--out DIR`` failed only after the work,
    naming a temporary file."""
    for name in ("a", "b"):
        train(config("train.steps=1"), tmp_path / name, progress=False)
    before = files(tmp_path / "b")
    code, err = cli(capsys, "needle", tmp_path / "a", "--out", tmp_path / "b")
    assert (code, err) == (2, f"lengthgen needle: error: --out {tmp_path / 'b'} is another run's folder (its own map "
                              "would be replaced); choose another folder")
    weights = next((tmp_path / "b" / "checkpoints").glob("step_*")) / "model.safetensors"
    for command in (["eval", tmp_path / "a", "--lengths", "16"], ["bench", "attention", "--device", "cpu"]):
        code, err = cli(capsys, *command, "--out", weights)
        assert code == 2 and err.endswith(f"--out {weights} is inside the folder {tmp_path / 'b'} that lengthgen "
                                          "wrote (checkpoints, logs); choose a file outside it, or directly in it")
        code, err = cli(capsys, *command, "--out", tmp_path)
        assert code == 2 and err.endswith(f"--out {tmp_path} is a folder; give a file path")
    assert files(tmp_path / "b") == before


def test_no_output_folder_goes_inside_a_runs_checkpoints(tmp_path, capsys, stopped, two_compares):
    """Found by a probe: ``train --out RUN/checkpoints/step_00000009`` trained into it, and RUN resumed took that
    run for its own damaged newest checkpoint and set it aside; an export there looked like a checkpoint too. A
    folder named checkpoints that is not a run's stays usable."""
    run = copy(stopped[0], tmp_path)
    before = files(run)
    inside = run / "checkpoints" / "step_00000009"
    for command in (["train", *sets()], ["compare", "--variants", "baseline", *sets()], ["theory"],
                    ["needle", run], ["report", two_compares[0]], ["export", run]):
        code, err = cli(capsys, *command, "--out", inside)
        assert code == 2 and err.endswith(f"{inside} is inside {run / 'checkpoints'}, where the run {run} keeps and "
                                          "deletes its checkpoints; choose a folder outside it"), err
    assert files(run) == before and not inside.exists()
    lock(tmp_path / "checkpoints" / "mine").release()


def test_overwrite_refuses_files_lengthgen_did_not_write_inside_its_folders(tmp_path, capsys, stopped):
    """--overwrite checked only the top of the folder: a user's file inside a comparison's run folder, a copied
    checkpoint or a note in tb/ went with it."""
    _compare(tmp_path / "c")
    (tmp_path / "c" / "runs" / "baseline-seed0" / "notes.txt").write_text("mine")
    before = files(tmp_path / "c")
    code, err = cli(capsys, "compare", "--out", tmp_path / "c", "--overwrite", "--variants", "baseline",
                    *sets("train.steps=2"))
    assert code == 2 and "holds files lengthgen did not write (runs/baseline-seed0/notes.txt)" in err
    assert files(tmp_path / "c") == before
    (tmp_path / "c" / "runs" / "baseline-seed0" / "notes.txt").unlink()
    (tmp_path / "c" / "runs" / "baseline-seed0" / "wandb").mkdir()        # W&B's own folder in a run (--wandb)
    assert cli(capsys, "compare", "--out", tmp_path / "c", "--overwrite", "--variants", "baseline",
               *sets("train.steps=2"))[0] == 0
    run = copy(stopped[0], tmp_path)
    shutil.copytree(run / "checkpoints" / "step_00000003", run / "checkpoints" / "best_keep")
    (run / "tb" / "NOTES.txt").write_text("mine")
    code, err = cli(capsys, "train", "--out", run, "--overwrite", *sets())
    assert code == 2 and "(checkpoints/best_keep, tb/NOTES.txt)" in err
    assert (run / "checkpoints" / "best_keep").is_dir() and (run / "tb" / "NOTES.txt").is_file()


def test_overwrite_takes_the_runs_of_a_base_named_like_a_run(tmp_path, stopped):
    """A base named NAME-seedN (runs/pre-seed0/v1-seed0) was taken for a run folder, whose run folders compare
    --overwrite then refused as files lengthgen did not write; a user's file beside them still is refused."""
    out = tmp_path / "compare"
    for run in ("v1-seed0", "v2-seed0"):
        shutil.copytree(stopped[0], out / "runs" / "pre-seed0" / run)
    (out / "results.json").write_text("{}")
    (out / "runs" / "pre-seed0" / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match=r"did not write \(runs/pre-seed0/notes.txt\)"):
        check_fresh(out, overwrite=True, kind="comparison")
    (out / "runs" / "pre-seed0" / "notes.txt").unlink()
    check_fresh(out, overwrite=True, kind="comparison")
    assert list(out.iterdir()) == []


def test_overwrite_takes_the_results_files_eval_wrote_into_the_run(tmp_path, capsys, stopped):
    """``lengthgen eval RUN --out RUN/NAME.json`` wrote a file that --overwrite then refused as not lengthgen's;
    a JSON file of the user's still is refused."""
    run = copy(stopped[0], tmp_path)
    assert cli(capsys, "eval", run, "--lengths", "8", "--tokens", "64", "--out", run / "mine.json")[0] == 0
    (run / "notes.json").write_text('{"kind": "run", "mine": true}')
    code, err = cli(capsys, "train", "--out", run, "--overwrite", *sets())
    assert code == 2 and "holds files lengthgen did not write (notes.json)" in err
    (run / "notes.json").unlink()
    assert cli(capsys, "train", "--out", run, "--overwrite", *sets())[0] == 0
    assert not (run / "mine.json").exists()


def test_compare_overwrite_keeps_train_runs_under_runs(tmp_path, capsys):
    """``lengthgen train`` writes runs/<config name> by default; ``compare --out . --overwrite`` in that folder took
    runs/ for a comparison's and deleted the training run (found by a probe). Only NAME-seedN run folders are a
    comparison's."""
    train(config("train.steps=1"), tmp_path / "runs" / "counting", progress=False)
    before = files(tmp_path / "runs")
    code, err = cli(capsys, "compare", *sets("train.steps=1", "compare.eval_lengths=[8]", "compare.eval_tokens=16",
                                             "compare.seeds=[0]"), "--variants", "baseline", "--out", tmp_path,
                    "--overwrite")
    assert code == 2 and "runs/counting" in err and "lengthgen did not write" in err, err
    assert files(tmp_path / "runs") == before


@pytest.mark.parametrize("args, message", [
    (["compare", "--variants", "l2,baseline,l2"], "variant 'l2' is named twice; name each variant once"),
    (["train", "--wandb", ""], "train.wandb='' is not valid; it must be a W&B project name, or none"),
    (["train", "--set", 'train.wandb=" "'], "train.wandb=' ' is not valid"),
    (["train", "--set", "train.init_from="], "train.init_from='' is not valid; it must be a run folder or checkpoint"),
])
def test_a_repeated_variant_or_an_empty_wandb_project_is_an_error(tmp_path, capsys, args, message):
    """--variants l2,l2 ran l2 once, --wandb "" turned W&B off and train.init_from=$EMPTY trained from fresh
    weights, all silently."""
    code, err = cli(capsys, *args, "--out", tmp_path / "out")
    assert code == 2 and message in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["train", "--steps", "3"], "lengthgen train: error: unrecognized arguments: --steps 3; config keys are set with "
                                "--set KEY=VALUE"),
    (["train", "train.steps=3"], "lengthgen train: error: unrecognized arguments: train.steps=3; config keys are "
                                 "set with --set KEY=VALUE"),
    (["train", "configs/counting.toml"], "lengthgen train: error: unrecognized arguments: configs/counting.toml; a "
                                         "config file is given with --config FILE (-c FILE)"),
    (["eval", "run", "--bogus"], "lengthgen eval: error: unrecognized arguments: --bogus (see lengthgen eval --help)")])
def test_an_unknown_argument_names_its_command(capsys, args, message):
    """Unknown flags were reported by the top parser as `lengthgen: error:`, without the command."""
    code, err = cli(capsys, *args)
    assert code == 2 and err.startswith(message)


HUGE = 2**63 - 1


@pytest.mark.parametrize("override, message", [
    (f"data.length={HUGE}", f"data.length={HUGE} is not valid; it must be an integer in [1, 2147483647]"),
    (f"train.batch_size={HUGE}", "train.batch_size"), (f"train.eval_lengths=[{HUGE}]", "train.eval_lengths[0]"),
    (f"model.vocab_size={HUGE}", "model.vocab_size"), (f"train.stages=[[0, {HUGE}]]", "train.stages[0][1]"),
    ("train.threads=100000", "train.threads=100000 is not valid; it must be an integer in [0, 1024]")])
def test_huge_sizes_are_config_errors(tmp_path, capsys, override, message):
    """A size beyond int32 overflowed torch's size arithmetic (a traceback); 100000 threads was a segfault."""
    code, err = cli(capsys, "train", *sets(override), "--out", tmp_path / "r")
    assert code == 2 and message in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("args", [["--lengths", str(10**20)], ["--tokens", str(HUGE)]])
def test_huge_eval_arguments_are_errors(capsys, stopped, args):
    code, err = cli(capsys, "eval", stopped[0], *args)
    assert code == 2 and f"argument {args[0]}" in err and "up to 2147483647" in err


@pytest.mark.parametrize("command", ["eval", "needle"])
def test_default_lengths_stop_at_the_datas_maximum_length(tmp_path, capsys, command):
    """Without --lengths, eval and needle take 1..16 x the training length up to the data's maximum length (mqar
    with 16 tokens: 35, so 8, 16, 32); the default 16x failed on every mqar run. An explicit length beyond it is
    one line naming the limit."""
    run = tmp_path / "run"
    train(config("data.task=mqar", "data.task_kwargs={vocab_size = 16}"), run, progress=False)
    small = ["--samples" if command == "needle" else "--tokens", "8"]
    out = tmp_path / "eval.json" if command == "eval" else tmp_path / "map"
    assert cli(capsys, command, run, *small, "--out", out)[0] == 0
    lengths = [r.length for r in RunEval.load(out).lengths] if command == "eval" else \
        NeedleMap.load(out / "needle.json").lengths
    assert lengths == [8, 16, 32]
    code, err = cli(capsys, command, run, "--lengths", "8,64", *small)
    assert code == 2 and err.endswith("error: lengths: length 64 exceeds the data's maximum length 35")


def test_eval_and_needle_run_under_the_runs_threads(tmp_path, capsys, monkeypatch):
    """train.threads set training's and compare's CPU threads but not eval's or needle's (torch's default there)."""
    import lengthgen.experiments.eval_run as eval_module
    import lengthgen.experiments.needle as needle_module

    run = tmp_path / "run"
    train(config("data.task=mqar", "data.task_kwargs={vocab_size = 16}", "train.threads=1"), run, progress=False)
    seen = []
    for module, name in ((eval_module, "evaluate"), (needle_module, "needle_map")):
        def spy(*args, original=getattr(module, name), **kwargs):
            seen.append(torch.get_num_threads())
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert cli(capsys, "eval", run, "--lengths", "8", "--tokens", "8")[0] == 0
        assert cli(capsys, "needle", run, "--lengths", "8", "--samples", "2", "--out", tmp_path / "map",
                   "--no-progress")[0] == 0
        assert seen == [1, 1] and torch.get_num_threads() == 3      # the caller's threads again after
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("command", [["train"], ["compare"], ["theory"], ["eval", "run"], ["bench", "attention"]])
def test_an_empty_out_is_an_error(capsys, command):
    """--out '' meant runs/run for train, the current folder for compare and a traceback for theory."""
    code, err = cli(capsys, *command, "--out", "")
    assert code == 2 and "argument --out: '' is empty; give a path" in err


@pytest.mark.parametrize("command, flag", [(["compare", *sets()], "--config"), (["compare", *sets()], "--variants"),
                                           (["compare", *sets()], "--bases"), (["train", *sets()], "--config"),
                                           (["eval", "--hf", "model"], "--corpus"),
                                           (["eval", "--hf", "model"], "--tokenizer")])
def test_an_empty_option_is_an_error_not_its_default(tmp_path, capsys, command, flag):
    """Found by a probe: compare --config "$EMPTY" ran the embedded default experiment, --variants '' its five
    default variants and --bases '' every base; eval --hf --corpus '' read the stdlib corpus, all silently."""
    code, err = cli(capsys, *command, flag, "", "--out", tmp_path / "out.json")
    assert code == 2 and f"argument {flag}: '' is empty; give " in err and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("key", ["max_documents", "max_tokens"])
def test_text_limits_below_one_are_config_errors(tmp_path, capsys, key):
    """data.text.max_documents=-1 was taken, then failed as a corpus without documents."""
    code, err = cli(capsys, "train", *text_sets("data.kind=text", "data.task_kwargs={}", f"data.text.{key}=-1"),
                    "--out", tmp_path / "r")
    assert code == 2 and f"data.text.{key}=-1 is not valid; it must be an integer >= 1, or none" in err


def test_a_checkpoint_whose_bytes_changed_falls_back_to_the_older_one(tmp_path, stopped):
    """A flipped byte in the weights still loads (safetensors checks the header only): the digest catches it."""
    run = copy(stopped[0], tmp_path)
    weights = run / "checkpoints" / "step_00000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01                                                   # a tensor byte, not the header
    weights.write_bytes(bytes(data))
    with pytest.warns(RunFolderWarning, match=r"model.safetensors is unreadable \(its bytes changed since it was "
                                              r"written.*kept aside as step_00000003.corrupt"):
        result = resume(run)
    assert result.history == stopped[1]                                # exact, from step 2


def test_a_folder_of_another_kind_is_named_as_such_not_offered_resume(tmp_path, capsys, stopped):
    """compare --out on a training run: --resume and --overwrite would both be refused, so neither is offered."""
    run = copy(stopped[0], tmp_path)
    code, err = cli(capsys, "compare", "--variants", "baseline", *sets(), "--out", run)
    assert code == 2 and "holds a training run" in err and "not a comparison" in err and "pass --resume" not in err


@pytest.mark.parametrize("command, flag, key", [("compare", ["--steps", "5"], "train.steps=7"),
                                                ("compare", ["--seeds", "2"], "compare.seeds=[0]"),
                                                ("train", ["--log-every", "5"], "train.log_every=7")])
def test_a_key_set_by_its_flag_and_by_set_is_refused(tmp_path, capsys, command, flag, key):
    """Before, the flag silently won."""
    code, err = cli(capsys, command, *sets(), "--set", key, *flag, "--out", tmp_path / "o")
    assert code == 2 and f" and {flag[0]} both set {key.split('=')[0]}; give one of them" in err
    assert not (tmp_path / "o").exists()


def test_a_weights_shape_mismatch_names_the_tensor_and_shapes(tmp_path):
    """The message kept only torch's first line, "Error(s) in loading state_dict for GPT:", and lost which tensor."""
    from lengthgen.model import GPTConfig
    from lengthgen.train import checkpoint as ckpt_io

    small = GPT(GPTConfig(vocab_size=10, dim=16, layers=1, heads=2))
    path = ckpt_io.save_checkpoint(tmp_path, 1, small, [], {"config": {}, "history": [0.0], "rng": ckpt_io.rng_state()})
    with pytest.raises(ckpt_io.CheckpointError, match=r"size mismatch for embed.weight: copying a param with shape "
                                                      r"torch.Size\(\[10, 16\]\)") as info:
        ckpt_io.load_weights(GPT(GPTConfig(vocab_size=12, dim=16, layers=1, heads=2)), path)
    assert "\n" not in str(info.value)


def test_theory_writes_only_into_a_folder_it_holds(tmp_path, capsys):
    """theory wrote into any folder, a run that was training included; its files counted as foreign after."""
    from lengthgen.train.run_folder import check_fresh, lock

    held = lock(tmp_path / "busy")
    try:
        code, err = cli(capsys, "theory", "--out", tmp_path / "busy")
        assert code == 2 and "is in use by another lengthgen process" in err
    finally:
        held.release()
    (tmp_path / "file").write_text("x")
    code, err = cli(capsys, "theory", "--out", tmp_path / "file")
    assert code == 2 and "is a file; give a folder" in err
    theory = tmp_path / "theory"
    (theory).mkdir()
    for name in ("theory.json", "theory.png"):
        (theory / name).write_text("{}")
    check_fresh(theory, overwrite=True)              # lengthgen's own files: --overwrite may delete them
    assert not any(theory.iterdir()) or [p.name for p in theory.iterdir()] == [".lengthgen.lock"]


def test_theory_and_report_keep_out_of_each_others_folders(tmp_path, capsys, stopped, two_compares):
    """theory --out a comparison (or a run) wrote theory.png there, and report of the comparison then listed it
    as its own plot; report --out a theory folder did the same."""
    merged = tmp_path / "merged"
    assert cli(capsys, "report", *two_compares[:2], "--out", merged)[0] == 0
    for folder, held in ((two_compares[0], "runs, results.json"), (stopped[0], "checkpoints, config.json"),
                         (merged, "results.json")):
        before = files(folder)
        code, err = cli(capsys, "theory", "--out", folder)
        assert code == 2 and err.endswith(f"--out {folder} holds another experiment ({held}); give theory a folder "
                                          "of its own")
        assert files(folder) == before
    theory = tmp_path / "theory"
    theory.mkdir()
    (theory / "theory.json").write_text("{}")
    code, err = cli(capsys, "report", two_compares[0], "--out", theory)
    assert code == 2 and "holds lengthgen theory's output (theory.json), whose theory.png the report" in err
    assert [p.name for p in theory.iterdir()] == ["theory.json"]


def test_eval_and_report_on_the_wrong_kind_of_folder_say_what_it_is(tmp_path, capsys, stopped):
    """eval of a comparison said only "no checkpoint"; report of a training run only "no results file"."""
    comparison = tmp_path / "cmp"
    (comparison / "runs").mkdir(parents=True)
    code, err = cli(capsys, "eval", comparison)
    assert code == 2 and f"it holds a comparison, whose runs are in {comparison / 'runs'}" in err
    code, err = cli(capsys, "report", stopped[0])
    assert code == 2 and f"{stopped[0]} is a training run, which has no results.json" in err
    assert f"lengthgen eval {stopped[0]}" in err


def test_report_of_an_interrupted_compare_says_how_to_finish_it(tmp_path, capsys):
    """report of a compare folder stopped before its results.json said only 'no results file at ...'."""
    (tmp_path / "cmp" / "runs" / "baseline-seed0").mkdir(parents=True)
    code, err = cli(capsys, "report", tmp_path / "cmp")
    assert code == 2 and f"{tmp_path / 'cmp'} holds a comparison that did not finish" in err
    assert f"--resume --out {tmp_path / 'cmp'}" in err
    code, err = cli(capsys, "report", tmp_path / "cmp" / "results.json")
    assert code == 2 and f"{tmp_path / 'cmp'} holds a comparison that did not finish" in err
    (tmp_path / "rf" / "finetune").mkdir(parents=True)
    code, err = cli(capsys, "report", tmp_path / "rf")
    assert code == 2 and "holds a retrofit that did not finish" in err and "--overwrite" in err


def test_report_of_a_missing_file_does_not_blame_its_folder(tmp_path, capsys):
    """report of a missing results file (a typo, or a name without runs/ in a clone whose runs/ folder made '.' look
    like a comparison) said that its folder held a comparison that did not finish."""
    (tmp_path / "runs" / "cmp" / "runs" / "baseline-seed0").mkdir(parents=True)    # tmp_path: a clone's root
    for missing in (tmp_path / "runs" / "cmp" / "results.jsn", tmp_path / "demo"):
        code, err = cli(capsys, "report", missing)
        assert code == 2 and f"no results file at {missing}" in err and "did not finish" not in err


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "environment variable WORLD_SIZE='two' is not an integer; torchrun sets it"),
    ({"WORLD_SIZE": "2", "RANK": ""}, "environment variable RANK='' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 asks for 2 processes, but MASTER_ADDR and MASTER_PORT are not "
                                       "set: launch with torchrun (it sets them), or unset WORLD_SIZE")])
def test_a_torchrun_environment_set_by_hand_is_one_line(tmp_path, capsys, monkeypatch, env, message):
    """WORLD_SIZE left in the shell (or not an integer) ended in a traceback: int()'s ValueError, or torch's
    rendezvous asking for MASTER_ADDR."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = cli(capsys, "train", *sets(), "--out", tmp_path / "run")
    assert code == 2 and message in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["compare", "--steps", "2"], ["retrofit", "RUN", "--steps", "2"], ["eval", "RUN"],
                                     ["config", "list"]])
def test_commands_but_train_are_refused_under_torchrun(tmp_path, capsys, monkeypatch, command):
    """Under torchrun every rank ran the whole command: eval printed its results once per rank, compare and
    retrofit had the ranks race for the --out folder's lock (one rank refused, the run failed half-written)."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    out = [] if command[0] in ("eval", "config") else ["--out", tmp_path / "out"]
    code, err = cli(capsys, *[tmp_path / "run" if a == "RUN" else a for a in command], *out)
    assert code == 2 and err.strip() == (f"lengthgen {command[0]}: error: {command[0]} runs in one process, not under "
                                         "torchrun (WORLD_SIZE=2): only train trains across processes; run it "
                                         "without torchrun (WORLD_SIZE unset)")
    assert not (tmp_path / "out").exists()


def test_a_rank_that_lost_another_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Under torchrun, when one rank crashed or was killed, the others failed in their next collective with gloo's
    error and a 30-line traceback, and torchrun often named one of them, not the rank that failed, as the first
    failure. They now print one line and wait for torchrun to stop them (`distributed.linger`)."""
    import lengthgen.train
    from lengthgen.train import distributed

    def lost(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:3979. This is typically caused by a remote worker crashing. Check the "
                           "logs of the remote worker before reporting an error.")

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(lengthgen.train, "train", lost)
    monkeypatch.setattr(distributed, "_linger", False)
    code, err = cli(capsys, "train", *sets(), "--out", tmp_path / "run")
    assert code == 1 and err.strip() == ("lengthgen train: error: another rank stopped (Connection closed by peer "
                                         "[127.0.0.1]:3979); it prints its own error, and torchrun names it")
    assert distributed._linger


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_ctrl_c_under_torchrun_is_printed_by_local_rank_0(tmp_path, capsys, monkeypatch, local_rank):
    """Ctrl-C under torchrun (which hands its SIGINT to every rank) printed 'interrupted' once per rank once the
    process group was joined; local rank 0 prints it, the others exit with the same status at once."""
    import torch.distributed as dist

    import lengthgen.train
    from lengthgen.train import distributed

    def interrupted(*args, **kwargs):       # in training: the process group joined (here a gloo group of one)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        raise KeyboardInterrupt

    for name, value in {"WORLD_SIZE": "2", "RANK": local_rank, "LOCAL_RANK": local_rank}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(lengthgen.train, "train", interrupted)
    monkeypatch.setattr(distributed, "_linger", False)
    code = main(["train", *sets(), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.splitlines()
    assert code == 130 and not dist.is_initialized() and not distributed._linger
    assert err == (["lengthgen train: interrupted"] if local_rank == "0" else [])


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_bad_argument_under_torchrun_is_printed_by_local_rank_0(tmp_path, capsys, monkeypatch, local_rank):
    """argparse's errors were printed by every rank under torchrun (one line per process, where a bad --set key
    was one line); local rank 0 prints them, the others wait for torchrun to stop them (`distributed.linger`)."""
    from lengthgen.train import distributed

    for name, value in {"WORLD_SIZE": "2", "RANK": local_rank, "LOCAL_RANK": local_rank}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "_linger", False)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--bogus", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("lengthgen train: error: unrecognized arguments: --bogus") == \
        (local_rank == "0") and distributed._linger == (local_rank == "1")


def test_the_command_flushes_denormals_before_torch_starts_its_threads():
    """ALiBi's far keys give exp(s - max) below 1.2e-38, float32 denormals, which Intel CPUs compute in slow
    microcode (its training step at 4096 tokens took 3.3x the baseline's): the lengthgen command flushes them, in
    the threads torch starts too (a product over 2^20 elements runs on 2). A library user's process is as it was."""
    probe = ("def probe():\n    import torch\n    from lengthgen.train.setup import denormals_flushed\n"
             "    torch.set_num_threads(2)\n"
             "    print(denormals_flushed(), torch.ones(1 << 20).mul(1e-39).sum().item() == 0.0)\n")
    command = _python_m_lengthgen(probe + "import atexit\natexit.register(probe)", "config", "show", "counting")
    plain = subprocess.run([sys.executable, "-c", probe + "probe()"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert plain.stdout == "False False\n", plain.stderr
    assert command.returncode == 0 and command.stdout.splitlines()[-1] == "True True", command.stderr
