"""The `Attention` layer, `AttentionSpec` validation and `backends.choose`."""

from __future__ import annotations

import importlib.util
import math
import re
import typing

import pytest
import torch
import torch.nn as nn

from lengthgen.attention import FIELDS, PRESETS, Attention, AttentionSpec, attend, resolve_spec
from lengthgen.attention import backends
from lengthgen.attention import functional as fn
from lengthgen.attention.extras import OutNorm, OutputGate, QueryScaling
from lengthgen.attention.module import SPEC_PARAMETERS, is_spec_parameter
from lengthgen.config import ConfigError

F64 = dict(rtol=1e-10, atol=1e-10)
DIM, HEADS = 32, 4

# name -> (spec changes, whether the output differs from the baseline layer with the same weights at init)
MODULE_OPTIONS = {
    "baseline": ({}, False),
    "p2": (dict(softmax_p=2.0), True),
    "log_n": (dict(query_scaling="log_n"), True),
    "log_n_global": (dict(query_scaling="log_n", learnable_scaling="global", scaling_init=0.8), True),
    "log_n_layer": (dict(query_scaling="log_n", learnable_scaling="layer"), True),
    "sqrt_log_n_head": (dict(query_scaling="sqrt_log_n", learnable_scaling="head", scaling_a=0.1), True),
    "log_bn_global": (dict(query_scaling="log_bn", learnable_scaling="global"), True),
    "scale_invariant": (dict(distance="scale_invariant", tau=3.0), True),
    "alibi": (dict(distance="alibi"), True),
    "log_bias": (dict(distance="log_bias", log_bias_lambda=2.0), True),
    "window": (dict(window=3), True),
    "doc": (dict(doc_masking=True), True),
    "base_scale": (dict(base_scale=0.5), True),
    "kv2": (dict(kv_heads=2), False),            # same weights impossible: compared by shape only
    "kv1": (dict(kv_heads=1), False),
    "qk_rms": (dict(qk_norm="rms"), True),
    "qk_layer": (dict(qk_norm="layer", qk_norm_affine=False), True),
    "qk_layer_affine": (dict(qk_norm="layer"), True),
    "qk_rms_eps": (dict(qk_norm="rms", qk_norm_eps=10.0), True),
    "nope": (dict(position="nope"), True),
    "rope_theta": (dict(rope_theta=100.0), True),
    "prope": (dict(position="prope", prope_fraction=0.5), True),
    "rope_min_freq": (dict(rope_min_freq=1 / 16), True),
    "head_layer": (dict(out_norm="head_layer"), True),
    "head_rms": (dict(out_norm="head_rms", out_norm_eps=0.1), True),
    "head_rms_affine": (dict(out_norm="head_rms", out_norm_affine=True), True),
    "global_layer": (dict(out_norm="global_layer", out_norm_affine=True), True),
    "global_rms": (dict(out_norm="global_rms", out_norm_affine=True), True),
    "gate_head": (dict(gate="head"), True),
    "gate_elementwise_2sigmoid": (dict(gate="elementwise", gate_act="2sigmoid"), False),
    "gate_elementwise_width": (dict(gate="elementwise", gate_width=3), True),
}


def x_and_docs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 11, DIM, generator=g, dtype=torch.float64).to(dtype)
    docs = torch.tensor([[0] * 4 + [1] * 7, [3] * 2 + [4] * 6 + [5] * 3])
    return x, docs


def layer(changes, backend="dense", seed=1, **kw):
    torch.manual_seed(seed)
    return Attention(DIM, HEADS, AttentionSpec(**changes), backend=backend, **kw).double()


def copy_shared_weights(src: nn.Module, dst: nn.Module) -> None:
    """Load the parameters of ``src`` that ``dst`` has with the same shape."""
    mine = dst.state_dict()
    dst.load_state_dict({k: v for k, v in src.state_dict().items() if k in mine and mine[k].shape == v.shape},
                        strict=False)


@pytest.mark.parametrize("name", list(MODULE_OPTIONS))
def test_every_option_forward_backward_and_tiled_equals_dense(name):
    changes, differs = MODULE_OPTIONS[name]
    x, docs = x_and_docs()
    dense = layer(changes, "dense")
    tiled = layer(changes, "tiled")
    tiled.load_state_dict(dense.state_dict())
    out = dense(x, docs)
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(tiled(x, docs), out, **F64)
    grads_dense = torch.autograd.grad(out.square().sum(), list(dense.parameters()))
    grads_tiled = torch.autograd.grad(tiled(x, docs).square().sum(), list(tiled.parameters()))
    for (pname, _), gd, gt in zip(dense.named_parameters(), grads_dense, grads_tiled):
        assert torch.isfinite(gd).all(), pname
        assert gd.abs().max() > 0, f"{pname} gets no gradient"
        torch.testing.assert_close(gt, gd, **F64)
    # the option is wired in: same weights, different output (unless it is an identity at init)
    base = layer({}, "dense")
    copy_shared_weights(base, dense)
    if changes.get("kv_heads") is None:
        gap = (dense(x, docs) - base(x, docs)).abs().max().item()
        assert (gap > 1e-6) == differs, gap


def test_auto_backend_module_runs_and_matches_dense():
    x, docs = x_and_docs()
    for changes in ({}, dict(softmax_p=2.0, window=4), dict(doc_masking=True)):
        auto = layer(changes, "auto")
        dense = layer(changes, "dense")
        torch.testing.assert_close(auto(x, docs), dense(x, docs), **F64)


def test_rope_frequencies_stay_float32_in_a_bfloat16_layer():
    """``.to(torch.bfloat16)`` casts buffers: rounded frequencies would turn position 4096 by up to ~2 rad wrong."""
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        own = cast(Attention(64, 4, AttentionSpec(position="rope"), head_dim=16))
        assert own.rope_freqs.dtype == torch.float32
        assert torch.equal(own.rope_freqs, own.rope_frequencies())
    x = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16).expand(1, 4, 4096, 16)
    pos = torch.arange(4096)
    exact = fn.apply_rope(x.float(), pos, own.rope_frequencies())
    err = (fn.apply_rope(x, pos, own.rope_freqs).float() - exact).abs().max()
    assert err < 0.05 < (fn.apply_rope(x, pos, own.rope_frequencies().bfloat16()).float() - exact).abs().max()


def test_a_layer_built_on_the_meta_device_gets_its_rope_frequencies_with_to_empty():
    """``with torch.device("meta")``, ``to_empty``, ``load_state_dict`` (the usual init of a large model) left
    ``rope_freqs`` uninitialized memory (values like -1.3e22): it is not in the state dict. The outputs then
    differed from the layer's, silently; ``to_empty`` now sets the frequencies, as every cast or move does."""
    own = Attention(DIM, HEADS, AttentionSpec(position="prope"))
    with torch.device("meta"):
        built = Attention(DIM, HEADS, AttentionSpec(position="prope"))
    built.to_empty(device="cpu")
    built.load_state_dict(own.state_dict())
    x = torch.randn(2, 9, DIM)
    assert torch.equal(built.rope_freqs, own.rope_freqs) and torch.equal(built(x), own(x))


@pytest.mark.parametrize("old, new", [("nope", dict(position="rope")), ("baseline", dict(position="prope")),
                                      ("baseline", dict(rope_theta=100.0, window=4, softmax_p=2.0)),
                                      ("sqrt_log_n", dict(qk_norm="layer", kv_heads=HEADS))])
def test_a_spec_set_on_a_built_layer_runs_as_a_layer_built_with_it(old, new):
    """``layer.spec = ...`` kept the ``rope_freqs`` of the spec the layer was built with: NoPE -> RoPE ran unrotated
    (frequencies 0), RoPE -> p-RoPE rotated every pair. They are recomputed, in the layer's dtype."""
    own = Attention(DIM, HEADS, old).double()
    own.spec = own.spec.replace(**new)
    fresh = Attention(DIM, HEADS, own.spec).double()
    fresh.load_state_dict(own.state_dict())
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    assert own.rope_freqs.dtype == torch.float64 and torch.equal(own(x), fresh(x))


def test_a_layer_pickled_before_spec_was_a_property_loads():
    """A layer pickled whole by an earlier lengthgen holds ``spec`` in its __dict__, which the property shadows."""
    own = Attention(DIM, HEADS, "l2")
    state = dict(own.__dict__)
    state["spec"] = state.pop("_spec")
    old = Attention.__new__(Attention)
    old.__setstate__(state)
    x = torch.randn(2, 5, DIM)
    assert old.spec == own.spec and torch.equal(old(x), own(x))


@pytest.mark.parametrize("old, new, change", [
    ("baseline", dict(out_norm="head_layer"), "out_norm 'none' -> 'head_layer'"),
    ("baseline", dict(gate="head"), "gate 'none' -> 'head'"),
    ("gated", dict(gate_act="sigmoid"), "gate_act '2sigmoid' -> 'sigmoid'"),
    ("baseline", dict(qk_norm="rms"), "qk_norm 'none' -> 'rms'"),
    ("sqrt_log_n", dict(qk_norm_affine=False, learnable_scaling="none"),
     "learnable_scaling 'head' -> 'none', qk_norm_affine True -> False"),
    ("baseline", dict(kv_heads=2), "kv_heads None -> 2")])
def test_a_spec_set_on_a_built_layer_keeps_what_its_parameters_were_built_from(old, new, change):
    """The out-norm, gate, query-scaling and QK-norm modules keep what they were built from: out_norm='head_layer'
    set on a built layer ran without out-norm, a gate without a gate, silently. A `ConfigError` names the fields."""
    own = Attention(DIM, HEADS, old)
    with pytest.raises(ConfigError, match=rf"^Attention.spec: {re.escape(change)} would change the layer's "
                                          "parameters or submodules, built from the spec it was made with; build a "
                                          "new Attention with this spec$"):
        own.spec = own.spec.replace(**new)
    assert own.spec == resolve_spec(old)
    with pytest.raises(ConfigError, match=r"^Attention.head_dim=15 is not valid; it must be even for position="):
        Attention(30, 2, "nope").spec = "baseline"


def test_2sigmoid_gate_is_identity_at_init():
    x, docs = x_and_docs()
    for gate in ("head", "elementwise"):
        gated = layer(dict(gate=gate, gate_act="2sigmoid"))
        plain = layer({})
        copy_shared_weights(gated, plain)
        assert (gated.gate.weight == 0).all()
        torch.testing.assert_close(gated(x, docs), plain(x, docs), **F64)
        # sigmoid gates start near 1/2 instead
        sig = layer(dict(gate=gate, gate_act="sigmoid"))
        copy_shared_weights(gated, sig)
        ratio = sig(x) / plain(x)
        assert (ratio.median() - 0.5).abs() < 0.05


def test_head_gate_scales_whole_heads():
    x, _ = x_and_docs()
    gated = layer(dict(gate="head", gate_act="2sigmoid"))
    assert gated.gate.weight.shape == (HEADS, DIM)
    with torch.no_grad():
        gated.gate.weight.normal_()
    gated.capture = {}
    out = gated(x)
    y = gated.capture["y_norm"].transpose(1, 2)                  # (b, l, h, d)
    gate = 2 * torch.sigmoid(x @ gated.gate.weight.T)           # (b, l, h): one gate per head and token
    torch.testing.assert_close(out, gated.o_proj((y * gate[..., None]).reshape(2, 11, DIM)), **F64)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_parameter_shapes(kv_heads):
    m = Attention(DIM, HEADS, AttentionSpec(kv_heads=kv_heads), head_dim=16)
    assert m.q_proj.weight.shape == (HEADS * 16, DIM)
    assert m.k_proj.weight.shape == (kv_heads * 16, DIM)
    assert m.v_proj.weight.shape == (kv_heads * 16, DIM)
    assert m.o_proj.weight.shape == (DIM, HEADS * 16)
    m.capture = {}
    out = m(torch.randn(2, 5, DIM))
    assert out.shape == (2, 5, DIM)
    assert m.capture["k"].shape == (2, kv_heads, 5, 16) and m.capture["q"].shape == (2, HEADS, 5, 16)


def test_bad_module_arguments():
    Attention(DIM, HEADS, AttentionSpec(position="nope"), head_dim=5)(torch.randn(1, 3, DIM))
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        Attention(DIM, HEADS, backend="fast")(torch.randn(1, 3, DIM))


BAD_SIZES = [
    (dict(dim=0), r"Attention\.dim=0 is not valid; it must be an integer in \[1, 2147483647\]$"),
    (dict(dim=-8), r"Attention\.dim=-8 is not valid"),
    (dict(dim=32.0), r"Attention\.dim=32\.0 is not valid; it must be an integer"),
    (dict(heads=0), r"Attention\.heads=0 is not valid; it must be an integer in \[1, "),
    (dict(heads=-2), r"Attention\.heads=-2 is not valid"),
    (dict(heads=True), r"Attention\.heads=True is not valid"),
    (dict(head_dim=0), r"Attention\.head_dim=0 is not valid; it must be an integer in \[1, 2147483647\], or none$"),
    (dict(head_dim=-4), r"Attention\.head_dim=-4 is not valid"),
    (dict(layer_index=-1), r"Attention\.layer_index=-1 is not valid; it must be an integer >= 0$"),
    (dict(dim=10), r"Attention\.heads=4 is not valid; it must be a divisor of dim=10 \(or pass head_dim\)$"),
    (dict(spec={"kv_heads": 3}), r"AttentionSpec\.kv_heads=3 is not valid; it must be a divisor of heads=4$"),
    (dict(spec={"kv_heads": 8}), r"AttentionSpec\.kv_heads=8 is not valid; it must be a divisor of heads=4$"),
    (dict(head_dim=5), r"Attention\.head_dim=5 is not valid; it must be even for position='rope'"),
]


@pytest.mark.parametrize("changes,match", BAD_SIZES, ids=[str(c) for c, _ in BAD_SIZES])
def test_bad_sizes_are_one_line_config_errors(changes, match):
    """Each was a raw traceback from deep inside (negative dimension, modulo by zero, float size), or was accepted:
    dim=0 built an empty layer, head_dim=0 fell back to dim // heads, heads=True made one head."""
    with pytest.raises(ConfigError, match="^" + match) as err:
        Attention(**{"dim": DIM, "heads": HEADS, **changes})
    assert "\n" not in str(err.value)


def test_capture_holds_internals():
    x, docs = x_and_docs()
    m = layer(dict(out_norm="head_layer", kv_heads=2, qk_norm="rms", doc_masking=True))
    assert m.capture is None
    out = m(x, docs)
    assert m.capture is None                     # nothing captured unless asked
    m.capture = {}
    torch.testing.assert_close(m(x, docs), out, **F64)
    rec = m.capture
    assert set(rec) == {"q", "k", "v", "y", "y_norm", "doc_ids"}
    assert rec["q"].shape == (2, HEADS, 11, DIM // HEADS) and rec["v"].shape == (2, 2, 11, DIM // HEADS)
    assert rec["doc_ids"] is docs
    torch.testing.assert_close(rec["y"], attend(rec["q"], rec["k"], rec["v"], m.spec, doc_ids=docs, backend="dense"),
                               **F64)
    torch.testing.assert_close(rec["y_norm"], fn.out_norm(rec["y"], "head_layer", 1e-5), **F64)
    # q and k are normed then rotated; v is the plain projection (no norm, no rotation)
    d, pos = DIM // HEADS, torch.arange(11)
    q = fn.head_norm(m.q_proj(x).view(2, 11, HEADS, d).transpose(1, 2), "rms", 1e-6, m.q_norm_weight)
    k = fn.head_norm(m.k_proj(x).view(2, 11, 2, d).transpose(1, 2), "rms", 1e-6, m.k_norm_weight)
    torch.testing.assert_close(rec["q"], fn.apply_rope(q, pos, m.rope_freqs), **F64)
    torch.testing.assert_close(rec["k"], fn.apply_rope(k, pos, m.rope_freqs), **F64)
    assert (rec["k"] - k).abs().max() > 1e-3
    torch.testing.assert_close(rec["v"], m.v_proj(x).view(2, 11, 2, d).transpose(1, 2), **F64)


@pytest.mark.parametrize("granularity,shape", [("global", ()), ("layer", ()), ("head", (HEADS,))])
def test_learnable_scaling_shapes(granularity, shape):
    m = Attention(DIM, HEADS, AttentionSpec(query_scaling="log_n", learnable_scaling=granularity, scaling_init=0.7))
    assert isinstance(m.scaling.multiplier, nn.Parameter) and m.scaling.multiplier.shape == shape
    assert torch.all(m.scaling.multiplier == 0.7)
    assert any(p is m.scaling.multiplier for p in m.parameters())
    fixed = Attention(DIM, HEADS, AttentionSpec(query_scaling="log_n"))
    assert fixed.scaling.multiplier is None


def test_multiplier_is_used():
    x, _ = x_and_docs()
    m = layer(dict(query_scaling="sqrt_log_n", learnable_scaling="head"))
    before = m(x)
    with torch.no_grad():
        m.scaling.multiplier[2] += 0.5
    after = m(x)
    assert (after - before).abs().max() > 1e-6
    # a per-head multiplier changes only its head: compare the attention outputs per head
    m.capture = {}
    m(x)
    y_after = m.capture["y"]
    with torch.no_grad():
        m.scaling.multiplier[2] -= 0.5
    m(x)
    y_before = m.capture["y"]
    changed = (y_after - y_before).abs().amax(dim=(0, 2, 3))
    assert changed[2] > 1e-6 and changed[[0, 1, 3]].max() == 0


def test_shared_global_multiplier():
    shared = nn.Parameter(torch.tensor(1.2, dtype=torch.float64))
    spec = dict(query_scaling="log_n", learnable_scaling="global")
    a, b = layer(spec, multiplier=shared), layer(spec, seed=2, multiplier=shared)
    assert a.scaling.multiplier is shared and b.scaling.multiplier is shared
    model = nn.Sequential(a, b)
    assert sum(p is shared for p in model.parameters()) == 1
    # the same two layers with their own multipliers (same value): the shared gradient is the sum of theirs
    a_own, b_own = layer(spec), layer(spec, seed=2)
    a_own.load_state_dict(a.state_dict())
    b_own.load_state_dict(b.state_dict())
    assert a_own.scaling.multiplier is not b_own.scaling.multiplier
    x, _ = x_and_docs()
    model(x).square().sum().backward()
    b_own(a_own(x)).square().sum().backward()
    assert a_own.scaling.multiplier.grad.abs() > 0 and b_own.scaling.multiplier.grad.abs() > 0
    torch.testing.assert_close(shared.grad, a_own.scaling.multiplier.grad + b_own.scaling.multiplier.grad, **F64)
    # a per-layer multiplier is owned by each layer even if a shared one is offered
    c = layer(dict(query_scaling="log_n", learnable_scaling="layer"), multiplier=shared)
    assert c.scaling.multiplier is not shared and c.scaling.multiplier.shape == ()
    # a plain tensor was kept as an attribute, neither learned, saved nor moved by .to(); a (H,) one ran per head
    for offered, got in ((torch.tensor(1.2), "a Tensor of shape ()"), (nn.Parameter(torch.ones(HEADS)),
                                                                      "a Parameter of shape (4,)"), (1.2, "a float")):
        with pytest.raises(ConfigError, match=re.escape("Attention.multiplier must be the 0-d nn.Parameter that "
                           f"learnable_scaling='global' layers share (QueryScaling.new_parameter), got {got}")):
            layer(spec, multiplier=offered)


# ---------------------------------------------------------------------------------------------------
# spec validation

BAD_VALUES = [
    ("softmax_p", 0), ("softmax_p", -1.0), ("softmax_p", "2"), ("softmax_p", True), ("softmax_p", None),
    ("softmax_p", float("inf")), ("softmax_p", float("nan")),
    ("query_scaling", "log"), ("query_scaling", None), ("learnable_scaling", "per_head"),
    ("scaling_a", "x"), ("scaling_b", True), ("scaling_c", None), ("scaling_init", "1"), ("log_bias_lambda", [1]),
    ("distance", "rope"), ("distance", "ALIBI"), ("tau", 0), ("tau", -1.0), ("tau", "10"),
    ("window", 0), ("window", -3), ("window", 2.5), ("window", True), ("window", "8"),
    ("base_scale", 0.0), ("base_scale", -0.1), ("kv_heads", 0), ("kv_heads", 1.5), ("kv_heads", False),
    ("qk_norm", "batch"), ("qk_norm_eps", 0), ("qk_norm_eps", -1e-6), ("position", "alibi"),
    ("rope_theta", -1.0), ("prope_fraction", -0.1), ("prope_fraction", 1.5), ("prope_fraction", "half"),
    ("prope_fraction", True), ("out_norm", "layer"), ("out_norm_eps", -1.0), ("gate", "yes"), ("gate", True),
    ("gate_act", "tanh"), ("doc_masking", "yes"), ("doc_masking", 1), ("qk_norm_affine", None),
    ("out_norm_affine", 0), ("rope_min_freq", 0.0), ("rope_min_freq", 2.0), ("gate_width", 0),
    ("gate_width", 1.5),
    ("window", 2**63),      # wrapped to a negative int64 in the mask mods: every key hidden, an output of zeros
]
CHOICES = {name: typing.get_args(hint) for name, hint in typing.get_type_hints(AttentionSpec).items()
           if typing.get_origin(hint) is typing.Literal}


def test_bad_values_cover_every_field():
    assert {f for f, _ in BAD_VALUES} | {"scaling_init", "learnable_scaling"} == set(FIELDS)
    assert set(CHOICES) == {"query_scaling", "learnable_scaling", "distance", "qk_norm", "position", "out_norm",
                            "gate", "gate_act"}


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_spec_value_names_field_and_choices(field, value):
    for make in (lambda: AttentionSpec(**{field: value}), lambda: AttentionSpec().replace(**{field: value}),
                 lambda: AttentionSpec.from_dict({field: value}), lambda: resolve_spec({field: value})):
        with pytest.raises(ValueError) as err:
            make()
        message = str(err.value)
        assert f"AttentionSpec.{field}={value!r}" in message, message
        if field in CHOICES:
            assert all(choice in message for choice in CHOICES[field]), message


def test_layer_errors_name_the_argument():
    """Each failed later and deeper: an unknown backend at the first forward, a 2-D input in an unpack (sizes:
    `test_bad_sizes_are_one_line_config_errors`); a head_dim that does not divide dim is fine when given."""
    assert Attention(10, 4, head_dim=4)(torch.randn(1, 3, 10)).shape == (1, 3, 10)
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'; choose one of auto, dense"):
        Attention(16, 2, backend="bogus")
    with pytest.raises(ValueError, match=r"Attention expects \(batch, length, dim=16\) input, got \(5, 16\)"):
        Attention(16, 2)(torch.randn(5, 16))


def test_forward_checks_the_input_width_and_the_value_shape():
    """A wrong width was a raw matmul error; a wrong value shape a broadcasting error, or silently broadcast."""
    m = Attention(DIM, HEADS, {"kv_heads": 2})
    x = torch.randn(2, 5, DIM)
    with pytest.raises(ValueError, match=r"^Attention expects \(batch, length, dim=32\) input, got \(2, 5, 31\)$"):
        m(torch.randn(2, 5, DIM - 1))
    for shape in ((2, 5, 8), (2, 4, 16), (1, 5, 16), (16,)):
        with pytest.raises(ValueError, match=r"^Attention: value must be \(batch, length, kv_heads \* head_dim\) = "
                           rf"\(2, 5, 16\), got {re.escape(str(shape))}$"):
            m(x, value=torch.randn(shape))
    assert m(x, value=torch.randn(2, 5, 16)).shape == x.shape
    # a float64 value was torch's raw matmul error in o_proj, an integer one silently added, a list an AttributeError
    for value, got in ((torch.randn(2, 5, 16, dtype=torch.float64), "torch.float64 on cpu"),
                       (torch.ones(2, 5, 16, dtype=torch.long), "torch.int64 on cpu")):
        with pytest.raises(ValueError, match=r"^Attention: value must be floating-point activations on the layer's "
                           rf"device and of its dtype \(cpu, torch.float32; another under autocast\), got {got}$"):
            m(x, value=value)
    with pytest.raises(ValueError, match=r"^Attention: value must be \(batch, length, kv_heads \* head_dim\) = "
                       r"\(2, 5, 16\), got list$"):
        m(x, value=[0.0] * 16)
    with pytest.raises(ValueError, match=r"^Attention: cache must be a KVCache \(lengthgen.attention\) or None, got "
                                         "dict$"):
        m(x, cache={})          # was an AttributeError: 'dict' object has no attribute 'layer'


def test_forward_names_an_x_that_is_not_the_layers_activations():
    """Token ids (a long x), another float dtype or another device were torch's raw matmul error, a list an
    AttributeError. Under autocast another float dtype is the point, and is accepted."""
    m = Attention(DIM, HEADS)
    for x, got in ((torch.ones(2, 5, DIM, dtype=torch.long), "torch.int64 on cpu"),
                   (torch.ones(2, 5, DIM, dtype=torch.bool), "torch.bool on cpu"),
                   (torch.randn(2, 5, DIM, dtype=torch.float64), "torch.float64 on cpu"),
                   (torch.randn(2, 5, DIM, device="meta"), "torch.float32 on meta")):
        with pytest.raises(ValueError, match=r"^Attention: x must be floating-point activations on the layer's device "
                           rf"and of its dtype \(cpu, torch.float32; another under autocast\), got {got}$"):
            m(x)
    with pytest.raises(ValueError, match=rf"^Attention expects \(batch, length, dim={DIM}\) input, got list$"):
        m([[0.0] * DIM])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(torch.randn(2, 5, DIM, dtype=torch.bfloat16)).shape == (2, 5, DIM)


def test_dependent_field_errors():
    with pytest.raises(ValueError, match=r"learnable_scaling='head' needs query_scaling log_n, log_bn or sqrt_log_n"):
        AttentionSpec(learnable_scaling="head")
    with pytest.raises(ValueError, match=r"scaling_b=-1.*b >= 0"):
        AttentionSpec(query_scaling="sqrt_log_n", scaling_b=-1.0)
    with pytest.raises(ValueError, match=r"b \+ c > 1"):
        AttentionSpec(query_scaling="sqrt_log_n", scaling_b=0.0, scaling_c=1.0)
    with pytest.raises(ValueError, match=r"log_bn needs b >= 0 and b \+ c > 0 so that log\(b n \+ c\) is defined"):
        AttentionSpec(query_scaling="log_bn", scaling_b=0.5, scaling_c=-0.5)
    AttentionSpec(query_scaling="log_bn", scaling_b=0.0, scaling_c=0.5)      # a negative gain is allowed
    AttentionSpec(query_scaling="log_n", scaling_b=0.0, scaling_c=1.0)       # log_n does not use b, c


def test_unknown_fields_and_presets():
    with pytest.raises(ValueError, match=r"unknown AttentionSpec field\(s\) \['softmax'\]; valid fields: softmax_p"):
        AttentionSpec().replace(softmax=2.0)
    with pytest.raises(ValueError, match=r"unknown AttentionSpec field\(s\) \['heads'\]"):
        AttentionSpec.from_dict({"heads": 4})
    with pytest.raises(ValueError, match=r"unknown attention preset 'l3'; choose one of baseline, l2, avnorm"):
        AttentionSpec.preset("l3")
    with pytest.raises(ValueError, match=r"unknown attention preset 'l3'"):
        resolve_spec("l3")
    with pytest.raises(ValueError, match=r"unknown attention preset 'l3'"):
        resolve_spec({"preset": "l3"})
    with pytest.raises(ValueError, match=r"unknown AttentionSpec field\(s\) \['windw'\]"):
        resolve_spec({"preset": "l2", "windw": 3})
    with pytest.raises(ValueError, match="must be an AttentionSpec, a preset name or a dict, got int"):
        resolve_spec(3)


def test_presets_and_round_trip():
    for name, spec in PRESETS.items():
        assert AttentionSpec.from_dict(spec.to_dict()) == spec
        assert resolve_spec(name) == spec
    assert resolve_spec({"preset": "l2", "window": 8}) == AttentionSpec(softmax_p=2.0, window=8)
    assert resolve_spec(None) == AttentionSpec()
    assert AttentionSpec.preset("alibi", window=16).window == 16
    assert PRESETS["l2"].softmax_p == 2.0 and PRESETS["avnorm"].out_norm == "head_layer"
    assert len(set(PRESETS.values())) == len(PRESETS)          # every preset differs


def test_bad_backend_name():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"unknown attention backend 'cuda'; choose one of auto, dense, tiled, sdpa"):
        attend(q, q, q, backend="cuda")
    with pytest.raises(ValueError, match=r"unknown attention backend \['sdpa'\]; choose one of auto"):
        attend(q, q, q, backend=["sdpa"])                  # not a raw "unhashable type"


BAD_SHAPES = {
    "3d q": ((2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, r"\(batch, heads, length, head_dim\)"),
    "k v length": ((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 6, 8), None, "incompatible shapes"),
    "batch": ((2, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, "incompatible shapes"),
    "head_dim": ((1, 2, 5, 8), (1, 2, 5, 4), (1, 2, 5, 4), None, "incompatible shapes"),
    "gqa": ((1, 3, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, "3 query heads are not a multiple of 2"),
    "lq > lk": ((1, 2, 6, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, "6 queries but only 5 keys"),
    "doc_ids": ((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), (1, 4), r"doc_ids must be \(batch, key length\)"),
}


@pytest.mark.parametrize("name", list(BAD_SHAPES))
def test_bad_shapes_to_attend(name):
    qs, ks, vs, ds, match = BAD_SHAPES[name]
    docs = None if ds is None else torch.zeros(ds, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        attend(torch.randn(qs), torch.randn(ks), torch.randn(vs), AttentionSpec(doc_masking=True), doc_ids=docs)


@pytest.mark.parametrize("name,value,what", [("q", [[1.0]], "a tensor, got list"),
                                              ("k", None, "a tensor, got NoneType"),
                                              ("v", 1.0, "a tensor, got float"),
                                              ("doc_ids", [[0, 0, 0]], "a tensor or None, got list"),
                                              ("mask", True, "a tensor or None, got bool")])
def test_attend_names_an_argument_that_is_not_a_tensor(name, value, what):
    """Each was an AttributeError from inside the checks ('list' object has no attribute 'dim')."""
    args = dict(q=torch.randn(1, 2, 3, 4), k=torch.randn(1, 2, 3, 4), v=torch.randn(1, 2, 3, 4), doc_ids=None,
                mask=None)
    args[name] = value
    with pytest.raises(ValueError, match=rf"^attend: {name} must be {what}$"):
        attend(spec=AttentionSpec(doc_masking=True), **args)


def test_value_head_dim_may_differ():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 3)
    spec = AttentionSpec(softmax_p=2.0)
    out = attend(q, k, v, spec, backend="dense")
    assert out.shape == (1, 2, 5, 3)
    torch.testing.assert_close(attend(q, k, v, spec, backend="tiled"), out, rtol=1e-5, atol=1e-5)
    for spec, wide in ((AttentionSpec(distance="alibi"), 3), (AttentionSpec(window=2), 11)):    # cpu_flash pads
        v = torch.randn(1, 2, 5, wide)
        torch.testing.assert_close(attend(q, k, v, spec, backend="cpu_flash"), attend(q, k, v, spec, backend="dense"),
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# backends.choose


def _q(length):
    return torch.empty(1, 2, length, 8)


@pytest.mark.parametrize("training", [True, False])
def test_choose_never_flex_on_cpu(training):
    for spec in list(PRESETS.values()) + [AttentionSpec(window=64, softmax_p=2.0), AttentionSpec(doc_masking=True)]:
        for length in (16, 1024, 4096):
            name = backends.choose(spec, _q(length), length, training)
            assert name in ("sdpa", "dense", "tiled", "cpu_flash"), (spec, length, name)
            assert backends.unsupported(name, spec, _q(length), training) is None


def test_choose_sdpa_for_plain_causal_softmax():
    for length in (16, 1024, 8192):
        assert backends.choose(AttentionSpec(), _q(length), length, True) == "sdpa"
        assert backends.choose(PRESETS["ssmax"], _q(length), length, True) == "sdpa"      # scaling is in q


def test_choose_memory_linear_engines_for_long_inputs():
    """Long inputs: cpu_flash for softmax with masks or additive distance terms, tiled for the rest."""
    for spec in (AttentionSpec(window=128), AttentionSpec(doc_masking=True), AttentionSpec(distance="alibi", window=64),
                 PRESETS["log_bias"]):
        assert backends.choose(spec, _q(1024), 1024, True) == "cpu_flash", spec
    for spec in (AttentionSpec(softmax_p=2.0), PRESETS["scale_invariant"], AttentionSpec(softmax_p=0.5, window=8)):
        assert backends.choose(spec, _q(1024), 1024, True) == "tiled", spec


def test_choose_crossovers():
    """The measured thresholds: sdpa with a mask up to SDPA_MASK_MAX_PAIRS pairs per head; dense up to
    FLASH_DENSE_MAX_LOGITS logits where cpu_flash runs the spec, up to TILED_DENSE_MAX_LOGITS logits and
    TILED_DENSE_MAX_PAIRS pairs per head where tiled does, and up to DECODE_MAX_LOGITS for < DECODE_ROWS queries."""
    side = int(math.isqrt(backends.SDPA_MASK_MAX_PAIRS))
    assert backends.choose(AttentionSpec(window=128), _q(side), side, True) == "sdpa"
    assert backends.choose(AttentionSpec(window=128), _q(side + 1), side + 1, True) == "cpu_flash"
    alibi = PRESETS["alibi"]
    side = int(math.isqrt(backends.FLASH_DENSE_MAX_LOGITS // 2))                 # _q has batch x heads = 2
    assert backends.choose(alibi, _q(side), side, True) == "dense"
    assert backends.choose(alibi, _q(side + 1), side + 1, True) == "cpu_flash"
    p2 = AttentionSpec(softmax_p=2.0)
    side = int(math.isqrt(backends.TILED_DENSE_MAX_PAIRS))
    assert backends.choose(p2, _q(side), side, True) == "dense"
    assert backends.choose(p2, _q(side + 1), side + 1, True) == "tiled"         # pairs per head
    many = backends.TILED_DENSE_MAX_LOGITS // (32 * 32 * 4)
    assert backends.choose(p2, torch.empty(many, 4, 32, 8), 32, True) == "dense"
    assert backends.choose(p2, torch.empty(many + 1, 4, 32, 8), 32, True) == "tiled"   # logits over batch x heads
    # decoding: a few queries against many keys stay on dense while the logits are small enough
    assert backends.choose(p2, _q(1), 100_000, False) == "dense"
    assert backends.choose(p2, _q(backends.DECODE_ROWS), 100_000, False) == "tiled"
    assert backends.choose(p2, _q(1), backends.DECODE_MAX_LOGITS, False) == "tiled"


def _cuda_q(length, head_dim=128, batch=2):
    """A bfloat16 CUDA query without a GPU (a fake tensor: `choose` reads only its device, dtype and shape)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(batch, 4, length, head_dim, device="cuda", dtype=torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed (make test has it)")
def test_choose_on_cuda():
    """SDPA's flash kernel for plain causal softmax; windows and documents on the engines that skip the blocks they
    hide (SDPA took them as a dense (Lq, Lk) mask: quadratic memory, every block computed, e.g. the document-masked
    124M benchmark model); an explicit mask on SDPA; decoding on SDPA or dense."""
    def pick(spec, length=2048, lk=None, masked=False, **kw):
        return backends.choose(spec, _cuda_q(length, **kw), lk or length, True, masked)
    for spec in (AttentionSpec(), PRESETS["ssmax"], PRESETS["sqrt_log_n"]):
        assert pick(spec) == "sdpa", spec
    for spec in (AttentionSpec(doc_masking=True), AttentionSpec(window=256), AttentionSpec(doc_masking=True, window=8),
                 PRESETS["alibi"], PRESETS["log_bias"]):
        assert pick(spec) == "flex", spec
    for spec in (PRESETS["l2"], AttentionSpec(softmax_p=2.0, doc_masking=True), PRESETS["scale_invariant"]):
        assert pick(spec) == "triton", spec
    assert pick(PRESETS["l2"], head_dim=512) == "flex"                                  # over the kernel's head_dim
    assert pick(AttentionSpec(doc_masking=True), masked=True) == "sdpa"                   # explicit masks
    assert pick(PRESETS["l2"], masked=True) == "tiled"
    assert pick(AttentionSpec(doc_masking=True), length=1, lk=4096) == "sdpa"             # decoding
    assert pick(PRESETS["alibi"], length=1, lk=4096) == "dense"
    assert pick(PRESETS["alibi"], length=1, lk=backends.DECODE_MAX_LOGITS) == "flex"


# ---------------------------------------------------------------------------------------------------
# extras: the modules Attention and the HF adapter share


def test_spec_parameters_are_exactly_what_specs_add():
    everything = AttentionSpec(qk_norm="rms", query_scaling="log_n", learnable_scaling="head", out_norm="head_layer",
                               out_norm_affine=True, gate="head")
    added = {n for n, _ in Attention(DIM, HEADS, everything).named_parameters()} - \
        {n for n, _ in Attention(DIM, HEADS).named_parameters()}
    assert added == set(SPEC_PARAMETERS)
    assert all(is_spec_parameter(n) for n in added) and not is_spec_parameter("q_proj.weight")


def test_out_norm_affine_and_gate_act_per_merged_channel():
    """OutNorm's affine and an elementwise gate act on channel h * D + d of the merged (B, L, H*D) output."""
    b, length, d = 2, 5, DIM // HEADS
    spec = AttentionSpec(out_norm="global_layer", out_norm_affine=True, gate="elementwise", gate_act="2sigmoid")
    norm, gate = OutNorm(spec, HEADS, d).double(), OutputGate(spec, DIM, HEADS, d).double()
    with torch.no_grad():
        for p in (norm.weight, norm.bias, gate.weight):
            p.normal_()
    y, x = torch.randn(b, HEADS, length, d, dtype=torch.float64), torch.randn(b, length, DIM, dtype=torch.float64)
    merged = lambda t: t.transpose(1, 2).reshape(b, length, HEADS * d)               # noqa: E731
    flat = torch.nn.functional.layer_norm(merged(y), (HEADS * d,), eps=spec.out_norm_eps)
    want = (flat * norm.weight + norm.bias) * 2 * torch.sigmoid(x @ gate.weight.T)
    torch.testing.assert_close(merged(gate(norm(y), x)), want, **F64)


def test_extras_are_identities_when_off():
    spec = AttentionSpec()
    y, x = torch.randn(1, HEADS, 3, 8), torch.randn(1, 3, DIM)
    norm, gate, scaling = OutNorm(spec, HEADS, 8), OutputGate(spec, DIM, HEADS, 8), QueryScaling(spec, HEADS)
    assert norm(y) is y and gate(y, x) is y and scaling.multiplier is None
    assert not list(norm.parameters()) + list(gate.parameters()) + list(scaling.parameters())


# A value away from the default for each field `AttentionSpec.unused` can name, and a spec that reads it.
REFINEMENTS = {
    "scaling_a": (0.5, dict(query_scaling="sqrt_log_n")), "scaling_b": (0.3, dict(query_scaling="log_bn")),
    "scaling_c": (2.5, dict(query_scaling="sqrt_log_n")), "scaling_init": (1.5, dict(query_scaling="log_n")),
    "tau": (3.0, dict(distance="scale_invariant")), "log_bias_lambda": (2.0, dict(distance="log_bias")),
    "qk_norm_affine": (False, dict(qk_norm="rms")), "qk_norm_eps": (0.5, dict(qk_norm="layer")),
    "rope_theta": (50.0, {}), "prope_fraction": (0.25, dict(position="prope")),
    "rope_min_freq": (1 / 64, {}), "out_norm_affine": (True, dict(out_norm="head_layer")),
    "out_norm_eps": (0.5, dict(out_norm="head_rms")), "gate_act": ("2sigmoid", dict(gate="head")),
    "gate_width": (4, dict(gate="elementwise")),
}


def _layer_output(spec: AttentionSpec) -> tuple[list[str], torch.Tensor]:
    torch.manual_seed(0)
    layer = Attention(DIM, HEADS, spec=spec).double()
    for p in layer.parameters():                   # off the init, so weights of 1 and gates of 0 matter too
        p.data.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 12, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return [name for name, _ in layer.named_parameters()], layer(x)


@pytest.mark.parametrize("name", list(REFINEMENTS))
def test_a_field_that_unused_names_changes_nothing_and_one_it_does_not_name_does(name):
    """`AttentionSpec.unused` is honest: a field it names leaves the layer's parameters and output as they were;
    with the choice it needs, the same field changes one of them."""
    from lengthgen.attention.spec import USED_WITH

    assert set(REFINEMENTS) == set(USED_WITH)
    value, reads = REFINEMENTS[name]
    off = AttentionSpec(position="nope") if name in ("rope_theta", "rope_min_freq") else AttentionSpec()
    assert off.replace(**{name: value}).unused() == {name: USED_WITH[name][1]} and off.unused() == {}
    names, out = _layer_output(off)
    same_names, same_out = _layer_output(off.replace(**{name: value}))
    assert same_names == names and torch.equal(same_out, out)
    on = AttentionSpec(**reads)
    assert on.replace(**{name: value}).unused() == {}
    names, out = _layer_output(on)
    changed_names, changed_out = _layer_output(on.replace(**{name: value}))
    assert changed_names != names or not torch.allclose(changed_out, out)


def test_no_preset_sets_a_field_it_never_reads():
    assert {name: spec.unused() for name, spec in PRESETS.items() if spec.unused()} == {}


@pytest.mark.parametrize("name", list(MODULE_OPTIONS))
@pytest.mark.parametrize("shape", [(0, 5), (2, 0)], ids=["no_sequences", "no_positions"])
def test_every_option_gives_an_empty_output_for_an_empty_input(name, shape):
    """A gated layer raised torch's 'cannot reshape tensor of 0 elements ... -1 ... is ambiguous' for an input with
    no sequences or no positions (an empty batch to GPT.generate, an empty chunk through a KVCache)."""
    net = layer(MODULE_OPTIONS[name][0])
    x = torch.randn(*shape, DIM, dtype=torch.float64, requires_grad=True)
    out = net(x, torch.zeros(shape, dtype=torch.long))
    assert out.shape == x.shape
    out.sum().backward()
