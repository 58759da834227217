"""Multi-process training (DDP, gloo on CPU): 2 ranks on the same global batch give the losses of 1 process.

The test launches this file with ``torchrun --standalone --nproc_per_node=2``; run as a script, it trains two
tiny counting runs under DDP: A through `train` (2 micro-batches per rank: DDP's no_sync path), B through
``lengthgen train`` (with QK-clip active every step; its max logit is all-reduced over ranks, though at this
size the ranks' own maxima are so close that the losses would not tell the difference).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import DISTRIBUTED_RUN as BASE
from helpers import logged_losses, torchrun_two

RUN_A = BASE + ["train.grad_accum=2"]
RUN_B = BASE + ["train.qk_clip=0.03"]


def test_two_processes_match_one(tmp_path):
    from lengthgen.train.config import RunConfig
    from lengthgen.eval import RunEval
    from lengthgen.train import train

    proc = torchrun_two(__file__, tmp_path)
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
        assert [r.length for r in RunEval.load(tmp_path / f"ddp-{name}" / "eval.json").lengths] == [16, 32]
    assert "trained 5 steps" in proc.stdout and proc.stdout.count("trained 5 steps") == 1   # rank 0 prints


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


def _worker(out: Path) -> None:
    """Runs under torchrun: run A through the Python API, run B through the CLI (which leaves the group)."""
    from lengthgen.cli import main
    from lengthgen.train.config import RunConfig
    from lengthgen.train import train

    train(RunConfig().override(*RUN_A), out / "ddp-a", progress=False)
    args = ["train"] + [a for o in RUN_B for a in ("--set", o)] + ["--out", str(out / "ddp-b"), "--no-progress"]
    sys.exit(main(args))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
