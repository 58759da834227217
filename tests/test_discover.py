"""Discoverability: ``lengthgen --version``, ``--help`` pointing at ``lengthgen config show``, which prints every
key of a resolved config with its value, meaning and valid values, and ``help()`` of the config classes."""

from __future__ import annotations

import dataclasses
import pydoc
import re
from pathlib import Path

import pytest

from lengthgen.attention import PRESETS, AttentionSpec
from lengthgen.cli import build_parser, main
from lengthgen.config import describe
from lengthgen.data.config import DataConfig
from lengthgen.model.config import GPTConfig
from lengthgen.train.config import BemaConfig, RunConfig, TrainConfig, load_config, save_config
from lengthgen.version import __version__

ROOT = Path(__file__).resolve().parent.parent


def shown(capsys, *args: str) -> dict[str, tuple[str, str]]:
    """``lengthgen config show ARGS`` as {dotted key: (value, comment)}."""
    assert main(["config", "show", *args]) == 0
    keys, section = {}, ""
    for line in capsys.readouterr().out.splitlines():
        if m := re.fullmatch(r"\[([\w.]+)\]  # .+", line):
            section = m[1] + "."
        elif m := re.fullmatch(r"(?:# )?(\w+) = (.+?) +# (.+)", line):    # None: commented out
            keys[section + m[1]] = (m[2], m[3])
    return keys


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"lengthgen {__version__}"


@pytest.mark.parametrize("command", [None, "train", "compare"])
def test_help_points_to_config_show(command):
    parser = build_parser()
    if command:
        parser = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert "lengthgen config show" in parser.format_help()
    if command is None:                                         # the seeds cited by number, one line each
        assert all(f"{n:03d} " in parser.format_help() for n in range(5))


def test_help_shows_defaults_as_they_are_typed():
    """``bench --help`` showed a tuple, "(default (1024, 4096, 16384, 65536) on cuda ...)", for an option typed as
    1024,4096: no command's help shows a default as a Python tuple or list."""
    def helps(parser):
        yield parser.prog, " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action.choices, dict):                # the subcommands
                for sub in action.choices.values():
                    yield from helps(sub)

    texts = dict(helps(build_parser()))
    assert "lengthgen bench" in texts
    for prog, text in texts.items():
        assert not re.search(r"default:? [(\[]['\d]", text), (prog, text)
    assert "(default 1024,4096,16384,65536 on cuda, 256,512 on cpu)" in texts["lengthgen bench"]


def test_config_show_prints_every_key_with_value_meaning_and_choices(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    keys = shown(capsys, "counting", "--set", "model.attention=l2", "--set", "train.steps=7")
    leaves = {key: (what, doc) for key, what, _, doc in describe(RunConfig) if what != "a table"
              or key in ("data.task_kwargs", "data.text", "model.init_overrides", "compare")}
    assert set(keys) == set(leaves)
    for key, (what, doc) in leaves.items():
        assert keys[key][1] == f"{doc} [{what}]", key
    assert keys["train.steps"][0] == "7" and keys["model.attention.softmax_p"][0] == "2.0"
    assert keys["data.task"][0] == '"counting"' and keys["train.eval_lengths"][0] == "[32, 128]"
    assert keys["train.optimizer"][1].endswith("[one of adamw, adamw_palm, muon, normuon]")


def test_config_show_values_read_back_as_overrides(capsys, monkeypatch):
    """Every value ``config show`` prints is valid TOML for ``--set`` (quoted pattern keys too)."""
    monkeypatch.chdir(ROOT)
    keys = shown(capsys, "configs/seed000_avnorm.toml")
    cfg = load_config("configs/seed000_avnorm.toml")
    assert keys["train.muon_lr_mul"][0] == '{"blocks.*.attn.*_proj.weight" = 2.0, "blocks.*.mlp.proj.weight" = 4.0}'
    assert cfg.override(*(f"{key}={value}" for key, (value, _) in keys.items())) == cfg


@pytest.mark.parametrize("what", [None, "compare", "configs/seed000_avnorm.toml", "configs/seed001_counting.toml",
                                  "configs/seed003_dyck.toml"])
def test_config_show_output_loads_back_as_a_file(tmp_path, capsys, monkeypatch, what):
    """``config show > my.toml`` is a config file: keys set to none are commented out (TOML has no null), which
    reads back as none, every optional key's default."""
    monkeypatch.chdir(ROOT)
    assert main(["config", "show", *([what] if what else [])]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^# \w+ = none +# ", text, re.M) and not re.search(r"^\w+ = none", text, re.M)
    (tmp_path / "shown.toml").write_text(text)
    if what == "compare":
        from lengthgen.experiments.compare import base_config
        want = base_config(None, [])
    else:
        want = load_config(what) if what else RunConfig()
    assert load_config(tmp_path / "shown.toml") == want


def test_config_show_reads_run_folders_compare_and_attention(tmp_path, capsys, monkeypatch):
    save_config(RunConfig().override("train.lr=0.025", "model.attention.out_norm=head_rms"), tmp_path)
    keys = shown(capsys, str(tmp_path))
    assert keys["train.lr"][0] == "0.025" and keys["model.attention.out_norm"][0] == '"head_rms"'
    assert shown(capsys, "compare")["data.task"][0] == '"dyck"'
    monkeypatch.chdir(tmp_path)                                 # no configs/ here: names that are not files
    assert shown(capsys, "avnorm")["out_norm"][0] == '"head_layer"'
    assert main(["config", "show", "attention"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^{name} +\S", out, flags=re.M) for name in PRESETS)
    assert re.search(r'^l2 +softmax_p=2\.0$', out, flags=re.M)


def test_config_show_names_the_choices_of_a_bad_argument(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["config", "show", "no_such_config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'no_such_config' is not a config file" in err and "counting" in err
    assert "cpu/seed003_dyck" in err                     # the subfolders' configs too, by the name --config takes
    assert main(["config", "show", "counting", "--set", "train.lr=nan"]) == 2
    assert "train.lr=nan is not valid" in capsys.readouterr().err


def test_config_list_names_every_shipped_config_as_config_takes_it(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert main(["config", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert sorted(names) == sorted(p.relative_to(ROOT / "configs").with_suffix("").as_posix()
                                   for p in (ROOT / "configs").rglob("*.toml"))
    assert "cpu/seed000_avnorm" in names and names.index("seed000_avnorm") < names.index("cpu/seed000_avnorm")
    assert any(re.match(r"seed003_tomita +Seed 003 .*the Tomita grammars$", line) for line in lines)
    assert any(re.match(r"mqar +Multi-query associative recall \(Zoology, Arora et al\. 2023\): 8", line)
               for line in lines)
    assert main(["config", "show", "cpu/seed001_counting"]) == 0          # a listed name is a --config name
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert main(["config", "list"]) == 2 and "no configs/ folder" in capsys.readouterr().err


def test_config_show_takes_set_before_or_after_what(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    shown = []
    for args in (["counting", "--set", "model.dim=24"], ["--set", "model.dim=24", "counting"]):
        assert main(["config", "show", *args]) == 0
        shown.append(capsys.readouterr().out)
    assert shown[0] == shown[1] and re.search(r"^dim = 24 ", shown[0], flags=re.M)


@pytest.mark.parametrize("what", ["l2", "attention"])
def test_config_show_of_a_spec_with_set_points_to_a_command_that_works(capsys, monkeypatch, tmp_path, what):
    """``config show l2 --set model.attention.softmax_p=3`` was refused with 'for attention use --set
    model.attention.FIELD=VALUE', the very --set it had refused; the error now names a command that shows it."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", what, "--set", "model.attention.softmax_p=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    suggested = re.search(r"lengthgen (config show .*?model\.attention\.FIELD=VALUE)", err)
    assert suggested, err
    argv = suggested[1].replace("FIELD=VALUE", "softmax_p=3").split()
    assert shown(capsys, *argv[2:])["model.attention.softmax_p"][0] == "3.0"
    preset = shown(capsys, *argv[2:-2])["model.attention.softmax_p"][0]      # without the change: the preset's
    assert preset == ("2.0" if what == "l2" else "1.0")


@pytest.mark.parametrize("cls", [AttentionSpec, GPTConfig, TrainConfig, BemaConfig, RunConfig, DataConfig])
def test_help_documents_every_field(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for f in dataclasses.fields(cls):
        line = next((l for l in text.splitlines() if re.match(rf"\W*{f.name}: ", l)), None)
        assert line and f.metadata["doc"] in line, (cls.__name__, f.name)
    assert "softmax_p: p-softmax power" in pydoc.render_doc(AttentionSpec, renderer=pydoc.plaintext)


@pytest.mark.parametrize("command", [["config", "show"], ["train", "--out", "never-made"]])
@pytest.mark.parametrize("key, message", [
    ("data.task_kwargs.vocab_sz=3", "data.task_kwargs.vocab_sz is not a valid key"),
    ("compare.seedz=3", "compare.seedz is not a valid key")])
def test_config_show_and_train_refuse_what_the_run_would_refuse(capsys, command, key, message):
    """config show printed a config that train refuses; train accepted a [compare] section's typos."""
    from lengthgen.cli import main

    assert main([*command, "--set", key]) == 2
    assert message in capsys.readouterr().err


def test_help_states_the_defaults_the_code_uses():
    """eval --help gave only a run's default lengths, not the 256,1024 of --hf; retrofit --help left out control/."""
    import inspect

    from lengthgen.hf.eval import evaluate_hf, needle_hf

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    text = {name: " ".join(commands[name].format_help().split()) for name in ("eval", "needle", "retrofit")}
    for name, function in (("eval", evaluate_hf), ("needle", needle_hf)):
        default = ",".join(map(str, inspect.signature(function).parameters["lengths"].default))
        assert f"with --hf {default})" in text[name], name
    assert "finetune/ and control/" in text["retrofit"]
