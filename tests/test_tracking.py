"""What a run tells and records: plain log lines (no progress-bar frames) when stdout is not a terminal, a bar
when it is, TensorBoard events and run.json (versions, commit, device) in every run folder, W&B when asked."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import time
import types

import pytest
import torch

from lengthgen.cli import main
from lengthgen.config import ConfigError
from lengthgen.train import train
from lengthgen.train.config import RunConfig
from lengthgen.train.log import eval_line, step_line
from lengthgen.version import __version__

TINY = ["model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=1.0", "train.steps=7",
        "train.batch_size=4", "train.eval_batches=1", "train.eval_batch_size=2", "train.eval_every=5",
        "train.log_every=3", "data.task=counting", "data.task_kwargs={vocab_size = 4}", "data.length=8",
        "train.eval_lengths=[8, 16]"]


def tiny(*overrides: str) -> RunConfig:
    return RunConfig().override(*TINY, *overrides)


def test_step_and_eval_lines():
    entry = {"step": 100, "loss": 1.2341, "tokens_per_s": 18230.0}
    assert step_line(entry, 400, 3e-3, 41) == "step 100/400  loss 1.234  lr 3.0e-03  18.2k tok/s  eta 0:41"
    assert step_line(entry, 400, 3e-3, 3725).endswith("eta 1:02:05")
    evaluation = {"eval": {"32": {"loss": 0.41, "abs_error": 0.35}, "128": {"loss": 2.3}},
                  "bema_eval": {"32": {"loss": 0.4}}}
    assert eval_line(100, evaluation) == ("eval step 100: length 32 loss 0.41 abs_error 0.35 | length 128 loss 2.3"
                                          " | BEMA length 32 loss 0.4")


def test_run_header_says_how_often_adamw_steps(tmp_path):
    from lengthgen.eval import Provenance
    from lengthgen.train.tracking import run_header

    provenance = Provenance.capture("cpu")

    def optimizer(*overrides: str) -> str:
        header = run_header(tiny("train.lr=0.001", *overrides), tmp_path, parameters=1, dtype="float32", world=1,
                            start=0, provenance=provenance)
        return next(line for line in header.splitlines() if "optimizer:" in line)

    assert "optimizer: adamw lr 0.001, " in optimizer()
    assert "optimizer: adamw lr 0.001 every 2 steps, " in optimizer("train.adam_every=2")
    assert "optimizer: normuon lr 0.02 (adamw lr 0.001 every 2 steps for the rest), " in optimizer(
        "train.optimizer=normuon", "train.adam_every=2")


def test_redirected_run_prints_plain_lines_and_records_tensorboard_and_versions(tmp_path, capsys):
    result = train(tiny(), tmp_path / "run")                  # progress=True, but stdout is not a terminal
    out = capsys.readouterr().out
    assert "\r" not in out
    steps = re.findall(r"^\[run\] step (\d+)/7  loss \S+  lr \S+  \S+ tok/s  eta \d+:\d\d$", out, flags=re.M)
    assert steps == ["1", "3", "6", "7"]                      # the first, every log_every, the last
    assert re.findall(r"^\[run\] eval step (\d+): length 8 loss \S+ .*\| length 16 loss", out, flags=re.M) == ["5", "7"]
    header = out.split("[run] step 1/7")[0]
    for words in ("7 steps x 32 tokens", "parameters", "attention: baseline", "task counting", "device: cpu",
                  f"lengthgen {__version__}", f"torch {torch.__version__}", "every 3 steps"):
        assert words in header, (words, header)

    run = tmp_path / "run"
    info = json.loads((run / "run.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in result.model.parameters())
    [start] = info["starts"]
    assert (start["step"], start["lengthgen"], start["torch"], start["device"]) == (0, __version__, torch.__version__,
                                                                                 "cpu")
    assert start["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", start["git_commit"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(e["step"], e["loss"]) for e in logged if "loss" in e]
    assert [s for s, _ in losses] == [1, 3, 6, 7]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")] == losses
    assert [e.step for e in events.Scalars("eval/16/loss")] == [5, 7]
    assert "config" in " ".join(events.Tags()["tensors"])


def test_resume_adds_a_start_and_logs_each_step_once(tmp_path, capsys):
    cfg = tiny("train.log_every=1", "train.checkpoint_every=4")
    train(cfg, tmp_path / "run", stop_at=6)
    run = tmp_path / "run"
    # as if it had stopped after step 6 with the checkpoint of step 4 as its newest: steps 5, 6 are done again
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    # TensorBoard reads a folder's event files in name order, whose first key is the second a writer started:
    # a resume is never in the same second as its run's start, so neither is this one
    time.sleep(1.1)
    train(cfg, run, resume=True)
    assert "resuming at step 4" in capsys.readouterr().out
    assert [s["step"] for s in json.loads((run / "run.json").read_text())["starts"]] == [0, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    # each step once: the resumed writer purges the first file's steps after 4
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 8))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "loss" in e] == list(range(1, 8))


def test_a_restart_at_step_0_logs_each_step_once(tmp_path):
    """Found by a probe: a run resumed before its first checkpoint (train.checkpoint_every=0, as stdlib_small)
    starts again at step 0, and TensorBoard showed every step twice, the first session's beside the new one's."""
    cfg = tiny("train.log_every=1", "train.checkpoint_every=0")
    run = tmp_path / "run"
    train(cfg, run, stop_at=5)
    shutil.rmtree(run / "checkpoints")              # as if killed at step 5, before any checkpoint
    (run / "latest.json").unlink()
    time.sleep(1.1)                                 # a new event file name (see the test above)
    train(cfg, run, resume=True)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 8))
    assert [e.step for e in events.Scalars("eval/16/loss")] == [5, 7]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_progress_bar_and_no_step_lines(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    train(tiny(), tmp_path / "run")
    out = terminal.getvalue()
    assert "\r" in out and "7/7" in out                       # the bar, redrawn in place
    assert "[run] step" not in out and "[run] eval step 5" in out and "lengthgen " in out


def test_no_progress_prints_plain_lines_on_a_terminal(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    train(tiny(), tmp_path / "run", progress=False)
    assert "\r" not in terminal.getvalue() and "[run] step 7/7" in terminal.getvalue()


def test_log_every_flag_sets_the_interval(tmp_path, capsys):
    args = ["train", "--out", str(tmp_path / "run"), "--log-every", "2"] + \
        [a for o in TINY if not o.startswith("train.log_every=") for a in ("--set", o)]     # the flag sets it
    assert main(args) == 0
    assert re.findall(r"\[run\] step (\d+)/", capsys.readouterr().out) == ["1", "2", "4", "6", "7"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["log_every"] == 2


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.id, self.logged, self.finished = kwargs, kwargs["id"] or "fake0001", [], False

    def log(self, numbers, step):
        self.logged.append((step, numbers))

    def finish(self):
        self.finished = True


def test_wandb_gets_the_config_and_every_logged_number_and_resumes_its_run(tmp_path, monkeypatch):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train(tiny("train.wandb=lengthgen-test"), tmp_path / "run", progress=False, stop_at=4)
    train(tiny("train.wandb=lengthgen-test"), tmp_path / "run", progress=False, resume=True)
    first, second = runs
    assert first.init["project"] == "lengthgen-test" and first.init["name"] == "run"
    assert first.init["config"]["train"]["wandb"] == "lengthgen-test"
    assert first.init["config"]["run"]["starts"][0]["lengthgen"] == __version__
    assert first.init["id"] is None and second.init["id"] == "fake0001"      # the resumed run continues it
    assert [step for step, numbers in first.logged if "loss" in numbers] == [1, 3, 4]
    assert [step for step, numbers in second.logged if "loss" in numbers] == [5, 6, 7]   # a session's first too
    assert ("eval/16/loss" in dict(second.logged)[7]) and first.finished and second.finished
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {e["step"]: e["loss"] for e in logged if "loss" in e}[6] == dict(second.logged)[6]["loss"]


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is a dev extra (pip install -e '.[dev]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tiny("train.wandb=lengthgen-test", "train.steps=2"), tmp_path / "run", progress=False)
    wandb_id = json.loads((tmp_path / "run" / "run.json").read_text())["wandb_id"]
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{wandb_id}"))


def test_missing_wandb_is_a_one_line_install_hint_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)            # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"train.wandb='p' needs the wandb package: pip install wandb"):
        train(tiny("train.wandb=p"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    args = ["train", "--out", str(tmp_path / "run"), "--wandb", "p"] + [a for o in TINY for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install wandb" in err
