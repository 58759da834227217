"""Run configs: TOML presets, --set overrides, one checker with errors naming the full key, the CLI, a fuzz."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lengthgen.attention import PRESETS, AttentionSpec
from lengthgen.attention.backends import BACKENDS
from lengthgen.cli import COMMANDS, main
from lengthgen.config import ConfigError, check, check_value, describe, option, parse_value, set_key
from lengthgen.data.config import DataConfig
from lengthgen.data.tasks import TASKS, TaskName
from lengthgen.model.config import Backend, GPTConfig
from lengthgen.train.config import BemaConfig, RunConfig, TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (RunConfig, GPTConfig, AttentionSpec, TrainConfig, BemaConfig, DataConfig)


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
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01 and cfg.train.stages == [(0, 16), (3, 32)]
    assert cfg.train.qk_clip == 50.0 and isinstance(cfg.train.qk_clip, float)     # an int converted
    assert cfg.train.bema.enabled and cfg.model.logit_cap is None
    assert cfg.data.task_kwargs == {"vocab_size": 8}
    assert cfg.model.layer_specs()[0] == PRESETS["nope"]
    assert cfg.name == "x y"
    assert cfg.length_at(0) == 16 and cfg.length_at(2) == 16 and cfg.length_at(3) == 32
    # a table value picks a preset with changes
    cfg = RunConfig().override("model.attention={preset = \"avnorm\", window = 8}")
    assert cfg.model.attention == PRESETS["avnorm"].replace(window=8)
    assert parse_value("l2") == "l2" and parse_value("3") == 3 and parse_value("[1, 2]") == [1, 2]


def test_with_preset_applies_a_preset_on_top_of_a_spec():
    base = AttentionSpec(position="nope", window=32)
    assert base.with_preset("l2") == base.replace(softmax_p=2.0)
    assert base.with_preset("baseline") == base
    assert AttentionSpec().with_preset("avnorm") == PRESETS["avnorm"]
    assert PRESETS["ssmax"].with_preset("sqrt_log_n") == PRESETS["sqrt_log_n"]   # the preset's fields win


def test_set_preset_inside_the_attention_table_is_the_preset_on_top():
    """``--set model.attention.preset=l2`` once did nothing: the resolved table's explicit softmax_p = 1 hid the
    preset. It is now compare's variant l2 (NoPE stays NoPE); ``model.attention=l2`` stays the whole preset."""
    nope = RunConfig().override("model.attention.position=nope")
    on_top = nope.override("model.attention.preset=l2")
    assert on_top.model.attention == PRESETS["l2"].replace(position="nope")
    assert nope.override("model.attention=l2").model.attention == PRESETS["l2"]
    assert RunConfig().override("model.attention=ssmax", "model.attention.preset=l2").model.attention == \
        PRESETS["ssmax"].replace(softmax_p=2.0)
    # the same spec as compare's variant of that name, which is what a comparison's run of it trains
    from lengthgen.experiments.compare import apply_variant
    assert apply_variant(nope, "l2", None, "compare.variants.l2") == on_top
    # and a compare variant's change table that names the preset (it trained baseline attention)
    assert apply_variant(nope, "x", {"model": {"attention": {"preset": "l2"}}}, "compare.variants.x") == on_top
    with pytest.raises(ConfigError, match="model.attention: unknown attention preset 'l3'; choose one of baseline"):
        nope.override("model.attention.preset=l3")
    # in any order with other keys, also while the table is briefly invalid (learnable scaling before the scaling)
    keys = ["model.attention.learnable_scaling=global", "model.attention.preset=l2",
            "model.attention.query_scaling=log_n"]
    want = PRESETS["l2"].replace(learnable_scaling="global", query_scaling="log_n")
    for order in (keys, keys[::-1], [keys[1], keys[0], keys[2]]):
        assert RunConfig().override(*order).model.attention == want, order


def test_keys_with_dots_inside_quotes_are_one_part():
    """A parameter pattern holds dots: quoted in --set, a key of its own in a compare variant's table (where the
    key-by-key merge once split it and refused the variant)."""
    from lengthgen.experiments.compare import apply_variant
    cfg = RunConfig().override('train.adam_lr_mul."embed.*"=2.0', 'model.init_overrides."blocks.*.mlp.proj.weight"=0')
    assert cfg.train.adam_lr_mul == {"embed.*": 2.0} and cfg.model.init_overrides == {"blocks.*.mlp.proj.weight": 0}
    table = {"train": {"adam_lr_mul": {"head.*": 3.0}}, "model": {"init_overrides": {"blocks.*.attn.o_proj.weight": 0}}}
    out = apply_variant(cfg, "x", table, "compare.variants.x")
    assert out.train.adam_lr_mul == {"embed.*": 2.0, "head.*": 3.0}            # tables merge, as before
    assert out.model.init_overrides == {"blocks.*.mlp.proj.weight": 0, "blocks.*.attn.o_proj.weight": 0}


@pytest.mark.parametrize("assignment, message", [
    ("model.foo=1", "model.foo is not a valid key; valid keys: vocab_size, dim, layers, heads"),
    ("foo=1", "foo is not a valid key; valid keys: model, train, data, name"),
    ("train.bema.speed=1", "train.bema.speed is not a valid key; valid keys: enabled, kappa"),
    ("model.attention.foo=1", "model.attention: unknown AttentionSpec field(s) ['foo']; valid fields: softmax_p"),
    ("model.norm=group", "model.norm='group' is not valid; it must be one of layer, rms, batch"),
    ("model.norm_placement=middle", "model.norm_placement='middle' is not valid; it must be one of pre, post, "
                                    "peri, hybrid, hybrid_star, mix"),
    ("model.attention.out_norm=bogus", "model.attention.out_norm='bogus' is not valid; it must be one of none, "
                                       "head_layer, head_rms, global_layer, global_rms"),
    ("model.attention=bogus", "model.attention: unknown attention preset 'bogus'; choose one of baseline, l2"),
    ("model.attention.learnable_scaling=head", "model.attention.learnable_scaling='head' needs query_scaling"),
    ("model.heads=3", "model.heads=3 is not valid; it must be a divisor of dim=128"),
    ("model.layer_attention=[{every = 0, spec = \"nope\"}]",
     "model.layer_attention[0].every=0 is not valid; it must be an integer >= 1"),
    ("model.layer_attention=[{every = 2, spec = {window = 0}}]",
     "model.layer_attention[0].spec.window=0 is not valid; it must be an integer in [1, 2147483647], or none"),
    ("train.optimizer=sgd", "train.optimizer='sgd' is not valid; it must be one of adamw, adamw_palm, muon"),
    ("train.steps=abc", "train.steps='abc' is not valid; it must be an integer >= 1"),
    ("train.steps=1.5", "train.steps=1.5 is not valid; it must be an integer >= 1"),
    ("train.lr=fast", "train.lr='fast' is not valid; it must be a finite float32 number >= 0"),
    ("train.lr=nan", "train.lr=nan is not valid; it must be a finite float32 number >= 0"),
    ("train.lr=-inf", "train.lr=-inf is not valid; it must be a finite float32 number >= 0"),
    ("train.lr=1e39", "train.lr=1e+39 is not valid; it must be a finite float32 number >= 0"),   # AdamW overflowed
    ("train.seed=18446744073709551617", "train.seed=18446744073709551617 is not valid; it must be an integer in "
                                        "[0, 9223372036854775807]"),                           # torch.manual_seed
    ("train.qk_clip=0", "train.qk_clip=0 is not valid; it must be a finite float32 number > 0, or none"),
    ("train.compile=yes", "train.compile='yes' is not valid; it must be true or false"),
    ("train.compile=1", "train.compile=1 is not valid; it must be true or false"),
    ("train.betas=[0.9, 1.0]", "train.betas[1]=1.0 is not valid; it must be a finite float32 number in [0, 1)"),
    ("train.betas=[0.9]", "train.betas=[0.9] is not valid; it must be a list of 2 items, each a finite float32 number"),
    ("train.eval_lengths=[16, 0]", "train.eval_lengths[1]=0 is not valid; it must be an integer in [1, 2147483647]"),
    ("train.stages=[[5, 32], [1, 64]]", "train.stages=[(5, 32), (1, 64)] is not valid; it must be a list of "
                                        "[step, length] pairs with increasing steps"),
    ("train.bema=3", "train.bema=3 is not valid; it must be a table with keys enabled, kappa"),
    ("data.task=nosuch", "data.task='nosuch' is not valid; it must be one of counting, set_complement"),
    ("data.task_kwargs=[1]", "data.task_kwargs=[1] is not valid; it must be a table"),
    ("model.dim=0", "model.dim=0 is not valid; it must be an integer in [1, 2147483647]"),
    ("train.steps", "override 'train.steps' is not valid; write key=value"),
    ("model..dim=3", "override 'model..dim=3' is not valid; write key=value"),
])
def test_config_errors_name_the_key(assignment, message):
    with pytest.raises(ConfigError) as info:
        RunConfig().override(assignment)
    assert str(info.value).startswith(message), str(info.value)


def test_toml_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndim = 32\nwidth = 3\n")
    with pytest.raises(ConfigError, match=r"^model\.width is not a valid key; valid keys: vocab_size"):
        load_config(path)
    path.write_text("[train.bema]\nkappa = \"x\"\n")
    with pytest.raises(ConfigError,
                       match=r"^train\.bema\.kappa='x' is not valid; it must be a finite float32 number >= 0$"):
        load_config(path)
    path.write_text("[model]\nattention = {preset = \"l2\", out_norm = \"nope\"}\n")
    with pytest.raises(ConfigError, match=r"^model\.attention\.out_norm='nope' is not valid; it must be one of"):
        load_config(path)
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="bad.toml: invalid TOML"):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="nosuch.toml"):
        load_config(tmp_path / "nosuch.toml")


def test_python_construction_names_the_class():
    with pytest.raises(ConfigError,
                       match=r"^TrainConfig\.lr=nan is not valid; it must be a finite float32 number >= 0$"):
        TrainConfig(lr=math.nan)
    with pytest.raises(ConfigError, match=r"^TrainConfig\.bema\.rho=-1 is not valid"):
        TrainConfig(bema={"rho": -1})
    with pytest.raises(ConfigError, match=r"^RunConfig\.model\.attention\.softmax_p=0 is not valid"):
        RunConfig(model={"attention": {"softmax_p": 0}})
    assert TrainConfig(bema={"kappa": 1}).bema == BemaConfig(kappa=1.0)



def test_p_and_tau_are_refused_where_float32_logits_times_them_overflow():
    """p x logit (flex's LSE_p) overflowed float32 at p ~ 1e37 and a subnormal p gave a wrong output; t / tau
    overflowed below tau ~ 1e-32 (NaN on dense and flex): both are refused with their range."""
    for field, value, bound in (("softmax_p", 1e37, r"in \[0.001, 1000\]"), ("softmax_p", 1e-45, "0.001"),
                                ("tau", 1e-33, ">= 0.001")):
        with pytest.raises(ConfigError, match=rf"^AttentionSpec\.{field}=.* is not valid; .*{bound}"):
            AttentionSpec(**{field: value})
    assert AttentionSpec(softmax_p=1e3, tau=1e-3).softmax_p == 1e3

def test_bad_task_and_kwargs_fail_before_training(tmp_path):
    from lengthgen.train import train

    for assignment, message in (
            ("data.task_kwargs.colour=1", "data.task_kwargs.colour is not a valid key; valid keys: vocab_size"),
            ("data.task_kwargs.vocab_size=3",
             "data.task_kwargs.vocab_size=3 is not valid; it must be an integer in [4, 2147483647]"),
            ("data.length=100000", "data.length: length 100000 exceeds the data's maximum length")):
        cfg = load_config(ROOT / "configs" / "mqar.toml", [assignment])
        with pytest.raises(ConfigError) as info:
            train(cfg, tmp_path / "run", progress=False)
        assert str(info.value).startswith(message), str(info.value)
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


# ---------------------------------------------------------------------------------------------------
# the checker itself


@pytest.mark.parametrize("value, hint, bounds, out", [
    (3, float, {}, 3.0), (True, bool, {}, True), (2, int, {"ge": 2}, 2), ("a", Literal["a", "b"], {}, "a"),
    (None, int | None, {"ge": 1}, None), (4, int | None, {"ge": 1}, 4),
    ([1, 2.5], list[float], {"gt": 0}, [1.0, 2.5]), ([1, 2], tuple[int, int], {}, (1, 2)),
    ({"a": [1]}, dict[str, Any], {}, {"a": [1]}), (0.5, float, {"gt": 0, "lt": 1}, 0.5),
])
def test_check_value_accepts_and_converts(value, hint, bounds, out):
    got = check_value("k", value, hint, **bounds)
    assert got == out and type(got) is type(out)


@pytest.mark.parametrize("value, hint, bounds, message", [
    (True, int, {}, "k=True is not valid; it must be an integer"),
    (1, bool, {}, "k=1 is not valid; it must be true or false"),
    (1.0, int, {"ge": 0}, "k=1.0 is not valid; it must be an integer >= 0"),
    (math.inf, float, {}, "k=inf is not valid; it must be a finite float32 number"),
    (math.nan, float, {"le": 1}, "k=nan is not valid; it must be a finite float32 number <= 1"),
    (10**400, float, {}, f"k={10**400!r} is not valid; it must be a finite float32 number"),
    (0, float, {"gt": 0, "le": 1}, "k=0 is not valid; it must be a finite float32 number in (0, 1]"),
    (1, float, {"ge": 0, "lt": 1}, "k=1 is not valid; it must be a finite float32 number in [0, 1)"),
    (5, int, {"lt": 5}, "k=5 is not valid; it must be an integer < 5"),
    (1, Literal["1", "2"], {}, "k=1 is not valid; it must be one of 1, 2"),
    (True, Literal[1, 2], {}, "k=True is not valid; it must be one of 1, 2"),
    ("x", int | None, {}, "k='x' is not valid; it must be an integer, or none"),
    ([1, -1], list[int], {"ge": 0}, "k[1]=-1 is not valid; it must be an integer >= 0"),
    ((1, 2, 3), tuple[int, int], {}, "k=(1, 2, 3) is not valid; it must be a list of 2 items, each an integer"),
    ({1: 2}, dict[str, Any], {}, "k={1: 2} is not valid; it must be a table"),
    ("s", list[int], {}, "k='s' is not valid; it must be a list, each item an integer"),
    ({"kappa": "x"}, BemaConfig, {}, "k.kappa='x' is not valid; it must be a finite float32 number >= 0"),
    ({"x": 1}, BemaConfig, {},
     "k.x is not a valid key; valid keys: enabled, kappa, eta, rho, gamma, tau, update_every"),
])
def test_check_value_rejects_naming_the_key(value, hint, bounds, message):
    with pytest.raises(ConfigError) as info:
        check_value("k", value, hint, **bounds)
    assert str(info.value) == message and info.value.key == message.partition("=")[0].partition(" ")[0]


def test_error_under_replaces_the_owner():
    err = ConfigError("AttentionSpec.window=0 is not valid; it must be ...", "AttentionSpec.window")
    nested = err.under("GPTConfig.attention").under("model")
    assert str(nested) == "model.attention.window=0 is not valid; it must be ..."
    assert nested.key == "model.attention.window"
    assert str(err.under("")) == "window=0 is not valid; it must be ..."
    keyless = ConfigError("unknown attention preset 'x'").under("GPTConfig.attention").under("model")
    assert str(keyless) == "model.attention: unknown attention preset 'x'"


def test_mutable_defaults_are_not_shared():
    a, b = TrainConfig(), TrainConfig()
    a.eval_lengths.append(3)
    a.bema.enabled = True
    assert b.eval_lengths == [] and not b.bema.enabled


def test_check_converts_frozen_and_plain_dataclasses():
    @dataclasses.dataclass(frozen=True)
    class Small:
        rate: float = option(1, "a rate", gt=0)

        def __post_init__(self) -> None:
            check(self)

    assert type(Small().rate) is float and Small(rate=2).rate == 2.0
    with pytest.raises(ConfigError, match=r"^Small\.rate=0 is not valid; it must be a finite float32 number > 0$"):
        Small(rate=0)


def test_set_key_converts_only_none_words():
    data = set_key({"model": {"dim": 8}}, "model.logit_cap", "none", RunConfig)
    assert data == {"model": {"dim": 8, "logit_cap": None}}
    assert set_key({}, "model.mlp", "none", RunConfig) == {"model": {"mlp": "none"}}     # not optional: kept
    assert set_key({}, "model.attention.window", "null", RunConfig) == {"model": {"attention": {"window": None}}}
    assert set_key({}, "data.task_kwargs.x.y", 1, RunConfig) == {"data": {"task_kwargs": {"x": {"y": 1}}}}


def test_every_field_is_documented_and_described():
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no one-line meaning"
    rows = {key: (what, default, doc) for key, what, default, doc in describe(RunConfig)}
    assert rows["train.lr"] == ("a finite float32 number >= 0", 1e-3, "peak AdamW learning rate")
    assert rows["train.bema.kappa"][0] == "a finite float32 number >= 0"
    assert rows["model.attention.out_norm"][0] == "one of none, head_layer, head_rms, global_layer, global_rms"
    assert rows["model.head"][0] == "one of lm, regress, classify, or none"
    assert rows["data.task"][1] == "counting" and rows["train.stages"][1] == []
    assert len(rows) == sum(len(dataclasses.fields(c)) for c in CONFIGS)      # every field, once


def test_choice_types_match_their_registries():
    assert typing.get_args(Backend) == BACKENDS
    assert set(typing.get_args(TaskName)) == set(TASKS)


# ---------------------------------------------------------------------------------------------------
# fuzz: any config either builds or raises ConfigError naming a key


def _choices(hint: Any) -> set[str]:
    """The string choices of a Literal hint, or of a Literal arm of ``X | None``."""
    if typing.get_origin(hint) is Literal:
        return {a for a in typing.get_args(hint) if isinstance(a, str)}
    return set().union(*map(_choices, typing.get_args(hint)))


KEYS = [key for key, *_ in describe(RunConfig)]
WORDS = sorted(set().union(*(_choices(h) for c in CONFIGS for h in typing.get_type_hints(c).values()))
               | set(PRESETS) | {"none", "null", ""})
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(), st.floats(),
                    st.sampled_from(WORDS), st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from([k.rpartition(".")[2] for k in KEYS] + ["spec", "every", "preset"]) | st.text(max_size=4),
    inner, max_size=3), max_leaves=8)
PATHS = st.sampled_from(KEYS) | st.builds(lambda k, x: f"{k}.{x}", st.sampled_from(KEYS),
                                          st.from_regex(r"[a-z_]{1,6}", fullmatch=True))
#: valid-looking assignments: a key's default or one of its choices
LIKELY = st.sampled_from([(key, v) for key, what, default, _ in describe(RunConfig) if what != "a table"
                          for v in [default, *(w for w in WORDS if what.startswith("one of") and w in what)]])
ASSIGNMENTS = st.lists(st.tuples(PATHS, VALUES) | LIKELY, min_size=1, max_size=4)
SECTIONS = ("model", "train", "data", "name", "compare")


def _assert_names_a_key(err: ConfigError, keys: list[str]) -> None:
    """The message starts with a key of the run (``train.lr``, ``model.layer_attention[0].spec``) that is one
    of the assigned keys, above or below one, or a field whose rule the assigned key's field is part of."""
    message = str(err)
    assert err.key and message.startswith(err.key) and re.split(r"[.\[]", err.key)[0] in SECTIONS, message
    assert any(err.key.startswith(k) or k.startswith(err.key.split("[")[0]) or k.rpartition(".")[2] in message
               for k in keys), (keys, message)


@settings(max_examples=300, deadline=None)
@given(ASSIGNMENTS)
def test_fuzz_from_dict(assignments):
    data: dict[str, Any] = {}
    for key, value in assignments:
        data = set_key(data, key, value, RunConfig)
    try:
        cfg = RunConfig.from_dict(data)
    except ConfigError as err:
        _assert_names_a_key(err, [k for k, _ in assignments])
        return
    assert RunConfig.from_dict(json.loads(cfg.to_json())).to_json() == cfg.to_json()


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


@settings(max_examples=200, deadline=None)
@given(PATHS, st.one_of(st.booleans(), st.integers(-3, 300), st.floats(), st.sampled_from(WORDS)))
def test_fuzz_override(key, value):
    try:
        cfg = RunConfig().override(f"{key}={_toml(value)}")
    except ConfigError as err:
        _assert_names_a_key(err, [key])
        return
    assert isinstance(cfg, RunConfig)
