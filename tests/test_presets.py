"""Every preset in configs/ loads as is, documents itself, and trains 2 steps + evaluates by position on CPU
with tiny overrides (the GPU-sized ones included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lengthgen.train.config import load_config
from lengthgen.eval import RunEval
from lengthgen.train import train

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml"))

TINY = ["model.head_dim=8", "model.heads=2", "model.dim=16", "model.layers=1", "model.mlp_ratio=2.0",
        "train.steps=2", "train.batch_size=2", "train.tokens_per_step=none", "train.grad_accum=1", "train.stages=[]",
        "train.warmup_steps=0", "train.eval_every=0", "train.checkpoint_every=0", "train.eval_batches=1",
        "train.eval_batch_size=2", "train.compile=false", "train.device=cpu", "train.threads=1",
        "data.length=16", "train.eval_lengths=[16, 32]"]


def test_presets_exist():
    names = {p.stem for p in CONFIGS}
    assert {"avnorm_lm", "l2_counting", "postnorm_set_complement", "logit_scaling_lm", "stdlib_small"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_preset_loads_and_trains_tiny_on_cpu(path, tmp_path):
    text = path.read_text()
    assert text.startswith("#") and "lengthgen " in text.split("\nname")[0], \
        f"{path.name} needs a top comment saying what it reproduces and how to run it"
    full = load_config(path)                       # the preset itself is valid
    assert full.name == path.stem
    extra = ["data.text.max_documents=24"] if full.data.kind == "text" else []
    cfg = load_config(path, TINY + extra)
    result = train(cfg, tmp_path / path.stem, progress=False)
    assert result.step == 2 and len(result.history) == 2
    rows = RunEval.load(tmp_path / path.stem / "eval.json").lengths
    assert [r.length for r in rows] == [16, 32]
    assert "loss" in rows[-1].buckets and rows[-1].buckets["loss"][-1].hi == 32
