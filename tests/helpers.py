"""Test helpers shared by test files (imported as ``from helpers import ...``: pytest puts tests/ on the path,
and so does running a test file as a script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

#: a tiny counting run for the multi-process tests (DDP, FSDP2): 5 steps of a batch of 8 that 2 ranks split
DISTRIBUTED_RUN = [
    "model.dim=32", "model.layers=2", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=5", "train.lr=1e-2",
    "train.batch_size=8", "train.eval_batches=1", "train.eval_batch_size=4", "train.eval_every=0",
    "train.checkpoint_every=0", "train.threads=1", "data.task=counting", "data.task_kwargs={vocab_size = 4}",
    "data.length=16", "train.eval_lengths=[16, 32]", "train.log_every=1"]

#: what the library rightly warns of in a test's deliberately tiny comparison (a few steps under the default warmup,
#: 2 seeds), kept out of the suite's warnings summary; the tests of those warnings catch them themselves
TINY_RUN_WARNINGS = pytest.mark.filterwarnings(
    "ignore:train.warmup_steps=.* > train.steps=:lengthgen.config.ConfigWarning",
    "ignore:compare.seeds. no variant can be named best:lengthgen.config.ConfigWarning")


def torchrun_two(script: str | Path, out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script OUT ARGS...`` under ``torchrun --standalone --nproc_per_node=2`` (one thread per rank, no
    distributed variables inherited from this process); asserts that it succeeded (``check``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(out), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def logged_losses(run: Path) -> list[float]:
    """The training losses a run folder's ``metrics.jsonl`` logged, in order."""
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def make_docs(b: int, length: int, seed: int = 0, max_len: int = 9) -> torch.Tensor:
    """(b, length) increasing document ids in runs of random lengths 1..max_len (several documents per row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < length:
            ids += [doc] * int(torch.randint(1, max_len + 1, (1,), generator=gen))
            doc += 1
        rows.append(ids[:length])
    return torch.tensor(rows)
