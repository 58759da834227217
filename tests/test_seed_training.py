"""The seeds' training options against hand computations: seed 001's weight decay on every parameter, its fresh
optimizer and warmup at every stage, and its counting MSE; BEMA's update frequency in a run."""

from __future__ import annotations

import json

import pytest
import torch

from lengthgen.data.tasks import CountingTask
from lengthgen.model import GPT
from lengthgen.train import Trainer, build_optimizers, lr_multiplier, train
from lengthgen.train.config import RunConfig


def config(*overrides: str) -> RunConfig:
    base = ["model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=6",
            "train.lr=1e-2", "train.batch_size=4", "train.eval_batches=0", "data.task=counting",
            "data.task_kwargs={vocab_size = 4}", "data.length=8", "train.log_every=1"]
    return RunConfig().override(*base, *overrides)


@pytest.mark.parametrize("on", ["matrices", "all"])
def test_weight_decay_on_all_parameters(on):
    """With a zero gradient AdamW's step is the decoupled decay alone: p <- p (1 - lr wd)."""
    cfg = config("model.vocab_size=4", "model.head=regress", "model.linear_bias=true", "train.weight_decay=0.5",
                 f"train.weight_decay_on={on}")
    model = GPT(cfg.model)
    (opt,) = build_optimizers(model, cfg.train)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    shrink = 1 - 1e-2 * 0.5
    for name, p in model.named_parameters():
        decays = p.ndim >= 2 or on == "all"
        torch.testing.assert_close(p.detach(), before[name] * (shrink if decays else 1.0), msg=name)
    assert before["final_norm.weight"].abs().sum() > 0 and before["head.bias"].abs().sum() == 0


def test_restart_at_stages_rewarms_the_schedule():
    for step in range(12):
        plain = lr_multiplier(step, total=12, schedule="cosine", warmup=2)
        restarted = lr_multiplier(step, total=12, schedule="cosine", warmup=2, restart=6)
        ramp = {6: 0.5}.get(step, 1.0)
        assert restarted == pytest.approx(plain * ramp)
    assert lr_multiplier(6, total=12, schedule="constant", warmup=4, restart=6) == pytest.approx(0.25)


def test_restart_at_stages_recreates_the_optimizers_and_resumes_exactly(tmp_path):
    cfg = config("train.stages=[[0, 8], [3, 16]]", "train.tokens_per_step=64", "train.restart_at_stages=true",
                 "train.schedule=constant", "train.warmup_steps=2", "train.optimizer=muon")
    assert [cfg.stage_start(s) for s in range(6)] == [0, 0, 0, 3, 3, 3]
    trainer = Trainer(cfg, tmp_path / "full", progress=False)
    first = list(trainer.optimizers)
    full = trainer.fit()
    entries = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [e["lr_mult"] for e in entries if "loss" in e] == [0.5, 1.0, 1.0, 0.5, 1.0, 1.0]
    muon, adamw = trainer.optimizers
    assert muon is not first[0] and adamw is not first[1]
    assert {int(state["step"]) for state in adamw.state.values()} == {3}   # the fresh AdamW took 3 steps, not 6
    # a run stopped at the stage boundary and resumed matches the uninterrupted one
    train(cfg, tmp_path / "resumed", progress=False, stop_at=3)
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.history == full.history
    without = train(cfg.override("train.restart_at_stages=false"), tmp_path / "without", progress=False)
    assert without.history[:3] == full.history[:3] and without.history[3:] != full.history[3:]


def test_bema_update_every_in_a_run(tmp_path):
    cfg = config("train.bema.enabled=true", "train.bema.update_every=4", "train.schedule=constant")
    result = train(cfg, tmp_path / "run", progress=False)
    bema = result.trainer.bema
    assert bema.step == 6 and bema.update_every == 4
    # the BEMA weights are those of step 4's update: alpha (theta_4 - theta_0) + ema, unchanged by steps 5, 6
    live = {name: p.detach().clone() for name, p in result.model.named_parameters()}
    assert any(not torch.equal(bema.weights()[name], live[name]) for name in live)
    reloaded = train(cfg.override("train.steps=4"), tmp_path / "four", progress=False).trainer.bema
    for name, value in reloaded.weights().items():
        torch.testing.assert_close(bema.weights()[name], value, rtol=0, atol=0)


def test_counting_reports_squared_error_whose_prefix_means_are_the_seeds_mse():
    task = CountingTask(vocab_size=4)
    batch = task.sample(3, 10, torch.Generator().manual_seed(0))
    output = batch.targets + torch.linspace(-2, 2, 10)
    metrics = task.metrics(output, batch)
    torch.testing.assert_close(metrics["sq_error"], (output - batch.targets) ** 2)
    torch.testing.assert_close(metrics["abs_error"], (output - batch.targets).abs())
