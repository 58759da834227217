"""GPT: norm placements x norm types, heads and losses, per-layer attention specs, init, shared scaling."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lengthgen import GPT, GPTConfig
from lengthgen.attention import PRESETS, AttentionSpec
from lengthgen.config import ConfigError
from lengthgen.model.config import PLACEMENTS, final_norm_note
from lengthgen.model.norms import NORMS, HeadNormLinear


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=13, dim=16, layers=3, heads=2, mlp_ratio=2.0)
    base.update(kw)
    return GPTConfig(**base)


def fake_batch(head: str, b: int = 3, length: int = 7, vocab: int = 13, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, length, generator=g) > 0.3
    mask[:, -1] = True
    if head == "lm":
        targets = torch.randint(vocab, (b, length), generator=g)
    elif head == "regress":
        targets = torch.randn(b, length, generator=g)
    else:
        targets = torch.randint(classes, (b,), generator=g)
        mask = torch.ones(b, length, dtype=torch.bool)
    return SimpleNamespace(tokens=torch.randint(vocab, (b, length), generator=g), targets=targets, loss_mask=mask,
                           doc_ids=None)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("norm", NORMS)
def test_every_placement_norm_and_head_runs_forward_backward(placement, norm):
    torch.manual_seed(0)
    for head in ("lm", "regress", "classify"):
        model = GPT(tiny(norm=norm, norm_placement=placement, head=head, num_classes=4))
        batch = fake_batch(head)
        out = model(batch.tokens)
        expected = {"lm": (3, 7, 13), "regress": (3, 7), "classify": (3, 4)}[head]
        assert tuple(out.shape) == expected
        loss, per = model.loss(out, batch)
        assert per.shape == ((3,) if head == "classify" else (3, 7))
        assert torch.isfinite(loss)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert model.embed.weight.grad.abs().sum() > 0


def _manual_block(block, x):
    """The placement formulas written out from the block's submodules."""
    a, m = block.attn, block.mlp
    p = block.placement
    if p == "pre":
        x = x + a(block.norm1(x))
        return x + m(block.norm2(x))
    if p == "post":
        x = block.norm1(x + a(x))
        return block.norm2(x + m(x))
    if p == "peri":
        x = x + block.norm1_out(a(block.norm1(x)))
        return x + block.norm2_out(m(block.norm2(x)))
    y = x + a(block.norm1(x) if p == "hybrid_first" else x)
    z = block.norm2(y)
    return m(z) + z


@pytest.mark.parametrize("placement", ["pre", "post", "peri"])
def test_final_norm_overrides_the_placements_default(placement):
    """Seed 003's minimal pre-norm model has no norm before the unembedding: ``final_norm = false`` leaves it out
    (the head reads the residual stream), ``true`` adds one to post; otherwise the two models are the same."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 13, (2, 6))
    default = GPT(tiny(norm="rms", norm_placement=placement, head="lm")).double()
    assert (default.final_norm is None) == (placement == "post")
    other = GPT(tiny(norm="rms", norm_placement=placement, head="lm", final_norm=placement == "post")).double()
    assert (other.final_norm is None) != (default.final_norm is None)
    assert other.config.has_final_norm == (placement == "post")
    other.load_state_dict(default.state_dict(), strict=False)           # every weight but the final norm's
    with_norm, without = (other, default) if placement == "post" else (default, other)
    with torch.no_grad():
        with_norm.final_norm.weight.normal_()
    torch.testing.assert_close(with_norm.features(tokens), with_norm.final_norm(without.features(tokens)))
    # the train start line and report.md say so where it is not the placement's default
    note = final_norm_note(placement, other.config.final_norm)
    assert note == (", final norm" if placement == "post" else ", no final norm")
    assert final_norm_note(placement, None) == final_norm_note(placement, default.final_norm is not None) == ""


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_placement_formulas_and_structure(placement):
    torch.manual_seed(1)
    cfg = tiny(layers=4, norm="rms", norm_placement=placement, head="lm")
    model = GPT(cfg)
    x = torch.randn(2, 5, 16)
    for block in model.blocks:
        torch.testing.assert_close(block(x), _manual_block(block, x))
    kinds = [b.placement for b in model.blocks]
    expected = {"pre": ["pre"] * 4, "post": ["post"] * 4, "peri": ["peri"] * 4, "hybrid": ["hybrid"] * 4,
                "hybrid_star": ["hybrid_first"] + ["hybrid"] * 3,
                "mix": ["post"] + ["pre"] * 3}[placement]   # ceil(0.25 * 4) = 1 post layer
    assert kinds == expected
    assert (model.final_norm is None) == (placement == "post")
    if placement.startswith("hybrid"):
        for block in model.blocks:   # QKV-norm: the spec's QK-norm plus a per-head norm on V
            assert block.attn.spec.qk_norm == "rms"
            assert isinstance(block.attn.v_proj, HeadNormLinear)
            v = block.attn.v_proj(x).view(2, 5, 2, 8)
            torch.testing.assert_close(v.pow(2).mean(-1), torch.ones(2, 5, 2), atol=2e-3, rtol=0)
        assert model.blocks[1].norm1 is None
    assert GPT(tiny(layers=8, norm_placement="mix", mix_alpha=0.5)).blocks[3].placement == "post"
    assert GPT(tiny(layers=8, norm_placement="mix", mix_alpha=0.5)).blocks[4].placement == "pre"


def _independent_forward(model, tokens, placement, norm):
    """Written from the weights with plain torch ops: causal softmax attention without positions, QKV-norm for
    the hybrid placements (per head over head_dim), the placement formulas, the final norm."""
    cfg = model.config
    heads, dim = cfg.heads, cfg.dim
    d = dim // heads

    def model_norm(x, module):
        if norm == "rms":
            return F.rms_norm(x, (dim,), module.weight, module.eps)
        return F.layer_norm(x, (dim,), module.weight, module.bias, module.eps)

    def head_norm(t, weight, eps):     # t (B, H, L, d)
        if norm == "rms":
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        else:
            t = (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, unbiased=False, keepdim=True) + eps)
        return t if weight is None else t * weight

    def mha(h, attn, qkv_norm):
        b, length, _ = h.shape
        q, k, v = (F.linear(h, m.weight).view(b, length, heads, d).transpose(1, 2)
                   for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        if qkv_norm:
            eps = attn.spec.qk_norm_eps
            q, k = head_norm(q, attn.q_norm_weight, eps), head_norm(k, attn.k_norm_weight, eps)
            v = head_norm(v, attn.v_proj.norm_weight, eps)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        s = s.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, length, dim)
        return F.linear(y, attn.o_proj.weight)

    def ffn(h, mlp):
        return F.linear(F.gelu(F.linear(h, mlp.fc.weight)), mlp.proj.weight)

    x = model.embed.weight[tokens]
    post_layers = math.ceil(cfg.mix_alpha * cfg.layers)
    for i, block in enumerate(model.blocks):
        a, m = block.attn, block.mlp
        kind = placement
        if placement == "mix":
            kind = "post" if i < post_layers else "pre"
        if kind == "pre":
            x = x + mha(model_norm(x, block.norm1), a, False)
            x = x + ffn(model_norm(x, block.norm2), m)
        elif kind == "post":
            x = model_norm(x + mha(x, a, False), block.norm1)
            x = model_norm(x + ffn(x, m), block.norm2)
        elif kind == "peri":
            x = x + model_norm(mha(model_norm(x, block.norm1), a, False), block.norm1_out)
            x = x + model_norm(ffn(model_norm(x, block.norm2), m), block.norm2_out)
        else:   # HybridNorm: y = x + MHA(x) with QKV-norm (HybridNorm*: block 0 pre-norms x); x' = FFN(N(y)) + N(y)
            first = placement == "hybrid_star" and i == 0
            y = x + mha(model_norm(x, block.norm1) if first else x, a, True)
            z = model_norm(y, block.norm2)
            x = ffn(z, m) + z
    if placement != "post":
        x = model_norm(x, model.final_norm)
    return x @ model.embed.weight.T


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("placement", ["pre", "post", "peri", "hybrid", "hybrid_star", "mix"])
def test_placements_equal_an_independent_forward(placement, norm):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, dim=16, layers=3, heads=2, mlp_ratio=2.0, attention="nope", norm=norm,
                          norm_placement=placement, mlp="gelu")).double()
    with torch.no_grad():      # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(13, (2, 9))
    torch.testing.assert_close(model(tokens), _independent_forward(model, tokens, placement, norm),
                               atol=1e-10, rtol=1e-10)


def test_per_layer_specs_every_rule_layers_rule_and_list():
    cfg = tiny(layers=8, attention={"window": 16},
               layer_attention=[{"every": 4, "offset": 3, "spec": "nope"}, {"layers": [0, -1], "spec": "l2"}])
    model = GPT(cfg)
    specs = [b.attn.spec for b in model.blocks]
    local = AttentionSpec(window=16)
    assert specs[0] == PRESETS["l2"] and specs[7] == PRESETS["l2"]      # later rule wins over every-4 at 7
    assert specs[3] == PRESETS["nope"] and specs[3].window is None
    for i in (1, 2, 4, 5, 6):
        assert specs[i] == local
    assert [b.attn.layer_index for b in model.blocks] == list(range(8))
    # a dict rule spec without preset changes fields of the default; with preset starts from that preset
    cfg = tiny(layers=4, attention="l2", layer_attention={"every": 2, "spec": {"position": "nope"}})
    specs = cfg.layer_specs()
    assert specs[0] == PRESETS["l2"].replace(position="nope") and specs[1] == PRESETS["l2"]
    cfg = tiny(layers=3, layer_attention=[None, "alibi", {"preset": "avnorm", "window": 4}])
    specs = [b.attn.spec for b in GPT(cfg).blocks]
    assert specs == [PRESETS["baseline"], PRESETS["alibi"], PRESETS["avnorm"].replace(window=4)]


@pytest.mark.parametrize("bad, match", [
    ([{"every": 0, "spec": "nope"}], r"layer_attention\[0\]\.every"),
    ([{"layers": [9], "spec": "nope"}], r"layer_attention\[0\]\.layers"),
    ([{"every": 2, "layers": [1], "spec": "nope"}], "exactly one"),
    ([{"every": 2, "spec": "nosuch"}], "unknown attention preset"),
    ([{"every": 2, "spec": {"softmax_p": -1}}], "softmax_p"),
    (["nope", None], "exactly layers=3"),
])
def test_bad_layer_attention_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(layers=3, layer_attention=bad)


def test_global_learnable_scaling_is_one_shared_parameter():
    spec = {"preset": "ssmax", "learnable_scaling": "global"}
    model = GPT(tiny(layers=3, attention=spec, layer_attention=[{"layers": [1], "spec": "baseline"}]))
    shared = model.scaling_multiplier
    assert isinstance(shared, torch.nn.Parameter) and shared.shape == ()
    assert model.blocks[0].attn.scaling.multiplier is shared and model.blocks[2].attn.scaling.multiplier is shared
    assert model.blocks[1].attn.scaling.multiplier is None
    assert sum(p is shared for p in model.parameters()) == 1
    out = model(torch.randint(13, (2, 6)))
    out.sum().backward()
    assert shared.grad is not None and shared.grad != 0
    per_head = GPT(tiny(layers=2, attention="ssmax"))
    assert per_head.scaling_multiplier is None
    assert per_head.blocks[0].attn.scaling.multiplier is not per_head.blocks[1].attn.scaling.multiplier


def test_tokens_that_are_not_integer_ids_are_named():
    """Float or bool tokens were torch's embedding error ("Expected tensor for argument #1 'indices'"), a list an
    AttributeError."""
    model = GPT(tiny())
    for tokens, got in ((torch.zeros(2, 3), r"torch.float32 \(2, 3\)"),
                        (torch.zeros(2, 3, dtype=torch.bool), r"torch.bool \(2, 3\)"),
                        (torch.zeros(3, dtype=torch.long), r"torch.int64 \(3,\)"), ([[1, 2]], "list")):
        with pytest.raises(ValueError, match=r"^GPT expects \(batch, length\) token ids \(torch.long or torch.int32\), "
                           rf"got {got}$"):
            model(tokens)
    assert model(torch.zeros(2, 3, dtype=torch.int32)).shape[:2] == (2, 3)


def test_token_ids_outside_the_vocabulary_are_named():
    """An id >= vocab_size (or < 0) was torch's bare IndexError 'index out of range in self'."""
    model = GPT(tiny())
    for tokens, got in (([[1, 13]], r"\[1, 13\]"), ([[-1, 3]], r"\[-1, 3\]")):
        with pytest.raises(ValueError, match=rf"^GPT: token ids must be in \[0, 13\) \(model.vocab_size\), got ids in "
                           rf"{got}$"):
            model(torch.tensor(tokens))


def test_global_layers_must_agree_on_the_gain_they_share():
    """The shared multiplier took the first global layer's scaling_init, silently dropping another layer's; and it
    was built from a layer without attention when that came first (then unused, or at an init no layer asked for).
    Layers of other query_scaling, or other a, b, c of sqrt_log_n / log_bn, shared one multiplier of different gains."""
    spec = {"preset": "ssmax", "learnable_scaling": "global", "scaling_init": 0.5}
    with pytest.raises(ConfigError, match=r"^GPTConfig\.layer_attention\.scaling_init=2\.0 is not valid; it must be "
                       r"0\.5, the scaling_init of the first layer with learnable_scaling='global' \(they share one "
                       r"multiplier\)$"):
        tiny(attention=spec, layer_attention=[{"layers": [1], "spec": {"scaling_init": 2.0}}])
    with pytest.raises(ConfigError, match=r"^GPTConfig\.layer_attention\.query_scaling='sqrt_log_n' is not valid; it "
                       r"must be 'log_n', the query_scaling of the first"):    # s of log n and r of sqrt(2 log n)
        tiny(attention=spec, layer_attention=[{"layers": [1], "spec": {"query_scaling": "sqrt_log_n"}}])
    sqrt = {"preset": "sqrt_log_n", "learnable_scaling": "global"}     # r of a + r sqrt(2 log(b n + c)): a, b, c too
    for field, value in (("scaling_a", 0.5), ("scaling_b", 0.3), ("scaling_c", 1.0)):
        with pytest.raises(ConfigError, match=rf"^GPTConfig\.layer_attention\.{field}={value} is not valid; it must "
                           rf"be {getattr(AttentionSpec.preset('sqrt_log_n'), field)}, the {field} of the first"):
            tiny(attention=sqrt, layer_attention=[{"layers": [1], "spec": {field: value}}])
    tiny(attention=spec, layer_attention=[{"layers": [1], "spec": {"scaling_b": 0.3}}])   # log_n reads no a, b, c
    tiny(attention=spec, layer_attention=[{"layers": [1], "spec": {"learnable_scaling": "head", "scaling_init": 2.0}}])
    later = {"layers": [1, 2], "spec": {"scaling_init": 2.0}}
    model = GPT(tiny(attention=spec, no_attention_layers=[0], layer_attention=[later]))
    shared = model.scaling_multiplier
    assert shared.item() == 2.0 and model.blocks[1].attn.scaling.multiplier is shared
    unused = GPT(tiny(attention="ssmax", no_attention_layers=[0], layer_attention=[{"layers": [0], "spec": spec}]))
    assert unused.scaling_multiplier is None


def test_init_std_and_gates_keep_their_init():
    torch.manual_seed(0)
    model = GPT(tiny(dim=64, heads=4, layers=2, attention="gated"))
    for block in model.blocks:
        assert torch.count_nonzero(block.attn.gate.weight) == 0          # 2sigmoid gate: identity at init
        assert abs(block.attn.q_proj.weight.std().item() - 0.02) < 0.003
    assert abs(model.embed.weight.std().item() - 0.02) < 0.003
    assert model.head.weight is model.embed.weight                          # tied by default
    untied = GPT(tiny(tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight
    sig = GPT(tiny(attention={"gate": "head", "gate_act": "sigmoid"}))
    assert torch.count_nonzero(sig.blocks[0].attn.gate.weight) > 0


def test_lm_loss_honors_mask_z_loss_and_cap():
    torch.manual_seed(0)
    model = GPT(tiny(head="lm"))
    batch = fake_batch("lm")
    out = model(batch.tokens)
    loss, per = model.loss(out, batch)
    ce = F.cross_entropy(out.flatten(0, 1), batch.targets.flatten(), reduction="none").view(3, 7)
    m = batch.loss_mask
    torch.testing.assert_close(loss, ce[m].mean())
    torch.testing.assert_close(per[m], ce[m])
    assert (per[~m] == 0).all()
    # unmasked labels may be anything (e.g. -100): they are ignored
    bad = SimpleNamespace(**{**vars(batch), "targets": torch.where(m, batch.targets, -100)})
    torch.testing.assert_close(model.loss(out, bad)[0], loss)
    zmodel = GPT(tiny(head="lm", z_loss=1e-2))
    zmodel.load_state_dict(model.state_dict())
    zloss, zper = zmodel.loss(zmodel(batch.tokens), batch)
    lse = torch.logsumexp(out, -1)
    torch.testing.assert_close(zloss, ce[m].mean() + 1e-2 * lse[m].square().mean())
    torch.testing.assert_close(zper, per)
    capped = GPT(tiny(head="lm", logit_cap=0.01))
    capped.load_state_dict(model.state_dict())
    logits = capped(batch.tokens)
    torch.testing.assert_close(logits, 0.01 * torch.tanh(out / 0.01))
    assert logits.abs().max() <= 0.01


def test_regress_and_classify_losses():
    torch.manual_seed(0)
    model = GPT(tiny(head="regress"))
    batch = fake_batch("regress")
    out = model(batch.tokens)
    loss, per = model.loss(out, batch)
    m = batch.loss_mask
    torch.testing.assert_close(loss, (out - batch.targets).abs()[m].mean())
    assert (per[~m] == 0).all()
    model = GPT(tiny(head="classify", num_classes=4, mlp="relu2"))
    batch = fake_batch("classify")
    out = model(batch.tokens)
    loss, per = model.loss(out, batch)
    torch.testing.assert_close(per, F.cross_entropy(out, batch.targets, reduction="none"))
    torch.testing.assert_close(loss, per.mean())
    # the classify head reads the last position only
    t2 = batch.tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % 13
    assert not torch.allclose(model(t2), out)


def test_a_classify_head_refuses_sequences_without_positions():
    """Tokens of length 0 failed inside torch with 'IndexError: index -1 is out of bounds for dimension 1 with size 0';
    the lm and regress heads give an empty output there."""
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^GPT: the classify head reads each sequence's last position, but the "
                       r"tokens have none \(\(2, 0\)\)$"):
        GPT(tiny(head="classify", num_classes=4))(empty)
    assert GPT(tiny(head="regress"))(empty).shape == (2, 0)
    assert GPT(tiny())(empty).shape == (2, 0, 13)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"GPTConfig\.norm_placement='middle'.*pre, post, peri"):
        tiny(norm_placement="middle")
    with pytest.raises(ConfigError, match=r"GPTConfig\.heads=3.*divisor of dim=16"):
        tiny(heads=3)
    with pytest.raises(ConfigError, match=r"GPTConfig\.attention\.out_norm='bogus'.*head_layer"):
        tiny(attention={"out_norm": "bogus"})
    with pytest.raises(ValueError, match="vocab_size is None"):
        GPT(GPTConfig())
    assert math.isclose(tiny().to_dict()["attention"]["softmax_p"], 1.0)


def test_gpt_checks_a_config_changed_after_it_was_made():
    """A field set after `GPTConfig` was built is checked (and converted) when the model is made: a preset name
    becomes its spec, an invalid value is a ConfigError naming the field; the caller's config is left as it was."""
    cfg = GPTConfig(vocab_size=10, dim=16, heads=2, layers=1)
    cfg.attention = "l2"
    model = GPT(cfg)
    assert model.config.attention == AttentionSpec.preset("l2") and cfg.attention == "l2"
    cfg.heads = 3
    with pytest.raises(ConfigError, match="GPTConfig.heads"):
        GPT(cfg)
    with pytest.raises(ValueError, match="GPTConfig"):
        GPT({"vocab_size": 10})
