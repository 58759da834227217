"""The seeds' training options against hand computations: seed 001's weight decay on every parameter, its fresh
optimizer and warmup at every stage, and its counting MSE; BEMA's update frequency in a run."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch

from lengthgen.config import ConfigError
from lengthgen.data.tasks import CountingTask
from lengthgen.model import GPT
from lengthgen.train import Trainer, build_optimizers, lr_multiplier, train
from lengthgen.train.run_folder import RunFolderWarning
from lengthgen.train.config import RunConfig, load_config
from lengthgen.train.palm_adamw import PaLMAdamW
from lengthgen.train.schedule import momentum_at


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


# ---------------------------------------------------------------------------------------------------
# seed 000's optimizers: NorMuon and cautious weight decay (its train_gpt.py, written out here step by step)


def reference_normuon(params, grads, *, lr, lr_mul, wd, momentum=0.95, beta2=0.95):
    """The seed's NorMuon step on each matrix, one at a time (float32): Nesterov momentum, Newton-Schulz, the
    per-neuron variance reduction computed as the seed computes it, then cautious decay and the update."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    states = [(torch.zeros_like(p), None) for p in params]
    for grad_list in grads:
        for i, (p, g) in enumerate(zip(params, grad_list)):
            buf, second = states[i]
            buf.lerp_(g, 1 - momentum)
            v = _zeropower_via_newtonschulz(g.lerp(buf, momentum), (3.4445, -4.775, 2.0315), 5, 1e-7).float()
            red_dim = -1 if p.shape[-2] >= p.shape[-1] else -2
            v_mean = v.square().mean(dim=red_dim, keepdim=True)
            v_norm = (v_mean.sum() * v.size(red_dim)).sqrt()
            second = v_mean * (1 - beta2) if second is None else second.lerp(v_mean, 1 - beta2)
            step_size = second.clamp_min(1e-10).rsqrt()
            v_norm_new = ((v_mean * v.size(red_dim)) * step_size.square()).sum().sqrt()
            v = v * step_size * (v_norm / v_norm_new.clamp_min(1e-10))
            eff_lr = max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5 * lr_mul * lr
            mask = (v * p) >= 0
            p.copy_(p - p * mask * (wd * lr) * eff_lr - v * eff_lr)
            states[i] = (buf, second)
    return params


def test_normuon_with_cautious_decay_matches_the_seeds_step():
    from lengthgen.train.normuon import NorMuon
    torch.manual_seed(0)
    shapes = [(12, 4), (4, 12), (6, 6)]            # per-row statistics, per-column, square (per row)
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    expected = reference_normuon([p.clone() for p in start], grads, lr=0.05, lr_mul=2.0, wd=1.2)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = NorMuon([{"params": params, "lr": 0.05 * 2.0, "lr_mul": 2.0}], weight_decay=1.2, cautious=True)
    for grad_list in grads:
        for p, g in zip(params, grad_list):
            p.grad = g.clone()
        opt.step()
    for p, want, before in zip(params, expected, start):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(p.detach(), before)
    # the decay did something, and only where the update had the weight's sign
    plain = NorMuon([{"params": [torch.nn.Parameter(start[0].clone())], "lr": 0.1, "lr_mul": 2.0}])
    plain.param_groups[0]["params"][0].grad = grads[0][0].clone()
    plain.step()
    params[0].data.copy_(start[0])
    opt = NorMuon([{"params": [params[0]], "lr": 0.1, "lr_mul": 2.0}], weight_decay=1.2, cautious=True)
    params[0].grad = grads[0][0].clone()
    opt.step()
    decayed = plain.param_groups[0]["params"][0].detach() - params[0].detach()
    assert (decayed != 0).any() and (decayed == 0).any()
    torch.testing.assert_close(decayed, start[0] * (decayed != 0) * 1.2 * 0.05 * 0.1 * 3 ** 0.5, rtol=1e-4,
                               atol=1e-7)


def test_normuon_update_has_the_orthogonalized_norm_and_equal_row_scale():
    """NorMuon's normalization keeps the update's Frobenius norm; with beta2 = 0 every row has the same RMS."""
    from lengthgen.train.normuon import normalize_per_neuron
    torch.manual_seed(1)
    update = torch.randn(8, 3) * torch.linspace(0.1, 3, 8)[:, None]
    out = normalize_per_neuron(update.clone(), torch.zeros(8, 1), beta2=0.0)
    torch.testing.assert_close(out.norm(), update.norm())
    rms = out.square().mean(dim=1)
    torch.testing.assert_close(rms, rms.mean().expand(8))
    wide = normalize_per_neuron(update.T.clone(), torch.zeros(1, 8), beta2=0.0)
    torch.testing.assert_close(wide, out.T)


def test_cautious_adamw_matches_the_seeds_distadam_decay():
    """Seed 000's DistAdam: update += wd lr^2 p [update p > 0] before p -= update (Adam in float64)."""
    from lengthgen.train.normuon import CautiousAdamW
    torch.manual_seed(2)
    start, lr, wd, (b1, b2), eps = torch.randn(5, 4, dtype=torch.float64), 0.3, 0.5, (0.8, 0.95), 1e-10
    grads = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        update = lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps)
        p = p - update - wd * lr ** 2 * p * (update * p > 0)
    param = torch.nn.Parameter(start.clone())
    opt = CautiousAdamW([{"params": [param], "weight_decay": 0.0, "cautious_decay": wd}], lr=lr, betas=(b1, b2),
                        eps=eps)
    plain = torch.nn.Parameter(start.clone())
    plain_opt = torch.optim.AdamW([plain], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    for g in grads:
        param.grad, plain.grad = g.clone(), g.clone()
        opt.step()
        plain_opt.step()
    torch.testing.assert_close(param.detach(), p, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(param.detach(), plain.detach())


def test_weight_decay_mul_and_cautious_groups():
    cfg = config("model.vocab_size=8", "train.optimizer=normuon", "train.weight_decay=0.01",
                 "train.weight_decay_on=all", "train.muon_weight_decay=1.2", "train.cautious_weight_decay=true",
                 "train.weight_decay_mul={\"*\" = 0.0, \"embed.weight\" = 150.0, \"head.weight\" = 150.0}")
    model = GPT(cfg.model.replace(head="lm", tie_embeddings=False))
    normuon, adamw = build_optimizers(model, cfg.train)
    assert type(normuon).__name__ == "NorMuon" and normuon.param_groups[0]["cautious"]
    assert normuon.param_groups[0]["weight_decay"] == 1.2 and normuon.param_groups[0]["beta2"] == 0.95
    group_of = {name: g for g in adamw.param_groups for p in g["params"] for name, q in model.named_parameters()
                if q is p}
    assert type(adamw).__name__ == "CautiousAdamW"
    assert group_of["embed.weight"]["cautious_decay"] == pytest.approx(1.5)
    assert {name for name, g in group_of.items() if g["cautious_decay"]} == {"embed.weight", "head.weight"}
    assert "final_norm.weight" in group_of
    assert all(g["weight_decay"] == 0 for g in adamw.param_groups)
    plain = build_optimizers(model, cfg.override("train.cautious_weight_decay=false").train)[1]
    assert type(plain) is torch.optim.AdamW
    assert sorted(g["weight_decay"] for g in plain.param_groups) == pytest.approx([0.0, 1.5])


def test_cautious_decay_needs_normuon_or_adamw():
    with pytest.raises(ConfigError, match=r"train.cautious_weight_decay=True is not valid; it must be false with "
                                          r"optimizer muon .*set train.optimizer to normuon or adamw"):
        config("train.optimizer=muon", "train.cautious_weight_decay=true")


def test_normuon_cautious_run_resumes_exactly(tmp_path):
    cfg = config("train.optimizer=normuon", "train.cautious_weight_decay=true", "train.weight_decay=0.1",
                 "train.muon_weight_decay=1.0", "train.schedule=wsd", "train.cooldown_frac=0.5")
    full = train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "resumed", progress=False, stop_at=3)
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.history == full.history
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    muon = full.trainer.optimizers[0]
    assert all("second_moment" in muon.state[p] for g in muon.param_groups for p in g["params"])


def heavyball_palm_step(p: list[float], g: list[float], m: list[float], v: list[float], t: int, lr: float,
                        decay: float, eps: float, beta1: float = 0.9) -> None:
    """Update ``t`` (from 1) of seed 001's heavyball AdamW(palm=True), restated entry by entry in Python floats:
    heavyball's beta_debias(beta, t) = 1 - (1 - beta) / (1 - beta^t) on beta1 and on PaLM's beta2 = 1 - t^-0.8, the
    moments as lerps towards g and g^2, sqrt(v) floored at eps, then p (1 - lr wd) - lr m / denominator."""
    b1 = 1 - (1 - beta1) / (1 - beta1 ** t)
    palm = 1 - t ** -0.8
    b2 = 1 - (1 - palm) / (1 - palm ** t)
    for i, gi in enumerate(g):
        m[i] += (gi - m[i]) * (1 - b1)
        v[i] += (gi * gi - v[i]) * (1 - b2)
        p[i] = p[i] * (1 - lr * decay) - lr * m[i] / max(math.sqrt(v[i]), eps)


def test_palm_adamw_is_seed_001s_heavyball_adamw():
    """PaLMAdamW (float64) against the entry-by-entry restatement over 12 updates with a changing lr, and a
    first step of -lr sign(g) (Adam's), 0 where g = 0 (eps is a floor: no division by zero)."""
    torch.manual_seed(0)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    opt = PaLMAdamW([weight], lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.3)
    p, m, v = weight.detach().flatten().tolist(), [0.0] * 12, [0.0] * 12
    for t in range(1, 13):
        grad = torch.randn(3, 4, dtype=torch.float64) * t
        grad[0, 0] = 0.0 if t == 1 else grad[0, 0]
        lr = 0.1 * min(1.0, t / 5)
        opt.param_groups[0]["lr"] = lr
        before = weight.detach().clone()
        weight.grad = grad
        opt.step()
        heavyball_palm_step(p, grad.flatten().tolist(), m, v, t, lr, 0.3, 1e-8)
        torch.testing.assert_close(weight.detach().flatten(), torch.tensor(p, dtype=torch.float64), rtol=1e-12,
                                   atol=1e-12)
        if t == 1:
            step = before * (1 - lr * 0.3) - weight.detach()
            assert step[0, 0] == 0 and torch.allclose(step.flatten()[1:], lr * grad.sign().flatten()[1:])
    assert int(opt.state[weight]["step"]) == 12


def test_palm_adamw_second_step_by_hand():
    """g = 1 then 0, no decay: beta1's debias at t = 2 is 1 - 0.1 / 0.19 = 9 / 19 (m = 9/19); PaLM's beta2 at t = 2
    is 1 - 2^-0.8 = 0.425651, debiased 1 - 0.574349 / (1 - 0.425651^2) = 0.298566 (v = 0.298566); the update is
    lr m / sqrt(v) = 0.8668995 lr (torch's AdamW with beta2 0.99 would move 0.9 / 1.9 / sqrt(0.99 / 1.99) lr)."""
    weight = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = PaLMAdamW([weight], lr=1e-3)
    for g in (1.0, 0.0):
        weight.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    assert weight.item() == pytest.approx(-1e-3 - 0.8668995e-3, rel=1e-7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "lr must be a finite number >= 0, got -1.0"),
    (dict(lr=math.nan), "lr must be a finite number >= 0, got nan"),
    (dict(eps=0.0), "eps must be a finite number > 0 (the floor of sqrt(v)"),
    (dict(eps=-1e-8), "eps must be a finite number > 0"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0, got -0.1"),
    (dict(betas=0.9), "betas must be a pair (beta1, beta2), got 0.9"),
    (dict(betas=(0.9,)), "betas must be a pair (beta1, beta2), got (0.9,)"),
    (dict(betas=(1.0, 0.9)), "beta1 must be in [0, 1), got 1.0"),
    (dict(beta2_power=math.inf), "beta2_power must be a finite number > 0, got inf"),
    (dict(beta2_power=0), "beta2_power must be a finite number > 0, got 0"),
])
def test_palm_adamw_refuses_bad_arguments_naming_them(kwargs, message):
    """Each bad argument is a ValueError naming it (before: a negative lr, eps or decay, an infinite beta2_power
    were taken, to NaN or to a ZeroDivisionError at the first step; betas=0.9 was a TypeError); a parameter
    group's own values are checked as the defaults are."""
    weight = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape(f"PaLMAdamW {message}")):
        PaLMAdamW([weight], **kwargs)
    with pytest.raises(ValueError, match=re.escape(f"PaLMAdamW {message}")):
        PaLMAdamW([{"params": [weight], **kwargs}])
    assert PaLMAdamW([weight], betas=(0.0, 0.5), eps=1e-30).param_groups[0]["betas"] == (0.0, 0.5)


def test_adamw_palm_refuses_eps_0():
    """adamw_palm's eps is the floor of sqrt(v): with 0 an entry whose gradients were all 0 (an unseen token's
    embedding row) is moved by 0 / 0, NaN at the first step; the config refuses it, naming the key."""
    with pytest.raises(ConfigError, match=r"^train.eps=0.0 is not valid; it must be > 0 with optimizer adamw_palm "
                                          r"\(the floor of sqrt\(v\)"):
        config("train.optimizer=adamw_palm", "train.eps=0")
    assert config("train.optimizer=adamw", "train.eps=0").train.eps == 0        # torch's AdamW: as before


def test_adamw_palm_is_built_for_every_parameter_and_resumes_exactly(tmp_path):
    cfg = config("train.optimizer=adamw_palm", "train.weight_decay=0.1", "train.weight_decay_on=all",
                 "train.stages=[[0, 8], [3, 16]]", "train.tokens_per_step=64", "train.restart_at_stages=true",
                 "train.schedule=constant", "train.warmup_steps=2")
    model = GPT(cfg.override("model.vocab_size=4").model)
    (opt,) = build_optimizers(model, cfg.train)
    assert type(opt) is PaLMAdamW and [g["weight_decay"] for g in opt.param_groups] == [0.1]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    full = train(cfg, tmp_path / "full", progress=False)
    assert {int(state["step"]) for state in full.trainer.optimizers[0].state.values()} == {3}   # fresh at stage 2
    train(cfg, tmp_path / "resumed", progress=False, stop_at=4)
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.history == full.history
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match=r"train.cautious_weight_decay=True is not valid; it must be false with "
                                          r"optimizer adamw_palm"):
        config("train.optimizer=adamw_palm", "train.cautious_weight_decay=true")


def test_seed001_preset_warms_up_as_heavyball_at_every_stage():
    """heavyball's warmup multiplies lr by t / max(t, warmup + 1), t counting the re-created optimizer's updates
    from 1 (warmup 1024 = 8192 / 8, the seed's): the preset's schedule gives the same multiplier at every step."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "seed001_counting.toml")
    tc = cfg.train
    assert tc.optimizer == "adamw_palm" and tc.restart_at_stages and tc.schedule == "constant"
    for step in [0, 1, 1023, 1024, 1025, 8192, 8193, 8194, 9216, 9217, 9218, 49153, 50177, tc.steps - 1]:
        start = 0 if step <= 8192 else 8192 * ((step - 1) // 8192) + 1     # the seed grows after update 8192 k
        t = step - start + 1
        got = lr_multiplier(step, total=tc.steps, schedule=tc.schedule, warmup=tc.warmup_steps,
                            restart=cfg.stage_start(step))
        assert got == pytest.approx(t / max(t, 1024 + 1), rel=1e-12), step


def seed_muon_momentum(step: int, steps: int, warmup: int = 300, cooldown: int = 50, low: float = 0.85,
                       high: float = 0.95) -> float:
    """Seed 000's Muon momentum (its train_gpt.py, get_muon_momentum), restated: up from low over the warmup,
    down over the last cooldown steps (strictly after steps - cooldown), high between."""
    if step < warmup:
        return low + step / warmup * (high - low)
    if step > steps - cooldown:
        return high - (step - (steps - cooldown)) / cooldown * (high - low)
    return high


@pytest.mark.parametrize("steps", [400, 2000, 320])
def test_muon_momentum_schedule_is_the_seeds(steps):
    kw = dict(total=steps, peak=0.95, low=0.85, warmup=300, cooldown=50)
    got = [momentum_at(step, **kw) for step in range(steps)]
    assert got == pytest.approx([seed_muon_momentum(step, steps) for step in range(steps)], abs=1e-15)
    assert got[0] == 0.85 and got[150] == pytest.approx(0.90) and got[-1] == pytest.approx(0.852)
    assert momentum_at(7, total=10, peak=0.9, low=0.5) == 0.9          # no warmup, no cooldown: the peak


def test_a_run_steps_muon_with_the_scheduled_momentum(tmp_path, monkeypatch):
    """Each update of Muon (and NorMuon) uses the step's momentum; AdamW's groups get none; resuming keeps it."""
    from lengthgen.train.normuon import NorMuon

    used = []
    step = NorMuon.step
    monkeypatch.setattr(NorMuon, "step", lambda self, *a: used.append(
        {g["momentum"] for g in self.param_groups}) or step(self, *a))
    cfg = config("train.optimizer=normuon", "train.muon_momentum_warmup=3", "train.muon_momentum_cooldown=2",
                 "train.muon_momentum_min=0.5", "train.muon_momentum=0.9")
    full = train(cfg, tmp_path / "full", progress=False)
    want = [seed_muon_momentum(s, 6, warmup=3, cooldown=2, low=0.5, high=0.9) for s in range(6)]
    assert [len(m) for m in used] == [1] * 6 and [m.pop() for m in used] == pytest.approx(want)
    assert want[0] == 0.5 and want[4] == 0.9 and want[5] == pytest.approx(0.7)
    assert all("momentum" not in g for g in full.trainer.optimizers[1].param_groups)
    train(cfg, tmp_path / "resumed", progress=False, stop_at=4)
    assert train(cfg, tmp_path / "resumed", progress=False, resume=True).history == full.history
    assert "train.muon_momentum_warmup=3, train.muon_momentum_cooldown=2: no effect with train.optimizer=" \
        "'adamw'" in config("train.muon_momentum_warmup=3", "train.muon_momentum_cooldown=2").unused([8])[0]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_palm"])
def test_muon_keys_without_muon_are_named_as_without_effect(optimizer, tmp_path):
    """muon_lr, its weight decay, betas and schedule were ignored without a word by the AdamW optimizers (only the
    momentum schedule was named); every Muon key set is named, once. Its parameter patterns (muon_lr_mul,
    muon_exclude) are refused instead, so the warning does not call them without effect."""
    cfg = config(f"train.optimizer={optimizer}", "train.muon_lr=0.1", "train.muon_weight_decay=0.5",
                 "train.muon_beta2=0.9", "train.muon_lr_mul={'blocks.*' = 2.0}", "train.muon_exclude=['x']")
    assert cfg.unused([8]) == [f"train.muon_lr=0.1, train.muon_weight_decay=0.5, train.muon_beta2=0.9: no effect "
                               f"with train.optimizer='{optimizer}' (Muon's keys, read only with muon or normuon)"]
    with pytest.raises(ConfigError, match=r"^train.muon_lr_mul applies only with train.optimizer=muon or normuon"):
        train(cfg, tmp_path / "run", progress=False)
    assert config("train.optimizer=normuon", "train.muon_lr=0.1", "train.muon_beta2=0.9").unused([8]) == []
    assert config("train.optimizer=muon", "train.muon_beta2=0.9").unused([8]) == [
        "train.muon_beta2=0.9: no effect with train.optimizer='muon' (NorMuon's second moment, read only with "
        "normuon)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_normuon_and_fused_cautious_adamw_on_cuda_match_the_cpu():
    """On CUDA the trainer's AdamW is fused: the cautious decay before its step must act the same there."""
    from lengthgen.train.normuon import CautiousAdamW, NorMuon
    torch.manual_seed(3)
    start, grads = torch.randn(12, 4), [torch.randn(12, 4) for _ in range(3)]
    results = []
    for device, fused in (("cpu", None), ("cuda", True)):
        a, m = torch.nn.Parameter(start.clone().to(device)), torch.nn.Parameter(start.clone().to(device))
        adam = CautiousAdamW([{"params": [a], "weight_decay": 0.0, "cautious_decay": 0.5}], lr=0.1, fused=fused)
        muon = NorMuon([{"params": [m], "lr": 0.05, "lr_mul": 1.0}], weight_decay=1.2, cautious=True)
        for g in grads:
            a.grad, m.grad = g.to(device), g.to(device)
            adam.step()
            muon.step()
        results.append((a.detach().cpu(), m.detach().cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=2e-2, atol=2e-3)     # bf16 Newton-Schulz


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_palm_adamw_on_cuda_matches_the_cpu():
    """Seed 001's PaLMAdamW keeps its step count on the CPU and its moments beside the weights: on CUDA it must
    take the CPU's steps (float32; 20 updates, the warmed-up lr changing)."""
    torch.manual_seed(4)
    start, grads = torch.randn(12, 4), [torch.randn(12, 4) for _ in range(20)]
    results = []
    for device in ("cpu", "cuda"):
        weight = torch.nn.Parameter(start.clone().to(device))
        opt = PaLMAdamW([weight], lr=0.01, weight_decay=0.1)
        for t, g in enumerate(grads, 1):
            opt.param_groups[0]["lr"] = 0.01 * min(1.0, t / 6)
            weight.grad = g.to(device)
            opt.step()
        results.append(weight.detach().cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_adamw_steps_every_other_step_on_the_summed_gradients(tmp_path):
    """train.adam_every=2 (seed 000's DistAdam): AdamW's parameters stay put on even steps and move on odd ones by
    torch AdamW's update of the two steps' summed gradients (each at its step's weights) at the odd step's lr;
    Muon's move every step. A finetune (train.init_from) starts at step 0 with nothing pending."""
    from lengthgen.data.config import step_generator
    from lengthgen.train.optim import set_lr

    cfg = config("train.optimizer=muon", "train.adam_every=2", "train.grad_clip=0", "train.schedule=wsd",
                 "train.cooldown_frac=0.5", "model.tie_embeddings=false")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    muon, adamw = trainer.optimizers
    adam_params = [p for g in adamw.param_groups for p in g["params"]]
    reference = copy.deepcopy(adamw.param_groups)
    shadow = [p.detach().clone() for p in adam_params]
    for shadow_group, group in zip(reference, adamw.param_groups):
        shadow_group["params"] = [shadow[next(i for i, q in enumerate(adam_params) if q is p)] for p in group["params"]]
    by_hand = torch.optim.AdamW(reference, lr=cfg.train.lr, betas=cfg.train.betas, eps=cfg.train.eps)
    summed = None
    for step in range(cfg.train.steps):
        before = copy.deepcopy(trainer.model)           # the step's gradient at its weights, apart from the run
        batch = trainer.source.sample(cfg.batch_size_at(step), cfg.length_at(step), step_generator(0, step))
        ((micro, weight),) = trainer._micro_batches(batch)
        before.loss(before(micro.tokens, micro.doc_ids), micro)[0].backward()
        grads = {id(q): p.grad for q, p in zip(trainer.model.parameters(), before.parameters())}
        summed = [grads[id(p)] + (summed[i] if summed else 0) for i, p in enumerate(adam_params)]
        adam_before = [p.detach().clone() for p in adam_params]
        muon_before = [p.detach().clone() for g in muon.param_groups for p in g["params"]]
        entry = trainer._train_step(step)
        muon_after = [p.detach() for g in muon.param_groups for p in g["params"]]
        assert all(not torch.equal(a, b) for a, b in zip(muon_before, muon_after)), step
        if step % 2 == 0:
            assert all(torch.equal(a, p) for a, p in zip(adam_before, adam_params)), step
            continue
        for p, g in zip(shadow, summed):
            p.grad = g
        set_lr([by_hand], entry["lr_mult"])
        by_hand.step()
        summed = None
        for p, want in zip(adam_params, shadow):
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert {int(state["step"]) for state in adamw.state.values()} == {3}
    trainer.save_checkpoint()
    trainer.close()
    finetune = Trainer(cfg.override(f"train.init_from={tmp_path / 'run'}"), tmp_path / "finetune", progress=False)
    start = [p.detach().clone() for p in finetune.optimizers[1].param_groups[0]["params"]]
    finetune._train_step(0)
    assert all(torch.equal(a, p) for a, p in zip(start, finetune.optimizers[1].param_groups[0]["params"]))
    finetune.close()


def test_adam_every_resumes_exactly_between_two_adamw_steps(tmp_path):
    """Stopped at step 3 (AdamW's summed gradient of step 2 pending), the checkpoint keeps it and the resumed run
    is the uninterrupted one, bit for bit, with micro-batches, gradient clipping, QK-clip and BEMA on."""
    cfg = config("train.optimizer=normuon", "train.cautious_weight_decay=true", "train.weight_decay=0.1",
                 "train.adam_every=2", "train.grad_accum=2", "train.grad_clip=0.05", "train.qk_clip=0.5",
                 "train.bema.enabled=true", "train.schedule=constant", "train.warmup_steps=3")
    full = train(cfg, tmp_path / "full", progress=False)
    stopped = train(cfg, tmp_path / "resumed", progress=False, stop_at=3)
    assert (stopped.checkpoint / "adamw_grads.safetensors").is_file()
    assert not (full.checkpoint / "adamw_grads.safetensors").exists()       # step 6: nothing pending
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.history == full.history
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(full.trainer.bema_state_dict().items(), resumed.trainer.bema_state_dict().values()):
        assert torch.equal(a, b), name
    entries = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert all(e["grad_norm"] > 0 for e in entries if "loss" in e)     # NorMuon's matrices are clipped every step
    # an odd train.steps ends with a gradient pending: the final checkpoint keeps it, and --extend goes on exactly
    train(cfg.override("train.steps=5"), tmp_path / "extended", progress=False)
    extended = train(cfg, tmp_path / "extended", progress=False, resume=True, extend=True)
    assert extended.history == full.history


def test_adam_every_with_adamw_alone_and_a_restart_at_an_odd_stage(tmp_path):
    """adamw alone: between its steps nothing steps, so nothing is clipped (no grad_norm logged). A restart at a
    stage hands the pending gradients to the fresh AdamW (its first step, at step 3, is on steps 2 and 3's sum),
    and a run stopped there resumes exactly; without its pending gradients the checkpoint is not used."""
    cfg = config("train.stages=[[0, 8], [3, 16]]", "train.tokens_per_step=64", "train.restart_at_stages=true",
                 "train.schedule=constant", "train.warmup_steps=2", "train.adam_every=2")
    full = train(cfg, tmp_path / "full", progress=False)
    (adamw,) = full.trainer.optimizers
    assert {int(state["step"]) for state in adamw.state.values()} == {2}       # steps 3 and 5 of the fresh one
    entries = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "grad_norm" in e] == [2, 4, 6]     # after steps 1, 3, 5
    train(cfg, tmp_path / "resumed", progress=False, stop_at=3)
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.history == full.history
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert cfg.train.unused() == [] and config("train.adam_every=7").train.unused() == [
        "train.adam_every=7 > train.steps=6: AdamW never steps (it steps where (step + 1) % adam_every == 0)"]
    with pytest.raises(ConfigError, match=r"^train.adam_every=0 is not valid; it must be an integer >= 1$"):
        config("train.adam_every=0")
    # a checkpoint whose pending gradients are gone is unreadable: the resume falls back to the one before, exactly
    cfg = cfg.override("train.checkpoint_every=1")
    train(cfg, tmp_path / "dropped", progress=False, stop_at=3)
    (tmp_path / "dropped" / "checkpoints" / "step_00000003" / "adamw_grads.safetensors").unlink()
    with pytest.warns(RunFolderWarning, match=r"adamw_grads.safetensors is missing; using the older checkpoint "
                                              r"step_00000002"):
        assert train(cfg, tmp_path / "dropped", progress=False, resume=True).history == full.history


def test_adam_every_refuses_pending_gradients_of_another_model(tmp_path):
    """A checkpoint whose adamw_grads.safetensors holds another model's gradients (sound bytes, its digest
    recorded) is unreadable as a missing one is: the resume falls back to the one before, exactly; before, the
    assignment of the first one of another shape ended the resume in a RuntimeError traceback."""
    from safetensors.torch import save_file

    from lengthgen.train.checkpoint import DIGESTS, PENDING_GRADS, file_digest

    cfg = config("train.adam_every=2", "train.checkpoint_every=1")
    full = train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "run", progress=False, stop_at=3)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    wider = GPT(cfg.override("model.dim=32", "model.vocab_size=4").model)
    save_file({name: torch.zeros_like(p) for name, p in wider.named_parameters()}, ckpt / PENDING_GRADS)
    digests = json.loads((ckpt / DIGESTS).read_text())
    (ckpt / DIGESTS).write_text(json.dumps({**digests, PENDING_GRADS: file_digest(ckpt / PENDING_GRADS)}))
    with pytest.warns(RunFolderWarning, match=r"adamw_grads.safetensors is unreadable \(ValueError: [\w.]+ is "
                                              r"torch.float32 \[\d+(, \d+)*\], not a gradient of this model \(the "
                                              r"parameter's is torch.float32 .*using the older checkpoint "
                                              r"step_00000002"):
        assert train(cfg, tmp_path / "run", progress=False, resume=True).history == full.history
