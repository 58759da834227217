"""Run configs: TOML presets, --set overrides, clear errors naming the full key, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lengthgen.attention import PRESETS
from lengthgen.cli import COMMANDS, main
from lengthgen.config import ConfigError, RunConfig, load_config, parse_value

ROOT = Path(__file__).resolve().parents[1]


def test_presets_load():
    counting = load_config(ROOT / "configs" / "counting.toml")
    assert counting.data.task == "counting" and counting.model.attention == PRESETS["baseline"]
    mqar = load_config(ROOT / "configs" / "mqar.toml")
    assert mqar.data.task == "mqar"
    for cfg in (counting, mqar):
        assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg      # JSON round trip


def test_overrides():
    cfg = load_config(ROOT / "configs" / "counting.toml", [
        "model.attention=l2", "model.attention.out_norm=head_rms", "model.attention.window=none",
        "train.steps=7", "train.lr=1e-2", "train.stages=[[0, 16], [3, 32]]", "train.qk_clip=50",
        "train.bema.enabled=true", "model.logit_cap=none", "data.task_kwargs.vocab_size=8",
        "model.layer_attention=[{every = 2, spec = \"nope\"}]", "name=x y"])
    assert cfg.model.attention == PRESETS["l2"].replace(out_norm="head_rms")
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01 and cfg.train.stages == [[0, 16], [3, 32]]
    assert cfg.train.qk_clip == 50.0 and cfg.train.bema.enabled and cfg.model.logit_cap is None
    assert cfg.data.task_kwargs == {"vocab_size": 8}
    assert cfg.model.layer_specs()[0] == PRESETS["nope"]
    assert cfg.name == "x y"
    assert cfg.length_at(0) == 16 and cfg.length_at(2) == 16 and cfg.length_at(3) == 32
    # a table value picks a preset with changes
    cfg = RunConfig().override("model.attention={preset = \"avnorm\", window = 8}")
    assert cfg.model.attention == PRESETS["avnorm"].replace(window=8)
    assert parse_value("l2") == "l2" and parse_value("3") == 3 and parse_value("[1, 2]") == [1, 2]


@pytest.mark.parametrize("assignment, pieces", [
    ("model.foo=1", ["'model.foo'", "valid keys under 'model'", "norm_placement"]),
    ("foo=1", ["'foo'", "model, train, data, name"]),
    ("train.bema.speed=1", ["'train.bema.speed'", "kappa"]),
    ("model.attention.foo=1", ["'model.attention.foo'", "softmax_p", "out_norm"]),
    ("model.norm=group", ["model.norm='group'", "layer, rms, batch"]),
    ("model.norm_placement=middle", ["model.norm_placement", "pre, post, peri, hybrid, hybrid_star, mix"]),
    ("model.attention.out_norm=bogus", ["model.attention.out_norm", "AttentionSpec.out_norm='bogus'",
                                        "head_layer"]),
    ("model.attention=bogus", ["model.attention", "unknown attention preset", "baseline", "l2"]),
    ("train.optimizer=sgd", ["train.optimizer='sgd'", "adamw, muon"]),
    ("train.steps=abc", ["train.steps='abc'", "integer"]),
    ("train.steps=1.5", ["train.steps=1.5", "integer"]),
    ("train.lr=fast", ["train.lr='fast'", "number"]),
    ("train.compile=yes", ["train.compile='yes'", "true or false"]),
    ("train.stages=[[5, 32], [1, 64]]", ["train.stages", "increasing"]),
    ("model.dim=0", ["model.dim=0", ">= 1"]),
    ("train.steps", ["key=value"]),
])
def test_config_errors_name_the_key(assignment, pieces):
    with pytest.raises(ConfigError) as info:
        RunConfig().override(assignment)
    for piece in pieces:
        assert piece in str(info.value), (piece, str(info.value))


def test_toml_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndim = 32\nwidth = 3\n")
    with pytest.raises(ConfigError, match=r"'model\.width'.*valid keys"):
        load_config(path)
    path.write_text("[train.bema]\nkappa = \"x\"\n")
    with pytest.raises(ConfigError, match=r"train\.bema\.kappa='x'"):
        load_config(path)
    path.write_text("[model]\nattention = {preset = \"l2\", out_norm = \"nope\"}\n")
    with pytest.raises(ConfigError, match=r"model\.attention: AttentionSpec\.out_norm"):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="nosuch.toml"):
        load_config(tmp_path / "nosuch.toml")


def test_bad_task_and_kwargs_fail_before_training(tmp_path):
    from lengthgen.train import train

    for assignment, piece in (("data.task=nosuch", "data.task"), ("data.task_kwargs.colour=1", "colour"),
                              ("data.length=100000", "maximum length")):
        cfg = load_config(ROOT / "configs" / "mqar.toml", [assignment])
        with pytest.raises(ConfigError, match=piece):
            train(cfg, tmp_path / "run", progress=False)
        assert not (tmp_path / "run" / "checkpoints").exists()
    cfg = load_config(ROOT / "configs" / "counting.toml", ["model.head=lm"])
    with pytest.raises(ConfigError, match="needs head 'regress'"):
        train(cfg, tmp_path / "run", progress=False)


def test_cli_train_and_errors(tmp_path, capsys):
    assert {"train"} <= set(COMMANDS)
    out = tmp_path / "cli"
    code = main(["train", "--config", str(ROOT / "configs" / "counting.toml"), "--set", "model.attention=l2",
                 "--set", "train.steps=3", "--set", "model.dim=16", "--set", "model.layers=1",
                 "--set", "train.eval_lengths=[16]", "--set", "data.length=16", "--out", str(out), "--no-progress"])
    assert code == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["attention"]["softmax_p"] == 2.0 and saved["train"]["steps"] == 3
    assert "trained 3 steps" in capsys.readouterr().out
    code = main(["train", "--config", str(ROOT / "configs" / "counting.toml"), "--set", "model.nrom=rms",
                 "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.nrom" in err and "valid keys" in err
    # the folder now holds a run: training again without --resume is refused, --resume continues (no-op here)
    assert main(["train", "--config", str(out / "config.json"), "--out", str(out), "--no-progress"]) == 2
    assert "resume" in capsys.readouterr().err
    assert main(["train", "--config", str(out / "config.json"), "--out", str(out), "--resume",
                 "--no-progress"]) == 0
