"""Multi-process training (DDP, gloo on CPU): 2 ranks on the same global batch give the losses of 1 process.

The test launches this file with ``torchrun --standalone --nproc_per_node=2``; run as a script, it trains two
tiny counting runs under DDP: A through `train` (2 micro-batches per rank: DDP's no_sync path), B through
``lengthgen train`` (with QK-clip active every step; its max logit is all-reduced over ranks, though at this
size the ranks' own maxima are so close that the losses would not tell the difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BASE = ["model.dim=32", "model.layers=2", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=5",
        "train.lr=1e-2", "train.batch_size=8", "train.eval_batches=1", "train.eval_batch_size=4",
        "train.eval_every=0", "train.checkpoint_every=0", "train.threads=1", "data.task=counting",
        "data.task_kwargs={vocab_size = 4}", "data.length=16", "train.eval_lengths=[16, 32]", "train.log_every=1"]
RUN_A = BASE + ["train.grad_accum=2"]
RUN_B = BASE + ["train.qk_clip=0.03"]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_two_processes_match_one(tmp_path):
    from lengthgen.train.config import RunConfig
    from lengthgen.eval import RunEval
    from lengthgen.train import train

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, overrides in (("a", RUN_A), ("b", RUN_B)):
        single = train(RunConfig().override(*overrides), tmp_path / f"single-{name}", progress=False)
        ddp = _losses(tmp_path / f"ddp-{name}")
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
