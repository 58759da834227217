"""Multi-process training (DDP, gloo on CPU): 2 ranks on the same global batch give the losses of 1 process.

The test launches this file with ``torchrun --standalone --nproc_per_node=2``; run as a script, it trains two
tiny counting runs under DDP: A through `train` (2 micro-batches per rank: DDP's no_sync path), B through
``lengthgen train`` (with QK-clip active every step; its max logit is all-reduced over ranks, though at this
size the ranks' own maxima are so close that the losses would not tell the difference). Run A also evaluates every
2 steps: rank 0 alone evaluates, and the other rank gets its results (each rank counts its evaluations). First it
resumes on 2 ranks a batch-norm run stopped in one process, which warns that its trajectory changes. Run E steps AdamW
every other step on summed gradients (train.adam_every=2), stopped at step 3 with one pending and resumed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import DISTRIBUTED_RUN as BASE
from helpers import logged_losses, torchrun_two

RUN_A = BASE + ["train.grad_accum=2", "train.eval_every=2"]
RUN_B = BASE + ["train.qk_clip=0.03"]
#: batch norm: per-rank statistics, so a resume on another number of ranks leaves the trajectory (it warns)
RUN_BN = BASE + ["model.norm=batch"]
#: AdamW every other step (seed 000's DistAdam) on the two steps' summed gradients, stopped at step 3 with a summed
#: gradient pending and resumed: DDP syncs the sum (synced before, plus the step's)
RUN_E = BASE + ["train.grad_accum=2", "train.adam_every=2"]


def test_two_processes_match_one(tmp_path, monkeypatch):
    from lengthgen.train.config import RunConfig
    from lengthgen.eval import RunEval
    from lengthgen.train import train
    from lengthgen.train.weights import load_run
    import torch

    train(RunConfig().override(*RUN_BN), tmp_path / "bn", progress=False, stop_at=3)     # in one process
    proc = torchrun_two(__file__, tmp_path)
    # resumed on 2 ranks: before, the steps from there changed without a word (batch norm over 4 rows, not 8)
    assert proc.stderr.count("the checkpoint was written on 1 rank, this run has 2 ranks: with model.norm='batch' "
                             "(statistics per rank) the steps from here differ") == 1, proc.stderr
    evaluations = _count_evaluations(monkeypatch.setattr)
    for name, overrides in (("a", RUN_A), ("b", RUN_B)):
        single = train(RunConfig().override(*overrides), tmp_path / f"single-{name}", progress=False)
        ddp = logged_losses(tmp_path / f"ddp-{name}")
        records = [json.loads(line) for line in (tmp_path / f"ddp-{name}" / "metrics.jsonl").read_text().splitlines()]
        assert len(ddp) == 5 and all(r["rank_batch_size"] == 4 for r in records if "loss" in r)  # half of 8 each
        if name == "b":
            assert max(r["max_logit"] for r in records if "max_logit" in r) > 0.03   # QK-clip had work to do
        for step, (x, y) in enumerate(zip(ddp, single.history)):
            assert abs(x - y) <= 1e-5 * max(1.0, abs(y)), (name, step, ddp, single.history)
        # rank 0 alone wrote the run folder: one line per step, a checkpoint and the by-position evaluation
        assert (tmp_path / f"ddp-{name}" / "latest.json").is_file()
        evaluation = RunEval.load(tmp_path / f"ddp-{name}" / "eval.json")
        assert [r.length for r in evaluation.lengths] == [16, 32]
        for got, want in zip(evaluation.lengths, single.evaluation.lengths, strict=True):
            assert got.at_length["loss"] == pytest.approx(want.at_length["loss"], rel=1e-4), name
        logged = [r for r in records if "eval" in r]
        assert [r["step"] for r in logged] == ([2, 4, 5] if name == "a" else [5])
        losses = lambda entry: {length: means["loss"] for length, means in entry["eval"].items()}  # noqa: E731
        assert losses(logged[-1]) == pytest.approx(losses(single.metrics), rel=1e-4)
    assert "trained 5 steps" in proc.stdout and proc.stdout.count("trained 5 steps") == 1   # rank 0 prints
    single = train(RunConfig().override(*RUN_E), tmp_path / "single-e", progress=False)
    ddp = logged_losses(tmp_path / "ddp-e")
    assert len(ddp) == 5 and ddp == pytest.approx(single.history, rel=1e-5, abs=1e-5)
    for (key, got), want in zip(load_run(tmp_path / "ddp-e")[1].state_dict().items(),
                                single.model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=key)
    # rank 0 evaluated as often as one process (runs A, B and E: 3 + 1 + 1 times), the other rank never
    counts = [json.loads((tmp_path / f"evaluations-{rank}.json").read_text()) for rank in (0, 1)]
    assert counts == [evaluations(), 0] == [5, 0]


def test_batch_must_split_into_equal_shares(tmp_path, monkeypatch):
    from lengthgen.config import ConfigError
    from lengthgen.train.config import RunConfig
    from lengthgen.train.setup import check_world

    check_world(RunConfig().override(*BASE), 2)
    import pytest

    with pytest.raises(ConfigError, match="does not split into 3 equal shares"):
        check_world(RunConfig().override(*BASE), 3)
    with pytest.raises(ConfigError, match="grad_accum=8"):
        check_world(RunConfig().override(*BASE, "train.grad_accum=8"), 2)


def _count_evaluations(patch=setattr):
    """Count the trainer's calls of `lengthgen.eval.evaluate` from now on (``patch``: pytest's
    ``monkeypatch.setattr`` in the test); returns a function reading the count."""
    import lengthgen.train.trainer as trainer

    calls, evaluate = [], trainer.evaluate
    patch(trainer, "evaluate", lambda *args, **kwargs: calls.append(1) or evaluate(*args, **kwargs))
    return lambda: len(calls)


def _worker(out: Path) -> None:
    """Runs under torchrun: run A through the Python API, run B through the CLI (which leaves the group); each
    rank writes how many evaluations it ran."""
    from lengthgen.cli import main
    from lengthgen.train.config import RunConfig
    from lengthgen.train import train

    train(RunConfig().override(*RUN_BN), out / "bn", progress=False, resume=True)
    evaluations = _count_evaluations()
    train(RunConfig().override(*RUN_A), out / "ddp-a", progress=False)
    args = ["train"] + [a for o in RUN_B for a in ("--set", o)] + ["--out", str(out / "ddp-b"), "--no-progress"]
    train(RunConfig().override(*RUN_E), out / "ddp-e", progress=False, stop_at=3)
    train(RunConfig().override(*RUN_E), out / "ddp-e", progress=False, resume=True)
    code = main(args)
    (out / f"evaluations-{os.environ['RANK']}.json").write_text(json.dumps(evaluations()))
    sys.exit(code)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
