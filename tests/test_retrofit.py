"""`lengthgen retrofit`: loading a checkpoint into a model whose attention spec adds parameters, finetuning,
and the before/after report."""

from __future__ import annotations

import json

import pytest
import torch

from lengthgen.cli import main
from lengthgen.config import ConfigError
from lengthgen.train.config import RunConfig
from lengthgen.model import GPT
from lengthgen.eval import Comparison
from lengthgen.experiments.retrofit import finetune_config, run_retrofit
from lengthgen.train import Trainer, load_run, train
from lengthgen.train.weights import load_initial_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny counting run (a few steps)."""
    cfg = RunConfig().override("model.dim=32", "model.layers=2", "model.heads=2", "model.mlp_ratio=2.0",
                               "train.steps=6", "train.lr=3e-3", "train.batch_size=8", "train.eval_batches=1",
                               "train.eval_batch_size=4", "data.task=counting", "data.task_kwargs={vocab_size = 2}",
                               "data.length=16", "train.eval_lengths=[16]")
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(cfg, run, progress=False)
    return run


def _outputs(model, seed=0):
    tokens = torch.randint(2, (3, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(tokens)


def test_gated_2sigmoid_gate_keeps_outputs_identical_before_finetuning(checkpoint, tmp_path):
    base, before = load_run(checkpoint)
    cfg = finetune_config(base, checkpoint, steps=2, overrides=["model.attention.gate=elementwise",
                                                                "model.attention.gate_act=2sigmoid"])
    trainer = Trainer(cfg, tmp_path / "ft", progress=False)   # train.init_from loads the checkpoint
    added = trainer.initialized_from["added"]
    assert added == [f"blocks.{i}.attn.gate.weight" for i in range(2)]
    assert all(float(trainer.model.blocks[i].attn.gate.weight.detach().abs().max()) == 0 for i in range(2))
    torch.testing.assert_close(_outputs(trainer.model), _outputs(before), rtol=0, atol=0)
    # the finetuning then moves the new gate
    result = trainer.fit()
    assert result.step == 2 and float(result.model.blocks[0].attn.gate.weight.detach().abs().max()) > 0


def test_changes_beyond_added_attention_parameters_are_named_on_one_line(checkpoint):
    base, _ = load_run(checkpoint)
    cfg = base.override("model.attention.kv_heads=1", "model.attention.qk_norm=rms")
    with pytest.raises(ConfigError) as err:
        load_initial_weights(GPT(cfg.model), checkpoint)
    message = str(err.value)
    # both layers' k and v projections change shape (the first three named); the added QK-norm weights are not
    # complaints
    for i, proj in [(0, "k_proj"), (0, "v_proj"), (1, "k_proj")]:
        assert f"blocks.{i}.attn.{proj}.weight: checkpoint shape (32, 32), model (16, 32)" in message
    assert "; and 1 more); keep the checkpoint's model shape" in message and "\n" not in message
    assert "q_norm_weight" not in message
    wider = base.override("model.mlp_ratio=4.0")
    with pytest.raises(ConfigError, match=r"blocks\.0\.mlp\..*checkpoint shape"):
        load_initial_weights(GPT(wider.model), checkpoint)
    removed = RunConfig.from_dict({**base.to_dict(), "model": {**base.to_dict()["model"], "layers": 1}})
    with pytest.raises(ConfigError, match=r"blocks\.1\.attn\.q_proj\.weight: in the checkpoint, not in the model"):
        load_initial_weights(GPT(removed.model), checkpoint)


def test_retrofit_out_norm_writes_the_report(checkpoint, tmp_path, capsys):
    out = tmp_path / "retrofit"
    code = main(["retrofit", str(checkpoint), "--set", "model.attention.out_norm=head_layer",
                 "--set", "model.attention.out_norm_affine=true", "--steps", "3", "--eval-lengths", "16,32",
                 "--eval-tokens", "64", "--out", str(out), "--no-progress"])
    assert code == 0
    for name in ("results.json", "report.md", "extrapolation.png", "diagnostics.png"):
        assert (out / name).is_file(), name
    results = Comparison.load(out / "results.json")
    assert list(results.variants) == ["before", "control", "after"]
    assert results.specs["before"]["out_norm"] == "none" and results.specs["after"]["out_norm"] == "head_layer"
    assert results.specs["control"] == results.specs["before"]
    # the control: the checkpoint's model, finetuned exactly as `after` (steps, optimizer, schedule, data seeds)
    (before,), (control,), (after,) = results.variants.values()
    assert control.config["model"] == before.config["model"] != after.config["model"]
    assert control.config["train"] == after.config["train"] and control.config["data"] == after.config["data"]
    assert control.config["train"]["init_from"] == after.config["train"]["init_from"] == results.retrofit["checkpoint"]
    assert json.loads((out / "control" / "latest.json").read_text())["step"] == 3
    assert control.train_tokens == after.train_tokens == 3 * 8 * 16
    assert results.retrofit["added_parameters"] == [f"blocks.{i}.attn.{p}" for i in range(2)
                                                    for p in ("out_norm.weight", "out_norm.bias")]
    assert [row.length for row in results.variants["after"][0].lengths] == [16, 32]
    assert results.title == "lengthgen retrofit: counting"
    assert json.loads((out / "finetune" / "latest.json").read_text())["step"] == 3
    report = (out / "report.md").read_text()
    assert report.startswith("# lengthgen retrofit: counting") and "model.attention.out_norm=head_layer" in report
    change = [after.at(n).at_length["abs_error"] - control.at(n).at_length["abs_error"] for n in (16, 32)]
    assert f"| abs_error: after - control (the change) | {change[0]:+.4g} | {change[1]:+.4g} |" in report
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed


def test_retrofit_command_errors(checkpoint, tmp_path, capsys):
    assert main(["retrofit", str(tmp_path / "missing"), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "no run folder or checkpoint" in capsys.readouterr().err
    assert main(["retrofit", str(checkpoint), "--set", "model.dim=64", "--steps", "1",
                 "--out", str(tmp_path / "o2")]) == 2
    assert "cannot initialize from" in capsys.readouterr().err
    assert main(["retrofit", str(checkpoint), "--set", "train.lr=1e-3", "--steps", "1",
                 "--out", str(tmp_path / "o3")]) == 2
    assert "leave the model as it is, so the retrofit would equal its control" in capsys.readouterr().err
    assert main(["retrofit", str(checkpoint), "--set", "model.attention.out_norm=head_layer", "--set", "train.steps=9",
                 "--steps", "1", "--out", str(tmp_path / "o4")]) == 2
    assert "--set train.steps=9: the finetuning steps are --steps" in capsys.readouterr().err
    # were silently ignored (init_from) or trained other steps than the report says (a train table)
    for change, message in (("train.init_from=/elsewhere", "--set train.init_from=/elsewhere: the retrofit starts "
                                                           "from its checkpoint argument"),
                            ("train={steps=9}", "--set train={steps=9}: the finetuning steps are --steps (a train "
                                                "table sets every train key")):
        assert main(["retrofit", str(checkpoint), "--set", "model.attention.out_norm=head_layer", "--set", change,
                     "--steps", "1", "--out", str(tmp_path / "o4")]) == 2
        assert message in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("o3", "o4"))
    # data.* overrides the checkpoint's model does not fit: one line before any evaluation, not a tensor error
    for changes, message in ((["data.task=dyck", "data.task_kwargs={}"], "model.head='regress' does not fit the "
                                                                          "data: 'dyck' needs head"),
                             (["data.task_kwargs.vocab_size=64"], "model.vocab_size=2 is smaller than the data's")):
        sets = [arg for change in changes for arg in ("--set", change)]
        assert main(["retrofit", str(checkpoint), *sets, "--set", "model.attention.out_norm=head_layer",
                     "--steps", "1", "--out", str(tmp_path / "o5")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and not (tmp_path / "o5").exists()


def test_control_is_the_same_finetuning_without_the_change(checkpoint, tmp_path):
    """With a model change that changes no output (the eps of an unused out-norm), `after` and `control` are the
    same run: same batches, optimizer and schedule."""
    results = run_retrofit(checkpoint, tmp_path / "r", overrides=["train.lr=1e-3", "model.attention.out_norm_eps=0.1"],
                           steps=2, eval_lengths=[16, 32], eval_tokens=64, diagnostics=False, progress=False,
                           log=lambda _: None)
    (control,), (after,) = results.variants["control"], results.variants["after"]
    assert control.config["train"]["lr"] == after.config["train"]["lr"] == 1e-3
    assert [r.at_length for r in control.lengths] == [r.at_length for r in after.lengths]
    assert control.final_train_loss == after.final_train_loss
    assert [r.at_length for r in control.lengths] != [r.at_length for r in results.variants["before"][0].lengths]


def test_retrofit_evaluates_in_forward_passes_no_larger_than_the_trainers(checkpoint, tmp_path, monkeypatch):
    """Its evaluations, like compare's and eval's, pass at most train.eval_batch_size (4) x training length (16)
    tokens at once: memory does not grow with eval_tokens."""
    rows = []
    features = GPT.features
    monkeypatch.setattr(GPT, "features", lambda self, tokens, *a, **k: (   # the evaluations' passes (no grad)
        torch.is_grad_enabled() or rows.append(tuple(tokens.shape)), features(self, tokens, *a, **k))[1])
    results = run_retrofit(checkpoint, tmp_path / "r", overrides=["model.attention.out_norm=head_rms"], steps=1,
                           eval_lengths=[16, 32], eval_tokens=512, diagnostics=False, progress=False,
                           log=lambda _: None)
    assert [r.batch_size for r in results.variants["before"][0].lengths] == [32, 16]
    assert rows and max(n * length for n, length in rows) <= 4 * 16


def test_a_retrofit_whose_finetuning_diverges_is_reported_as_diverged(checkpoint, tmp_path, capsys, monkeypatch):
    """`after` diverging ended the retrofit with status 1 and no report, losing `before`'s and the control's
    evaluations, where compare records a diverged run as the worst value and finishes. It is now evaluated as
    compare's diverged runs are: +inf loss at every length, the report saying why, the added parameters named."""
    original = GPT.loss

    def loss(self, output, batch):      # the retrofitted model only
        value, per = original(self, output, batch)
        return (value * float("nan"), per) if self.config.attention.out_norm != "none" else (value, per)

    monkeypatch.setattr(GPT, "loss", loss)
    out = tmp_path / "retrofit"
    code = main(["retrofit", str(checkpoint), "--set", "model.attention.out_norm=head_layer",
                 "--set", "model.attention.out_norm_affine=true", "--steps", "2", "--eval-lengths", "16,32",
                 "--eval-tokens", "64", "--out", str(out), "--no-progress"])
    assert code == 0
    results = Comparison.load(out / "results.json")
    (before,), (control,), (after,) = results.variants.values()
    assert after.diverged == "training loss is nan at step 0" and control.diverged is None
    assert all(after.at(n).at_length["loss"] == float("inf") > control.at(n).at_length["loss"] for n in (16, 32))
    assert after.config["model"]["attention"]["out_norm"] == "head_layer" and after.train_seconds is None
    assert results.retrofit["added_parameters"] == [f"blocks.{i}.attn.{p}" for i in range(2)
                                                    for p in ("out_norm.weight", "out_norm.bias")]
    report = (out / "report.md").read_text()
    assert "after seed 0 (training loss is nan at step 0)" in report and "| abs_error: after - control (the change) " \
        "| +inf | +inf |" in report
    assert "[after] diverged (training loss is nan at step 0)" in capsys.readouterr().out
