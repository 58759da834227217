"""The seeds' model features, each against a few lines of explicit torch that compute what the seed computes:
seed 001's parallel block, first-token embedding and scale_grad_by_freq; seed 003's attention-only minimal
model; seed 000's value embeddings, output gate width, U-net skip, MLP-only layer, soft-cap and RoPE schedule;
per-module init; float32 heads under autocast."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lengthgen import GPT, GPTConfig
from lengthgen.attention import Attention, AttentionSpec
from lengthgen.attention import functional as fn
from lengthgen.attention.extras import OutputGate
from lengthgen.config import ConfigError

F64 = dict(atol=1e-10, rtol=1e-10)


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=11, dim=8, layers=2, heads=2, mlp_ratio=2.0, attention="nope")
    base.update(kw)
    return GPTConfig(**base)


def model64(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(**kw)).double()


def causal_attention(h: torch.Tensor, attn: Attention, value: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention without positions, written out: merged heads (B, L, H*D) before o_proj."""
    b, length, _ = h.shape
    heads, d = attn.heads, attn.head_dim
    q, k, v = (F.linear(h, m.weight, m.bias).view(b, length, heads, d).transpose(1, 2)
               for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    if value is not None:
        v = v + value.view(b, length, heads, d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, heads * d)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# ---------------------------------------------------------------------------------------------------
# seed 001


def test_parallel_block_is_seed_001s_block():
    """x + out([gelu_tanh(pre), attention(q, k, v)]) with q, k, v, pre from one biased projection of LN(x)."""
    model = model64(block="parallel", mlp="gelu_tanh", mlp_ratio=1.0, linear_bias=True)
    block = model.blocks[0]
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    h = F.layer_norm(x, (8,), block.norm1.weight, block.norm1.bias)
    pre = F.linear(h, block.fc.weight, block.fc.bias)
    expected = x + F.linear(torch.cat([gelu_tanh(pre), causal_attention(h, block.attn)], -1), block.out.weight,
                            block.out.bias)
    torch.testing.assert_close(block(x), expected, **F64)
    assert block.out.weight.shape == (8, 8 + 8) and block.attn.o_proj.__class__.__name__ == "Identity"
    # attention-only parallel block: only the attention branch goes through `out`
    lone = model64(block="parallel", mlp_ratio=0.0).blocks[0]
    h = F.layer_norm(x, (8,), lone.norm1.weight, lone.norm1.bias)
    torch.testing.assert_close(lone(x), x + F.linear(causal_attention(h, lone.attn), lone.out.weight), **F64)


def rms(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_peri_dropout_acts_on_the_normalized_branch(block):
    """peri with dropout p: x + drop(N'(F(N(x)))), the residual branch dropped after its output norm (dropping
    before N' would let the norm undo the 1/(1-p) rescaling: train and eval outputs would differ in mean)."""
    model = model64(block=block, norm="rms", norm_affine=False, norm_placement="peri", dropout=0.5, mlp="relu2")
    b = model.blocks[0].train()
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    torch.manual_seed(5)
    out = b(x)
    torch.manual_seed(5)   # the same dropout masks, drawn in the same order
    if block == "parallel":
        h = rms(x)
        branch = torch.cat([F.relu(F.linear(h, b.fc.weight)).square(), causal_attention(h, b.attn)], -1)
        expected = x + F.dropout(rms(F.linear(branch, b.out.weight)), 0.5)
    else:
        a = F.linear(causal_attention(rms(x), b.attn), b.attn.o_proj.weight)
        x1 = x + F.dropout(rms(a), 0.5)
        m = F.linear(F.relu(F.linear(rms(x1), b.mlp.fc.weight)).square(), b.mlp.proj.weight)
        expected = x1 + F.dropout(rms(m), 0.5)
    torch.testing.assert_close(out, expected, **F64)


def test_gelu_tanh_mlp():
    model = model64(mlp="gelu_tanh")
    mlp, x = model.blocks[0].mlp, torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(mlp(x), F.linear(gelu_tanh(F.linear(x, mlp.fc.weight)), mlp.proj.weight), **F64)
    assert not torch.allclose(mlp(x), GPT(tiny(mlp="gelu")).double().blocks[0].mlp.proj(
        F.gelu(F.linear(x, mlp.fc.weight))))


def test_first_token_embedding_adds_a_position_0_vector_and_another_for_the_rest():
    model = model64(layers=1, mlp_ratio=0.0, first_token_embedding=True, norm_placement="post")
    tokens = torch.randint(11, (2, 5))
    e, p = model.embed.weight, model.first_embed.weight
    assert p.shape == (2, 8)
    x = e[tokens] + torch.stack([p[0]] + [p[1]] * 4)
    block = model.blocks[0]
    y = F.layer_norm(x + block.attn.o_proj(causal_attention(x, block.attn)), (8,), block.norm1.weight,
                     block.norm1.bias)
    torch.testing.assert_close(model(tokens), y @ e.T, **F64)


def test_scale_grad_by_freq_divides_each_rows_gradient_by_its_count():
    tokens = torch.tensor([[1, 1, 1, 4], [4, 7, 1, 2]])
    grads = []
    for scaled in (False, True):
        model = model64(scale_grad_by_freq=scaled, tie_embeddings=False)
        model(tokens).square().sum().backward()
        grads.append(model.embed.weight.grad)
    counts = torch.bincount(tokens.flatten(), minlength=11).double()
    assert grads[0][1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0] / counts.clamp(min=1)[:, None], **F64)


# ---------------------------------------------------------------------------------------------------
# seed 003: attention-only minimal models


@pytest.mark.parametrize("placement", ["pre", "post", "peri"])
def test_minimal_attention_only_model(placement):
    """One layer, one head, d = v - 1, no positions, RMSNorm, untied embedding E and unembedding U."""
    v = 6
    model = model64(vocab_size=v + 1, dim=v - 1, heads=1, layers=1, mlp_ratio=0.0, norm="rms",
                    norm_placement=placement, tie_embeddings=False)
    block = model.blocks[0]
    assert block.mlp is None and block.norm2 is None and not any("mlp" in n for n, _ in model.named_parameters())
    tokens = torch.randint(v + 1, (3, 6))
    rms = lambda t, norm: F.rms_norm(t, (v - 1,), norm.weight, norm.eps)  # noqa: E731
    x = model.embed.weight[tokens]
    attend = lambda h: block.attn.o_proj(causal_attention(h, block.attn))  # noqa: E731
    if placement == "pre":
        x = rms(x + attend(rms(x, block.norm1)), model.final_norm)
    elif placement == "post":
        x = rms(x + attend(x), block.norm1)
    else:
        x = rms(x + rms(attend(rms(x, block.norm1)), block.norm1_out), model.final_norm)
    torch.testing.assert_close(model(tokens), x @ model.head.weight.T, **F64)


# ---------------------------------------------------------------------------------------------------
# seed 000's modded-nanogpt fork


def test_value_embeddings_are_gated_per_head_into_the_values_and_shared_by_index():
    cfg = dict(layers=5, value_embeds=[1, -1, 0, -1, 1], gate_width=3, attention={"position": "nope"})
    model = model64(**cfg)
    assert len(model.value_embeds) == 2 and model.value_embeds[0].weight.shape == (11, 8)
    assert model.blocks[1].value_gate is None and model.blocks[2].value_gate.weight.shape == (2, 3)
    assert torch.count_nonzero(model.value_embeds[0].weight) == 0     # zero init: no effect at the start
    with torch.no_grad():
        for p in [*model.value_embeds.parameters(), model.blocks[2].value_gate.weight]:
            p.normal_()
    tokens = torch.randint(11, (2, 5))
    block, ve = model.blocks[2], model.value_embeds[0](tokens)
    h = torch.randn(2, 5, 8, dtype=torch.float64)
    gate = 2 * torch.sigmoid(h[..., :3] @ block.value_gate.weight.T)           # (B, L, heads)
    term = (ve.view(2, 5, 2, 4) * gate[..., None]).reshape(2, 5, 8)
    torch.testing.assert_close(block.attn(h, value=block.value_gate(h, ve)),
                               block.attn.o_proj(causal_attention(h, block.attn, term)), **F64)
    # layers 0 and 4 read table 1, layer 2 table 0
    x = expected = model.embed(tokens)
    for i, b in enumerate(model.blocks):
        table = {0: 1, 2: 0, 4: 1}.get(i)
        expected = b(expected, None, None if table is None else model.value_embeds[table](tokens))
    torch.testing.assert_close(model.features(tokens), model.final_norm(expected), **F64)
    assert x is not expected


def test_unet_skip_adds_a_gated_copy_of_an_earlier_output():
    model = model64(layers=4, skips=[[0, 3]], gate_width=2)
    gate = model.skip_gates[0]
    assert math.isclose(gate.lam.item(), -1.5) and torch.count_nonzero(gate.weight) == 0
    with torch.no_grad():
        gate.weight.normal_()
    tokens = torch.randint(11, (2, 5))
    x0 = x = model.embed(tokens)
    x = saved = model.blocks[0](x)
    x = model.blocks[2](model.blocks[1](x))
    weight = torch.sigmoid(torch.tensor(-1.5, dtype=torch.float64)) * 2 * torch.sigmoid(x0[..., :2] @ gate.weight.T)
    x = model.blocks[3](x + weight * saved)
    torch.testing.assert_close(model.features(tokens), model.final_norm(x), **F64)
    assert abs(torch.sigmoid(torch.tensor(-1.5)) - 0.1824) < 1e-4                # the seed's weight at init


def test_layer_without_attention_is_an_mlp_block():
    model = model64(layers=3, no_attention_layers=[-2])
    block, x = model.blocks[1], torch.randn(2, 5, 8, dtype=torch.float64)
    assert block.attn is None and block.norm1 is None and len(model.attentions) == 2
    torch.testing.assert_close(block(x), x + block.mlp(block.norm2(x)), **F64)


def test_output_gate_reads_the_first_gate_width_channels():
    spec = AttentionSpec(gate="head", gate_width=3)
    gate = OutputGate(spec, dim=8, heads=2, head_dim=4).double()
    assert gate.weight.shape == (2, 3)
    y, x = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    expected = y * torch.sigmoid(x[..., :3] @ gate.weight.T).transpose(1, 2)[..., None]
    torch.testing.assert_close(gate(y, x), expected, **F64)
    with pytest.raises(ValueError, match="gate_width=9 exceeds the layer width 8"):
        OutputGate(AttentionSpec(gate="head", gate_width=9), dim=8, heads=2, head_dim=4)


def test_seed_000_gate_multiplies_the_avnorm_output_per_head():
    """y = GroupNorm_heads(attention) * sigmoid(h[..., :12] W^T) per head, then the output projection."""
    torch.manual_seed(0)
    spec = dict(position="nope", out_norm="head_layer", gate="head", gate_width=12, base_scale=0.1)
    layer = Attention(16, 2, spec).double()
    with torch.no_grad():
        layer.gate.weight.normal_()
    h = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v = (m(h).view(2, 7, 2, 8).transpose(1, 2) for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    scores = (q @ k.transpose(-1, -2) * 0.1).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(14, 16)
    y = F.group_norm(y, 2, eps=1e-5).view(2, 7, 2, 8)                                   # AVNorm (seed 000)
    y = y * torch.sigmoid(h[..., :12] @ layer.gate.weight.T)[..., None]                   # the gate after it
    torch.testing.assert_close(layer(h), layer.o_proj(y.reshape(2, 7, 16)), **F64)


def test_half_truncated_rope_schedule():
    """Seed 000: 32 of 64 pairs rotate, frequencies log-spaced from 1 down to 1/1024; the rest do not rotate."""
    freqs = fn.rope_frequencies(128, 10000.0, 0.5, min_freq=1 / 1024)
    expected = torch.tensor([1024.0 ** (-i / 31) for i in range(32)] + [0.0] * 32)
    torch.testing.assert_close(freqs, expected)
    layer = Attention(256, 2, dict(position="prope", prope_fraction=0.5, rope_min_freq=1 / 1024))
    torch.testing.assert_close(layer.rope_freqs, expected)


def test_sigmoid_soft_cap_and_embedding_norm():
    plain = model64(logit_cap=None)
    capped = model64(logit_cap=23.0, logit_cap_form="sigmoid")
    capped.load_state_dict(plain.state_dict())
    tokens = torch.randint(11, (2, 5))
    torch.testing.assert_close(capped(tokens), 23 * torch.sigmoid((plain(tokens) + 5) / 7.5), **F64)
    normed = model64(embed_norm=True, norm="rms", norm_affine=False, layers=1)
    assert not any("norm" in name for name, _ in normed.named_parameters())
    x = normed.embed(tokens)
    torch.testing.assert_close(normed.features(tokens),
                               F.rms_norm(normed.blocks[0](F.rms_norm(x, (8,), eps=1e-5)), (8,), eps=1e-5), **F64)


# ---------------------------------------------------------------------------------------------------
# init and heads


def test_init_normal_uniform_torch_and_overrides():
    torch.manual_seed(0)
    uniform = GPT(tiny(dim=64, heads=4, init="uniform", init_std=0.05, tie_embeddings=False))
    w = uniform.blocks[0].attn.q_proj.weight
    assert w.abs().max() <= math.sqrt(3) * 0.05 and abs(w.std().item() - 0.05) < 0.005
    torch.manual_seed(0)
    seeded = GPT(tiny(dim=64, heads=4, block="parallel", linear_bias=True, init="torch", head="regress",
                      init_overrides={"embed.weight": 0.01, "blocks.*.out.weight": 0.0, "blocks.1.out.weight": 0.2,
                                      "head.weight": 0.03}))
    q = seeded.blocks[0].attn.q_proj
    assert q.weight.abs().max() <= 1 / 8 and abs(q.weight.std().item() - 1 / math.sqrt(3 * 64)) < 0.005
    assert q.bias.abs().max() <= 1 / 8 and torch.count_nonzero(q.bias) == 64          # PyTorch's default
    assert abs(seeded.embed.weight.std().item() - 0.01) < 0.002
    assert torch.count_nonzero(seeded.blocks[0].out.weight) == 0                   # 0: zeros
    assert abs(seeded.blocks[1].out.weight.std().item() - 0.2) < 0.02              # later patterns win
    assert abs(seeded.head.weight.std().item() - 0.03) < 0.015 and seeded.head.bias.abs().max() <= 1 / 8
    with pytest.raises(ConfigError, match=r"model.init_overrides: pattern 'blocks.\*.nothing' matches no "
                                          r"parameter; the parameters are embed.weight, "):
        GPT(tiny(init_overrides={"blocks.*.nothing": 0.0}))


def test_regress_and_classify_heads_run_in_float32_under_autocast():
    """bfloat16 rounds 5000.3 to 4992; the heads and their losses stay in float32."""
    assert torch.tensor(5000.3).bfloat16().item() == 4992.0
    model = GPT(tiny(head="regress"))
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.fill_(5000.3)
    tokens = torch.randint(11, (2, 5))
    batch = SimpleNamespace(targets=torch.full((2, 5), 5000.0), loss_mask=torch.ones(2, 5, dtype=torch.bool))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens)
        loss, _ = model.loss(out, batch)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((2, 5), 5000.3))
    assert loss.dtype == torch.float32 and abs(loss.item() - 0.3) < 1e-3
    classify = GPT(tiny(head="classify", num_classes=3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert classify(tokens).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("head", ["regress", "classify"])
def test_regress_and_classify_heads_of_a_model_cast_to_another_dtype(head, dtype):
    """``model.to(dtype)`` (bfloat16 inference, float64 checks) crashed in the head: it fed float32 features to
    weights of the model's dtype. The head computes in float32, or float64 for a float64 model."""
    model = GPT(tiny(head=head, num_classes=3)).to(dtype)
    tokens = torch.randint(11, (2, 5))
    out = model(tokens)
    compute = torch.promote_types(dtype, torch.float32)
    features = model.features(tokens)
    features = features[:, -1] if head == "classify" else features
    want = torch.nn.functional.linear(features.to(compute), model.head.weight.to(compute), model.head.bias.to(compute))
    assert out.dtype == compute
    torch.testing.assert_close(out, want.squeeze(-1) if head == "regress" else want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# config errors


@pytest.mark.parametrize("changes, match", [
    (dict(mlp_ratio=0.0, no_attention_layers=[0]), "neither attention nor an MLP"),
    (dict(no_attention_layers=[2]), r"no_attention_layers\[0\]=2"),
    (dict(value_embeds=[0]), "one entry per layer"),
    (dict(value_embeds=[0, -2]), r"value_embeds\[1\]=-2"),
    (dict(value_embeds=[0, 0], no_attention_layers=[1]), "-1 at layers without attention"),
    (dict(skips=[[1, 1]]), "from < to < layers=2"),
    (dict(block="parallel", norm_placement="hybrid"), "block='parallel'"),
    (dict(block="parallel", no_attention_layers=[0]), "keeps its attention branch"),
    (dict(mlp_ratio=-1.0), "mlp_ratio=-1.0"),
    (dict(init="xavier"), "init='xavier'.*normal, uniform, torch"),
    (dict(logit_cap_form="softcap"), "tanh, sigmoid"),
    (dict(init_overrides={"head.weight": "big"}), r"init_overrides.head.weight='big' is not valid; it must be a "
                                                  "finite float32 number >= 0"),
])
def test_bad_model_options_name_the_key(changes, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**changes)


def test_value_embedding_tables_must_be_numbered_from_zero():
    with pytest.raises(ConfigError, match="tables must be numbered 0, 1"):
        GPT(tiny(value_embeds=[1, -1]))
