"""Trainer: learning, exact resume, schedules, BEMA, staged lengths, NaN stop, atomic checkpoints, Muon, QK-clip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lengthgen.attention import Attention
from lengthgen.config import ConfigError
from lengthgen.train.config import RunConfig
from lengthgen.eval import RunEval
from lengthgen.model import GPT
from lengthgen.train import (BEMA, NonFiniteLossError, Trainer, attention_max_logits, build_optimizers,
                             load_run, lr_multiplier, muon_param_names, qk_clip_, train)
from lengthgen.train.optim import set_lr
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train.run_folder import RunFolderError


def config(*overrides: str) -> RunConfig:
    base = ["model.dim=32", "model.layers=2", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=8",
            "train.lr=3e-3", "train.batch_size=8", "train.eval_batches=1", "train.eval_batch_size=4",
            "data.task=counting", "data.task_kwargs={vocab_size = 8}", "data.length=16"]
    return RunConfig().override(*base, *overrides)


# ---------------------------------------------------------------------------------------------------
# learning


def test_counting_learns(tmp_path):
    # seed 001: L2 (p=2) attention can count (softmax averages, so it cannot); 2 symbols, counts up to 15
    cfg = config("train.steps=60", "train.lr=1e-2", "train.warmup_steps=5", "train.batch_size=16",
                 "data.task_kwargs={vocab_size = 2}", "model.attention=l2")
    result = train(cfg, tmp_path / "counting", progress=False)
    h = result.history
    assert len(h) == 60 and result.step == 60
    assert sum(h[-10:]) / 10 < 0.5 * sum(h[:3]) / 3, h
    assert "abs_error" in result.metrics["eval"]["16"]


def test_mqar_learns(tmp_path):
    cfg = config("data.task=mqar", "data.task_kwargs={vocab_size = 16}", "data.length=16", "train.steps=60",
                 "train.lr=1e-2", "train.warmup_steps=5", "train.batch_size=16", "train.optimizer=muon",
                 "train.muon_lr=0.02")
    result = train(cfg, tmp_path / "mqar", progress=False)
    h = result.history
    assert result.config.model.head == "lm" and result.config.model.vocab_size == 16
    assert sum(h[-10:]) / 10 < 0.75 * sum(h[:3]) / 3, h
    assert "accuracy" in result.metrics["eval"]["16"]


@pytest.mark.parametrize("stop_at", [-1, 2.5, "3"])
def test_a_bad_stop_at_is_refused_before_anything_is_written(tmp_path, stop_at):
    """stop_at=-1 returned an untrained 'result' (step 0, a checkpoint written), 2.5 ran as min(steps, 2.5) and
    "3" failed with TypeError: '<' not supported between instances of 'str' and 'int'."""
    with pytest.raises(ConfigError, match=rf"^stop_at={stop_at!r} is not valid; it must be an integer >= 0, or none$"):
        train(config(), tmp_path / "run", progress=False, stop_at=stop_at)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "config.json").exists()


def test_the_trainer_runs_a_checked_copy_of_the_callers_config(tmp_path):
    """A RunConfig was used as given: a field set after it was made skipped the checks (train.lr = "abc" ended in
    a TypeError in the schedule, nan in torch's 'Invalid learning rate'), and one set after the Trainer was built
    changed the run under way (train.steps = 50 trained 50 steps). The Trainer now takes a checked copy."""
    cfg = config()
    cfg.train.lr = "abc"
    with pytest.raises(ConfigError, match=r"^train.lr='abc' is not valid"):
        Trainer(cfg, tmp_path / "bad", progress=False)
    cfg = config("train.steps=2")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    cfg.train.steps = 50
    try:
        assert trainer.fit().step == 2 and trainer.config.train.steps == 2
    finally:
        trainer.close()


@pytest.mark.filterwarnings("ignore:corpus .* has no validation split:lengthgen.config.ConfigWarning")
def test_paths_in_a_dict_config_are_saved_as_strings(tmp_path):
    """A pathlib.Path as data.text.corpus was read and tokenized, then config.json failed ('Object of type PosixPath
    is not JSON serializable'); one as train.init_from was refused ('must be a string'). Both are strings now."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a tiny corpus, long enough for a few windows" for i in range(200)))
    cfg = config().to_dict()
    cfg["data"].update(kind="text", task_kwargs={}, text={"corpus": corpus, "tokenizer": "byte"})
    cfg["model"].update(head=None, vocab_size=None)
    cfg["train"].update(steps=1)
    train(cfg, tmp_path / "first", progress=False)
    saved = json.loads((tmp_path / "first" / "config.json").read_text())
    assert saved["data"]["text"]["corpus"] == str(corpus)
    cfg["train"]["init_from"] = tmp_path / "first"
    assert train(cfg, tmp_path / "second", progress=False).config.train.init_from == str(tmp_path / "first")


@pytest.mark.parametrize("given", [None, 5, ["model.dim=8"]])
def test_a_config_of_another_type_is_named(tmp_path, given):
    """train(None, out) trained the default 1000-step config; an int or a list ended in os.fspath's TypeError."""
    with pytest.raises(ConfigError, match=rf"^config must be a RunConfig, its dict or the path of a TOML or JSON "
                                          rf"file, got {type(given).__name__}$"):
        train(given, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("out", [None, 5, ""])
def test_an_out_dir_that_is_no_path_is_named(out):
    """train(cfg, None) was pathlib's 'expected str, bytes or os.PathLike object, not NoneType' once the data was
    built, and train(cfg, "") took the current folder as the run's."""
    with pytest.raises(ConfigError, match=rf"^out_dir must be the run's folder, a str or Path, got {out!r}$"):
        train(config(), out, progress=False)


def test_extend_without_resume_is_refused(tmp_path):
    """train(cfg, out, extend=True) without resume trained a fresh run and ignored extend (the CLI refuses
    --extend without --resume)."""
    with pytest.raises(ValueError, match=r"^extend changes train.steps of a resumed run: give resume=True too$"):
        train(config(), tmp_path / "run", progress=False, extend=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("inside", [False, True])
def test_a_run_folder_that_is_a_file_is_named(tmp_path, inside):
    """train(cfg, "notes.txt") ended in the lock's raw mkdir error, '[Errno 17] File exists' (a path under a file:
    'Not a directory'), after the data and model were built."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    out = file / "run" if inside else file
    with pytest.raises(RunFolderError) as refused:
        train(config(), out, progress=False)
    assert str(refused.value) == f"{out}: {file} is a file, not a folder; choose another folder"
    assert file.read_text() == "mine"


# ---------------------------------------------------------------------------------------------------
# resume


def test_resume_reproduces_losses_exactly(tmp_path):
    cfg = config("train.steps=8", "train.optimizer=muon", "train.bema.enabled=true", "train.grad_accum=2",
                 "model.dropout=0.1", "train.tokens_per_step=128", "train.stages=[[0, 8], [4, 16]]",
                 "train.schedule=wsd", "train.warmup_steps=2", "train.qk_clip=5.0", "train.eval_every=3",
                 "train.log_every=1")
    full = train(cfg, tmp_path / "full", progress=False)
    half = train(cfg, tmp_path / "resumed", progress=False, stop_at=4)
    assert half.step == 4 and half.history == full.history[:4]
    assert json.loads((tmp_path / "resumed" / "latest.json").read_text())["step"] == 4
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.step == 8
    assert resumed.history == full.history                     # exact, not approximately
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(full.trainer.bema_state_dict().values(), resumed.trainer.bema_state_dict().values()):
        assert torch.equal(a, b)
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 9))


def test_load_run_and_bema_weights(tmp_path):
    cfg = config("train.steps=5", "train.bema.enabled=true", "train.bema.rho=2")
    result = train(cfg, tmp_path / "run", progress=False)
    loaded_cfg, model = load_run(tmp_path / "run")
    assert loaded_cfg == result.config
    tokens = torch.randint(8, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), result.model(tokens), rtol=0, atol=0)
    _, model_file = load_run(result.checkpoint / "model.safetensors")
    assert torch.equal(model_file.embed.weight, model.embed.weight)
    _, bema_model = load_run(tmp_path / "run", bema=True)
    expected = result.trainer.bema_state_dict()
    for key, value in bema_model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
    live = {k: v.clone() for k, v in result.model.state_dict().items()}
    with result.trainer.use_bema() as swapped:
        assert torch.equal(swapped.embed.weight, expected["embed.weight"])
    assert all(torch.equal(v, result.model.state_dict()[k]) for k, v in live.items())
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_run(tmp_path)


def test_running_out_of_memory_while_loading_is_not_a_damaged_checkpoint(tmp_path, monkeypatch):
    """An allocation failure while a checkpoint's weights were read counted as a damaged checkpoint: load_run warned
    and returned the older checkpoint's weights, and a resume set the newest aside as step_N.corrupt."""
    cfg = config("train.steps=4", "train.checkpoint_every=2")
    train(cfg, tmp_path / "run", progress=False)

    load_model = ckpt_io.load_model

    def oom(model, path, **kwargs):         # the newest checkpoint's weights do not fit, the older ones do
        if "step_00000004" in path:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return load_model(model, path, **kwargs)

    monkeypatch.setattr(ckpt_io, "load_model", oom)
    with pytest.raises(torch.OutOfMemoryError):
        load_run(tmp_path / "run")
    with pytest.raises(torch.OutOfMemoryError):
        train(cfg, tmp_path / "run", progress=False, resume=True)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("device, why", [("gpu", "Expected one of cpu, cuda"), ("cuda:64", "")])
def test_load_run_names_a_device_it_cannot_load_onto(tmp_path, device, why):
    """load_run(run, device="gpu"), or a CUDA device this machine lacks, said 'no readable checkpoint in RUN: ...
    is unreadable (SafetensorError: device gpu is invalid)', blaming the checkpoint (and with several, trying each)."""
    cfg = config("train.steps=1")
    train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match=rf"^device='{device}' cannot be used here \(.*{why}.*\); give 'cpu', "
                                          "'cuda' or 'cuda:N' of this machine$"):
        load_run(tmp_path / "run", device=device)
    assert load_run(tmp_path / "run", device=torch.device("cpu"))[1].embed.weight.device.type == "cpu"


# ---------------------------------------------------------------------------------------------------
# schedules, BEMA, stages


def test_schedules_match_their_formulas():
    total, warmup = 100, 10
    for step in range(total):
        cos = lr_multiplier(step, total=total, schedule="cosine", warmup=warmup, min_ratio=0.1)
        wsd = lr_multiplier(step, total=total, schedule="wsd", warmup=warmup, cooldown_frac=0.3, min_ratio=0.1)
        if step < warmup:
            assert cos == pytest.approx((step + 1) / warmup) and wsd == pytest.approx((step + 1) / warmup)
            continue
        p = (step - warmup) / (total - warmup)
        assert cos == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        if step < 70:
            assert wsd == 1.0
        else:
            assert wsd == pytest.approx(1 - 0.9 * (step - 70) / 30)
    assert lr_multiplier(99, total=100, schedule="wsd", cooldown_frac=0.3) == pytest.approx(1 / 30)
    assert lr_multiplier(50, total=100, schedule="constant", warmup=10) == 1.0


@pytest.mark.parametrize("update_every", [1, 3])
def test_bema_matches_its_formula(update_every):
    """The authors' offline stabilizer (abblock/bema): gamma in the EMA weight only, updates update_every apart."""
    kappa, eta, rho, gamma, tau = 0.5, 0.2, 3, 0.5, 2
    p = torch.nn.Parameter(torch.zeros(3))
    module = torch.nn.Module()
    module.w = p
    tracker = BEMA(module, kappa=kappa, eta=eta, rho=rho, gamma=gamma, tau=tau, update_every=update_every)
    g = torch.Generator().manual_seed(0)
    thetas = [torch.randn(3, generator=g) for _ in range(12)]
    theta0 = ema = None
    for step, theta in enumerate(thetas):
        with torch.no_grad():
            p.copy_(theta)
        tracker.update(step)
        if step < tau:
            expected = theta
        elif (step - tau) % update_every == 0:
            if theta0 is None:
                theta0, ema = theta.clone(), theta.clone()
            t = max(step - tau + rho, 1)
            beta, alpha = (1 + gamma * t) ** -kappa, (1 + t) ** -eta
            ema = (1 - beta) * ema + beta * theta
            expected = alpha * (theta - theta0) + ema
        torch.testing.assert_close(tracker.weights()["w"], expected)


def test_staged_lengths_keep_tokens_per_step(tmp_path):
    cfg = config("train.tokens_per_step=256", "train.stages=[[0, 8], [2, 16], [4, 32]]", "train.steps=6",
                 "train.eval_batches=0", "train.log_every=1")
    assert [cfg.length_at(s) for s in range(6)] == [8, 8, 16, 16, 32, 32]
    assert all(cfg.batch_size_at(s) * cfg.length_at(s) == 256 for s in range(6))
    train(cfg, tmp_path / "staged", progress=False)
    records = [json.loads(line) for line in (tmp_path / "staged" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["length"] for r in records] == [8, 8, 16, 16, 32, 32]
    assert {r["batch_size"] * r["length"] for r in records} == {256}
    assert records[-1]["tokens"] == 6 * 256
    assert not [n for n in cfg.unused([8, 16, 32]) if "tokens per step" in n]
    # a length that does not divide tokens_per_step trains fewer tokens per step: said, not silent
    uneven = config("train.tokens_per_step=200", "train.stages=[[0, 8], [2, 16], [4, 32]]", "train.steps=6")
    assert [uneven.batch_size_at(s) * uneven.length_at(s) for s in (0, 2, 4)] == [200, 192, 192]
    assert [n for n in uneven.unused([8, 16, 32]) if "tokens per step" in n] == [
        "train.tokens_per_step = 200 tokens per step is not a multiple of every training length: steps train "
        "12 x 16 = 192, 6 x 32 = 192 tokens (batch = tokens_per_step // length), not 200"]



def test_a_stage_at_step_0_replaces_data_length_as_a_training_length(tmp_path):
    cfg = config("train.stages=[[0, 8], [2, 16]]", "data.length=32", "train.tokens_per_step=256", "train.steps=4",
                 "train.eval_lengths=[16, 32]")
    assert [cfg.length_at(s) for s in range(4)] == [8, 8, 16, 16] and cfg.lengths() == [8, 16]
    assert config("train.stages=[[2, 16]]").lengths() == [16]            # data.length 16 until step 2
    assert config("train.stages=[[2, 32]]", "train.tokens_per_step=64").lengths() == [16, 32]
    result = train(cfg, tmp_path / "run", progress=False)
    assert [r.length for r in result.evaluation.lengths] == [16, 32]      # 32 is beyond what it trained at

# ---------------------------------------------------------------------------------------------------
# failures: NaN, atomic checkpoints


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = config("train.steps=10", "train.checkpoint_every=2")
    calls = {"n": 0}
    original = GPT.loss

    def loss(self, output, batch):
        calls["n"] += 1
        value, per = original(self, output, batch)
        return (value * float("nan"), per) if calls["n"] == 6 and self.training else (value, per)

    monkeypatch.setattr(GPT, "loss", loss)
    with pytest.raises(NonFiniteLossError, match=r"at step 5\b.*step_00000004"):
        train(cfg, tmp_path / "nan", progress=False)
    assert json.loads((tmp_path / "nan" / "latest.json").read_text())["step"] == 4
    _, model = load_run(tmp_path / "nan")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    cfg = config("train.steps=2", "train.eval_batches=0")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.fit()
    latest = (tmp_path / "run" / "latest.json").read_text()
    good = sorted((tmp_path / "run" / "checkpoints").iterdir())

    def broken_save(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_io.torch, "save", broken_save)
    trainer.step = 3
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint()
    assert (tmp_path / "run" / "latest.json").read_text() == latest
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == good          # no partial folder or file
    assert not list((tmp_path / "run").rglob("*.tmp*"))
    # a single file: the old content survives a failing writer
    target = tmp_path / "file.txt"
    target.write_text("old")

    def writer(p):
        with open(p, "w") as f:
            f.write("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        ckpt_io.atomic_write(target, writer)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir() if "file" in p.name] == ["file.txt"]


def test_an_atomic_write_through_a_link_writes_the_file_it_names_and_keeps_the_link(tmp_path):
    """A file --out (eval, bench) that is a symbolic link was replaced by a regular file: the link was gone and the
    file it named kept its old content."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "old.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "data" / "old.json")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "data" / "new.json")
    for link in ("link.json", "dangling.json"):
        ckpt_io.atomic_write(tmp_path / link, lambda p: Path(p).write_text("new"))
        assert (tmp_path / link).is_symlink() and (tmp_path / link).read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["new.json", "old.json"]


def test_a_checkpoint_is_on_disk_before_older_ones_are_pruned(tmp_path, monkeypatch):
    """Every file of the new checkpoint and the folders that hold it are flushed (fsync) before latest.json moves
    and the older checkpoint is deleted: a power loss then cannot leave empty files and no older checkpoint."""
    import os
    import shutil

    import lengthgen.atomic as atomic

    events: list[tuple[str, str]] = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(ckpt_io.shutil, "rmtree", lambda p, **k: (events.append(("rmtree", str(p))),
                                                                    real_rmtree(p, **k)))
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name fsync'd files (Linux)")
    train(config("train.steps=2", "train.eval_batches=0", "train.checkpoint_every=1", "train.keep_checkpoints=1",
                 "train.bema.enabled=true"), tmp_path / "run", progress=False)
    pruned = events.index(("rmtree", str(tmp_path / "run" / "checkpoints" / "step_00000001")))
    synced = [path for kind, path in events[:pruned] if kind == "fsync"]
    for name in ("model.safetensors", "bema.safetensors", "optimizer.pt", "state.json"):
        assert any("step_00000002.tmp-" in p and f"/.{name}." in p for p in synced), name
    # the renames into the checkpoints folder and the run folder (latest.json's)
    assert str(tmp_path / "run" / "checkpoints") in synced and str(tmp_path / "run") in synced
    assert any(p.startswith(str(tmp_path / "run" / ".latest.json.")) for p in synced)


# ---------------------------------------------------------------------------------------------------
# optimizers, QK-clip


@pytest.mark.parametrize("optimizer", ["muon", "normuon"])
def test_muon_for_a_model_without_blocks_is_refused(optimizer):
    """build_optimizers of a researcher's own model (its layers not under ``blocks``) with Muon gave every parameter
    to AdamW, silently: Muon takes the 2-D weights under model.blocks."""
    model = nn.Sequential(nn.Embedding(8, 16), Attention(16, 2))
    with pytest.raises(ConfigError, match=rf"^train.optimizer='{optimizer}' found no hidden matrices in Sequential for "
                                          r"Muon: it takes the trainable 2-D weights under model.blocks"):
        build_optimizers(model, config(f"train.optimizer={optimizer}").train)
    assert [type(o) for o in build_optimizers(model, config().train)] == [torch.optim.AdamW]


def test_muon_gets_hidden_matrices_adamw_the_rest():
    cfg = config("train.optimizer=muon", "model.attention={preset = \"ssmax\", learnable_scaling = \"global\"}",
                 "model.attention.qk_norm=rms", "model.attention.gate=head")
    model = GPT(cfg.model.replace(vocab_size=8, head="lm", tie_embeddings=False))
    muon, adamw = build_optimizers(model, cfg.train)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == set(muon_param_names(model))
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    for n in in_muon:
        assert n.startswith("blocks.") and model.get_parameter(n).ndim == 2
    assert {"blocks.0.attn.q_proj.weight", "blocks.1.mlp.fc.weight", "blocks.0.attn.gate.weight"} <= in_muon
    assert {"embed.weight", "head.weight", "scaling_multiplier", "final_norm.weight",
            "blocks.0.norm1.weight", "blocks.0.attn.q_norm_weight"} <= in_adamw
    decay = [g for g in adamw.param_groups if g["weight_decay"] > 0 or g["params"][0].ndim >= 2][0]
    assert all(p.ndim >= 2 for p in decay["params"])


SHAPES = [(8, 8), (16, 8), (8, 8), (8, 16), (12, 8), (16, 8)]


def muon_pair(**kwargs) -> tuple[list, list, torch.optim.Optimizer, torch.optim.Optimizer]:
    """Two copies of parameters of `SHAPES`, one under torch's Muon and one under lengthgen's."""
    from lengthgen.train.muon import Muon
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return ps, qs, torch.optim.Muon(ps, **kwargs), Muon(qs, **kwargs)


def muon_steps(ps, qs, a, b, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()


@pytest.mark.parametrize("nesterov,adjust", [(True, "original"), (False, "match_rms_adamw")])
def test_batched_muon_takes_torch_muons_steps(nesterov, adjust):
    ps, qs, a, b = muon_pair(lr=0.05, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    muon_steps(ps, qs, a, b, 3)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        assert not torch.equal(p, q.new_zeros(q.shape))
    # the same state dict: each continues from the other's
    a2, b2 = type(a)(ps, lr=0.05, nesterov=nesterov), type(b)(qs, lr=0.05, nesterov=nesterov)
    a2.load_state_dict(b.state_dict())
    b2.load_state_dict(a.state_dict())
    assert all(len(b2.state[q]["momentum_buffer"]) for q in qs)
    muon_steps(ps, qs, a2, b2, 2, seed=2)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


def test_batched_muon_orthogonalizes_each_shape_once():
    """3 matmuls per Newton-Schulz step for each distinct shape (4 here), not for each of the 6 matrices."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm,
                                       torch.ops.aten.baddbmm):
                CountMatmuls.calls += 1
            return func(*args, **(kwargs or {}))

    _, qs, _, b = muon_pair(lr=0.05)
    for q in qs:
        q.grad = torch.randn(q.shape)
    with CountMatmuls():
        b.step()
    assert CountMatmuls.calls == 3 * b.param_groups[0]["ns_steps"] * len({(8, 8), (16, 8), (8, 16), (12, 8)})


def test_muon_exclude_sends_the_matched_block_matrices_to_adamw():
    cfg = config("train.optimizer=normuon", "model.attention.gate=head",
                 'train.muon_exclude=["blocks.*.attn.gate.weight"]',
                 'train.adam_betas={"blocks.*.gate.*" = [0.9, 0.99]}')
    model = GPT(cfg.model.replace(vocab_size=8, head="lm"))
    muon, adamw = build_optimizers(model, cfg.train)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    betas = {names[id(p)]: g["betas"] for g in adamw.param_groups for p in g["params"]}
    gates = {n for n in names.values() if n.endswith("attn.gate.weight")}
    assert len(gates) == 2 and not gates & in_muon and in_muon == set(muon_param_names(model)) - gates
    assert {betas[n] for n in gates} == {(0.9, 0.99)} and "blocks.0.attn.q_proj.weight" in in_muon
    with pytest.raises(ConfigError, match=r"train.muon_exclude: pattern 'blocks.\*.nothing' matches no Muon "
                                          r"parameter; the Muon parameters are blocks.0.attn.q_proj.weight"):
        build_optimizers(model, config("train.optimizer=muon", 'train.muon_exclude=["blocks.*.nothing"]').train)
    with pytest.raises(ConfigError, match="train.muon_exclude applies only with train.optimizer=muon or normuon"):
        build_optimizers(model, config('train.muon_exclude=["blocks.*"]').train)


def test_weight_decay_mul_that_changes_no_decay_is_named():
    """A weight_decay_mul pattern matching only norms and biases (which weight_decay_on='matrices' never decays), or
    any multiplier with weight_decay = 0, built the same optimizer as without it, silently."""
    cfg = config("train.weight_decay=0.1", "train.weight_decay_mul={'*norm*' = 2.0}")
    model = GPT(cfg.model.replace(vocab_size=8, head="lm"))
    with pytest.raises(ConfigError, match=r"^train.weight_decay_mul: pattern '\*norm\*' matches only parameters "
                                          r"that are not 2-D .* no effect; remove it or set "
                                          r"train.weight_decay_on='all'$"):
        build_optimizers(model, cfg.train)
    adamw = build_optimizers(model, cfg.override("train.weight_decay_on=all").train)[0]
    assert sorted(g["weight_decay"] for g in adamw.param_groups) == pytest.approx([0.1, 0.2])
    build_optimizers(model, cfg.override("train.weight_decay_mul={'*' = 2.0}").train)     # matrices too: applies
    assert config("train.weight_decay_mul={'*' = 2.0}").unused([16]) == [
        "train.weight_decay_mul: no effect with train.weight_decay=0 (it multiplies AdamW's weight decay)"]


def test_muon_lr_mul_scales_the_matched_matrices_and_follows_the_schedule():
    cfg = config("train.optimizer=muon", "train.muon_lr=0.01",
                 "train.muon_lr_mul={\"blocks.*.attn.*_proj.weight\" = 2.0, \"blocks.*.mlp.proj.weight\" = 4.0, "
                 "\"blocks.1.mlp.proj.weight\" = 3.0}")
    model = GPT(cfg.model.replace(vocab_size=8, head="lm"))
    muon = build_optimizers(model, cfg.train)[0]
    lr_of = {name: g["lr"] for g in muon.param_groups for p in g["params"]
             for name, q in model.named_parameters() if q is p}
    assert lr_of == {name: 0.01 * (2.0 if "_proj" in name else 3.0 if name == "blocks.1.mlp.proj.weight" else
                                   4.0 if "mlp.proj" in name else 1.0) for name in muon_param_names(model)}
    set_lr([muon], 0.5)
    assert sorted(g["lr"] for g in muon.param_groups) == pytest.approx([0.005, 0.01, 0.015, 0.02])


def test_adam_lr_mul_and_betas_set_each_matched_parameters_group():
    """Seed 000's DistAdam: value embeddings at lr x75 with betas (0.75, 0.95), the skip gate x0.05 and the
    scalars x5 with betas (0.9, 0.99)."""
    cfg = config("train.optimizer=muon", "train.lr=0.01", "train.betas=[0.5, 0.95]", "train.weight_decay=0.1",
                 "train.adam_lr_mul={\"*.weight\" = 2.0, \"embed.weight\" = 75.0}",
                 "train.adam_betas={\"*norm*\" = [0.9, 0.99]}")
    model = GPT(cfg.model.replace(vocab_size=8, head="lm", tie_embeddings=False))
    adamw = build_optimizers(model, cfg.train)[1]
    group_of = {name: g for g in adamw.param_groups for p in g["params"] for name, q in model.named_parameters()
                if q is p}
    assert group_of["embed.weight"]["lr"] == pytest.approx(0.75) and group_of["head.weight"]["lr"] == 0.02
    assert group_of["final_norm.weight"]["lr"] == 0.02 and group_of["final_norm.weight"]["betas"] == (0.9, 0.99)
    assert group_of["head.weight"]["betas"] == (0.5, 0.95)
    assert group_of["head.weight"]["weight_decay"] == 0.1 and group_of["final_norm.weight"]["weight_decay"] == 0
    assert [g["weight_decay"] > 0 for g in adamw.param_groups] == [True, True, False, False]   # decayed first
    set_lr([adamw], 0.5)
    assert group_of["embed.weight"]["lr"] == pytest.approx(0.375)
    # without patterns: the two groups of before (2-D weights, then the rest), so older checkpoints load
    default = build_optimizers(model, config().train)[0]
    assert [all(p.ndim >= 2 for p in g["params"]) for g in default.param_groups] == [True, False]
    with pytest.raises(ConfigError, match=r"train.adam_lr_mul: pattern 'blocks.\*.mlp.\*' matches no AdamW parameter"):
        build_optimizers(model, config("train.optimizer=muon", "train.adam_lr_mul={\"blocks.*.mlp.*\" = 2.0}").train)


@pytest.mark.parametrize("keys, message", [
    (["train.optimizer=muon", "train.muon_lr_mul={\"blocks.*.attn.qkv.weight\" = 2.0}"],
     "train.muon_lr_mul: pattern 'blocks.*.attn.qkv.weight' matches no Muon parameter; the Muon parameters are "
     "blocks.0.attn"),
    (["train.muon_lr_mul={\"blocks.*\" = 2.0}"], "train.muon_lr_mul applies only with train.optimizer=muon"),
])
def test_muon_lr_mul_pattern_that_matches_nothing_is_an_error(keys, message):
    cfg = config(*keys)
    with pytest.raises(ConfigError, match=message):
        build_optimizers(GPT(cfg.model.replace(vocab_size=8, head="lm")), cfg.train)


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_qk_clip_brings_max_logit_to_tau(kv_heads):
    """Per head (Kimi K2): each head above tau lands on tau and the others keep their logits, under GQA too (a
    shared key head is left alone, its query heads take the whole factor). Logits written out from the weights."""
    torch.manual_seed(0)
    attn = Attention(16, 4, {"kv_heads": kv_heads, "position": "nope"}, head_dim=8, bias=True)
    with torch.no_grad():
        attn.q_proj.weight.mul_(torch.tensor([30.0, 1.0, 20.0, 0.1]).repeat_interleave(8)[:, None])
        attn.k_proj.weight.mul_(10.0)
    x = torch.randn(2, 12, 16)

    def maxima():
        attn.capture = {}
        attn(x)
        m = attention_max_logits(attn)
        attn.capture = None
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(2, 12, 4, 8).transpose(1, 2)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(2, 12, -1, 8).transpose(1, 2)
        s = (q @ k.repeat_interleave(4 // k.shape[1], dim=1).transpose(-1, -2)) / math.sqrt(8)
        s = s.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(m, s.amax(dim=(0, 2, 3)))     # the recorded maxima are the logits' maxima
        return m

    before = maxima()
    tau = float(before.sort().values[1]) + 1e-3     # two heads above tau
    gamma = qk_clip_(attn, before, tau)
    after = maxima()
    above = before > tau
    assert above.sum() == 2
    torch.testing.assert_close(gamma[above], tau / before[above])
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau))
    torch.testing.assert_close(after[~above], before[~above])


@pytest.mark.parametrize("tau, max_logits, match", [
    (-1.0, [3.0, 0.5], r"^tau=-1.0 is not valid; it must be a finite float32 number > 0$"),
    (0, [3.0, 0.5], r"^tau=0 is not valid"),
    (float("nan"), [3.0, 0.5], r"^tau=nan is not valid"),
    (1.0, [3.0], r"^qk_clip_: max_logits must be one per query head, \(2,\) \(attention_max_logits\), got \(1,\)$")])
def test_qk_clip_checks_its_arguments(tau, max_logits, match):
    """qk_clip_ from Python with tau < 0 scaled the weights by the square root of a negative gamma: NaN weights; tau
    = nan or 0 clipped nothing or everything, a max_logits of another length broadcast or failed in torch."""
    attn = Attention(16, 2)
    weights = {name: p.clone() for name, p in attn.named_parameters()}
    with pytest.raises(ConfigError, match=match):
        qk_clip_(attn, torch.tensor(max_logits), tau)
    assert all(torch.equal(p, weights[name]) for name, p in attn.named_parameters())


def test_qk_clip_with_qk_norm_scales_norm_weights():
    torch.manual_seed(0)
    attn = Attention(16, 2, {"qk_norm": "rms"}, head_dim=8)
    with torch.no_grad():
        attn.q_norm_weight.fill_(6.0)
        attn.k_norm_weight.fill_(6.0)
    x = torch.randn(1, 10, 16)
    attn.capture = {}
    attn(x)
    before = attention_max_logits(attn)
    qk_clip_(attn, before, 2.0)
    attn(x)
    assert attention_max_logits(attn).max() <= 2.0 * (1 + 1e-4)


def test_qk_clip_with_grad_accum_sees_the_whole_batch(tmp_path):
    """The max logit is over every micro-batch, as one full-batch forward sees it: the same clip for k = 1 and 4."""
    runs = {k: train(config("train.steps=3", "train.qk_clip=0.05", "train.log_every=1", f"train.grad_accum={k}"),
                     tmp_path / f"k{k}", progress=False) for k in (1, 4)}
    logged = {k: [json.loads(line).get("max_logit") for line in (tmp_path / f"k{k}" / "metrics.jsonl").open()]
              for k in runs}
    logged = {k: [m for m in v if m is not None] for k, v in logged.items()}
    assert len(logged[1]) == 3 and logged[1] == pytest.approx(logged[4], rel=1e-5)
    for (name, a), b in zip(runs[1].model.state_dict().items(), runs[4].model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_grad_accum_with_unequal_loss_masks_trains_on_the_whole_batch_mean(tmp_path):
    """Micro-batches that count unequal numbers of positions (a loss mask set on some rows' first positions only)
    weigh in by their counted positions, so k = 3 takes the steps of one pass over the batch's masked mean."""
    from dataclasses import replace

    from lengthgen.train.data import split_batch

    def masked(batch):
        mask = batch.loss_mask.clone()
        mask[:3, 4:] = False            # rows 0-2 count 4 positions, the others 16
        return replace(batch, loss_mask=mask)

    runs = {}
    for k in (1, 3):
        trainer = Trainer(config("train.steps=3", f"train.grad_accum={k}"), tmp_path / f"k{k}", progress=False)
        sample = trainer.source.sample
        trainer.source.sample = lambda *args, sample=sample: masked(sample(*args))
        try:
            runs[k] = trainer.fit()
        finally:
            trainer.close()
    assert runs[1].history == pytest.approx(runs[3].history, rel=1e-5)
    for (name, a), b in zip(runs[1].model.state_dict().items(), runs[3].model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    batch = masked(runs[1].trainer.source.sample(8, 16, torch.Generator().manual_seed(0)))
    assert [w for _, w in split_batch(batch, 2)] == [(3 * 4 + 16) / (3 * 4 + 5 * 16), 4 * 16 / (3 * 4 + 5 * 16)]


# ---------------------------------------------------------------------------------------------------
# evaluation: the one evaluator under the training context


def _eval_autocast(monkeypatch) -> list[bool]:
    """Records, for every eval-mode forward of a GPT, whether CPU autocast was on."""
    seen: list[bool] = []
    original = GPT.forward

    def forward(self, tokens, doc_ids=None):
        if not self.training:
            seen.append(torch.is_autocast_enabled("cpu"))
        return original(self, tokens, doc_ids)

    monkeypatch.setattr(GPT, "forward", forward)
    return seen


def test_evaluation_runs_under_the_training_autocast_and_writes_a_run_eval(tmp_path, monkeypatch):
    seen = _eval_autocast(monkeypatch)
    cfg = config("train.steps=2", "train.dtype=bfloat16", "train.eval_lengths=[16, 32]", "train.bema.enabled=true")
    result = train(cfg, tmp_path / "run", progress=False)
    assert seen and all(seen)
    saved = RunEval.load(tmp_path / "run" / "eval.json")
    bema = RunEval.load(tmp_path / "run" / "eval_bema.json")
    assert bema.bema and not saved.bema and bema.at(32).mean != saved.at(32).mean
    assert saved == result.evaluation
    assert saved.config == result.config.to_dict() and saved.seed == saved.eval_seed == cfg.train.seed
    assert [r.length for r in saved.lengths] == [16, 32] and saved.final_train_loss == result.history[-1]
    # the periodic evaluation at the last step saw the same batches with the same weights
    assert result.metrics["eval"]["32"] == saved.at(32).mean


def test_the_last_step_is_checkpointed_before_its_evaluation_which_runs_once(tmp_path, monkeypatch):
    cfg = config("train.steps=4", "train.eval_lengths=[16, 32]", "train.bema.enabled=true")
    original, calls = Trainer.evaluate, []

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "evaluate", interrupted)       # Ctrl-C (or out of memory) in the end's evaluation
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress=False)
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 4     # no step is lost

    def counted(self, *args, **kwargs):
        calls.append(self.step)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", counted)
    resumed = train(cfg, tmp_path / "run", progress=False, resume=True)
    assert resumed.step == 4 and len(resumed.history) == 4 and calls == [4, 4]      # eval.json: live and BEMA
    calls.clear()
    full = train(cfg, tmp_path / "full", progress=False)
    assert calls == [4, 4]       # the last step's periodic evaluation is eval.json's: not evaluated twice
    assert full.history == resumed.history and full.evaluation.lengths == resumed.evaluation.lengths
    assert full.metrics["bema_eval"]["32"] == RunEval.load(tmp_path / "full" / "eval_bema.json").at(32).mean
    # a finished run resumed reports the last evaluation its log holds
    assert train(cfg, tmp_path / "full", progress=False, resume=True).metrics == full.metrics


def test_batch_norm_with_micro_batches_warns_that_it_differs_from_one_pass(tmp_path):
    from lengthgen.config import ConfigWarning

    with pytest.warns(ConfigWarning, match=r"model.norm='batch' normalizes each micro-batch \(train.grad_accum=2\)"):
        Trainer(config("model.norm=batch", "train.grad_accum=2"), tmp_path / "a", progress=False).close()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)                  # one pass over the batch: nothing to say
        Trainer(config("model.norm=batch"), tmp_path / "b", progress=False).close()


def test_z_loss_and_logit_cap_without_an_lm_head_are_reported_unused():
    """`GPT.loss` adds the z-loss and `GPT.forward` caps the logits of an lm head only: set on a task whose head is
    regress (counting) or classify (tomita), they change nothing, and ``train`` must say so."""
    both = ("model.z_loss=0.01", "model.logit_cap=5.0")
    for task, head in (("counting", "regress"), ("tomita", "classify")):
        notes = config(f"data.task={task}", "data.task_kwargs={}", *both).unused([16])
        assert [n for n in notes if "lm head" in n] == [
            f"model.z_loss=0.01 has no effect with the {head} head (of data.task='{task}'): it applies to an lm "
            "head's logits only",
            f"model.logit_cap=5.0 has no effect with the {head} head (of data.task='{task}'): it applies to an lm "
            "head's logits only"], notes
    assert not [n for n in config("data.task=mqar", "data.task_kwargs={}", *both).unused([16]) if "lm head" in n]
    assert not [n for n in config("data.kind=text", *both).unused([16]) if "lm head" in n]
