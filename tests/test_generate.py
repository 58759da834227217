"""Decoding with a `KVCache` equals recomputing the whole sequence, for every attention option and model option
(issue 13): the cached logits at every step, greedy and sampled `GPT.generate`, windows that keep only their last
keys, documents; and the errors of bad generation arguments."""

from __future__ import annotations

import pytest
import torch

from lengthgen import GPT, GPTConfig
from lengthgen.attention import PRESETS, Attention, KVCache
from lengthgen.config import ConfigError
from lengthgen.model.config import PLACEMENTS
from lengthgen.model.gpt import next_token

VOCAB = 23
F32 = dict(rtol=1e-4, atol=1e-5)
#: every mechanism at once: p-softmax, sqrt(2 log n) scaling with a per-head multiplier and QK-norm, ALiBi,
#: a window, documents, p-RoPE, GQA, AVNorm with its affine, an elementwise gate
COMBINED = dict(softmax_p=2.0, query_scaling="sqrt_log_n", learnable_scaling="head", scaling_init=1.3,
                qk_norm="layer", distance="alibi", window=6, doc_masking=True, position="prope",
                prope_fraction=0.5, kv_heads=1, out_norm="head_layer", out_norm_affine=True, gate="elementwise")
SPECS = {**{name: name for name in PRESETS}, "combined": COMBINED}

#: model options beyond attention (each on top of a small model; init_std 0.3 makes attention peaked, so a wrong
#: position or a missing key changes the logits)
MODELS = {
    "qk_norm_affine": dict(attention=dict(qk_norm="rms", qk_norm_affine=True)),
    "seed000_rope": dict(attention=dict(position="prope", prope_fraction=0.5, rope_min_freq=1 / 1024)),
    "gqa": dict(heads=4, attention=dict(kv_heads=2)),
    "out_norm_and_gates": dict(attention=dict(out_norm="head_rms", gate="head", gate_act="2sigmoid",
                                              gate_width=5), init_overrides={"*gate.weight": 0.3}),
    "value_embeddings": dict(layers=3, value_embeds=[0, -1, 0], gate_width=4),
    "unet_skip": dict(layers=3, skips=[(0, 2)], gate_width=4),
    "no_attention_layer": dict(layers=3, no_attention_layers=[1]),
    "parallel": dict(block="parallel", linear_bias=True, mlp="gelu_tanh"),
    "first_token_embedding": dict(attention="nope", first_token_embedding=True),
    "embed_norm_and_cap": dict(embed_norm=True, norm="rms", logit_cap=23.0, logit_cap_form="sigmoid"),
    "local_and_global": dict(layers=3, attention=dict(window=4),
                             layer_attention=[{"every": 3, "offset": 2, "spec": "nope"}]),
    "attention_only": dict(mlp_ratio=0.0, norm_placement="post"),
    **{f"placement_{p}": dict(layers=3, norm_placement=p, norm="rms") for p in PLACEMENTS},
}


def model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, dim=16, layers=2, heads=2, mlp_ratio=2.0, init_std=0.3, norm="layer")
    return GPT(GPTConfig(**{**cfg, **changes})).eval()


def tokens(batch: int = 2, length: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decoded(net: GPT, toks: torch.Tensor, chunks: list[int], doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of ``toks`` computed chunk by chunk (sizes ``chunks``) through one `KVCache`."""
    cache, out, lo = KVCache(), [], 0
    for size in chunks:
        docs = None if doc_ids is None else doc_ids[:, lo:lo + size]
        out.append(net(toks[:, lo:lo + size], doc_ids=docs, cache=cache))
        lo += size
    assert lo == toks.shape[1] and cache.length == lo
    return torch.cat(out, dim=1)


def assert_cache_equals_recomputation(net: GPT, doc_ids: torch.Tensor | None = None) -> None:
    toks = tokens()
    with torch.no_grad():
        full = net(toks, doc_ids=doc_ids)
        for chunks in ([1] * 13, [4, 3, 6]):
            torch.testing.assert_close(decoded(net, toks, chunks, doc_ids), full, **F32)
    prompt = toks[:, :4]
    greedy = net.generate(prompt, 9)
    assert torch.equal(greedy, net.generate(prompt, 9, cache=False))
    assert torch.equal(greedy[:, :4], prompt) and greedy.shape == (2, 13)
    with torch.no_grad():   # each generated token is the argmax of the full forward's logits at its step
        assert torch.equal(net(greedy[:, :-1]).argmax(-1)[:, 3:], greedy[:, 4:])


@pytest.mark.parametrize("name", SPECS)
def test_cache_equals_recomputation_for_every_preset_and_combined(name):
    assert_cache_equals_recomputation(model(attention=SPECS[name]))


@pytest.mark.parametrize("name", MODELS)
def test_cache_equals_recomputation_for_every_model_option(name):
    assert_cache_equals_recomputation(model(**MODELS[name]))


def test_documents_given_chunk_by_chunk():
    doc_ids = torch.tensor([[0] * 3 + [1] * 6 + [2] * 4, [5] * 9 + [6] * 4])
    net = model(attention=dict(doc_masking=True, query_scaling="log_n", distance="scale_invariant"))
    toks = tokens()
    with torch.no_grad():
        full = net(toks, doc_ids=doc_ids)
        assert not torch.allclose(full, net(toks), **F32)   # the documents matter
        for chunks in ([5] + [1] * 8, [2, 7, 4]):
            torch.testing.assert_close(decoded(net, toks, chunks, doc_ids), full, **F32)
        cache = KVCache()
        net(toks[:, :3], doc_ids=doc_ids[:, :3], cache=cache)
        with pytest.raises(ValueError, match="doc_ids with every chunk of positions or with none"):
            net(toks[:, 3:4], cache=cache)


def test_doc_ids_of_a_wrong_shape_leave_the_cache_as_it_was():
    """The first layer's cache was extended before attend checked the doc_ids: the cache was then broken (and an
    `Attention` layer used alone kept the failed chunk's keys)."""
    doc_ids = torch.tensor([[0] * 3 + [1] * 6 + [2] * 4, [5] * 9 + [6] * 4])
    net = model(attention=dict(doc_masking=True))
    toks = tokens()
    cache = KVCache()
    with torch.no_grad():
        for lo, hi in ((0, 3), (3, 13)):
            with pytest.raises(ValueError, match=rf"^KVCache: doc_ids must be \(batch, new positions\) = "
                               rf"\(2, {hi - lo}\), got \(2, 13\)$"):
                net(toks[:, lo:hi], doc_ids=doc_ids, cache=cache)
            assert not cache.broken and cache.length == lo and all(layer.seen == lo for layer in cache.layers.values())
            out = net(toks[:, lo:hi], doc_ids=doc_ids[:, lo:hi], cache=cache)
        torch.testing.assert_close(out, net(toks, doc_ids=doc_ids)[:, 3:], **F32)


def test_local_layers_keep_only_their_window():
    window = 4
    net = model(layers=3, attention=dict(window=window, query_scaling="log_n", distance="alibi"),
                layer_attention=[{"layers": [1], "spec": "baseline"}])
    cache = KVCache()
    with torch.no_grad():
        for i in range(13):
            net(tokens()[:, i:i + 1], cache=cache)
    assert [cache.layer(i).k.shape[2] for i in range(3)] == [window - 1, 13, window - 1]
    assert [cache.layer(i).seen for i in range(3)] == [13, 13, 13]
    assert_cache_equals_recomputation(net)


def test_attention_layer_alone_with_a_cache():
    torch.manual_seed(0)
    layer = Attention(16, 4, dict(COMBINED, kv_heads=2), layer_index=3).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    docs = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    cache = KVCache()
    parts = [layer(x[:, lo:hi], docs[:, lo:hi], cache=cache) for lo, hi in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(parts, 1), layer(x, docs), rtol=1e-10, atol=1e-10)
    assert list(cache.layers) == [3] and cache.layer(3).seen == 9


def test_an_attention_layer_whose_attend_fails_leaves_its_cache_as_it_was():
    """`LayerCache.extend` stored the new keys before `attend` ran: a backend that cannot run the spec (or any error
    in attend) left a lone layer's cache holding the failed chunk, and the retried chunk then saw its keys twice."""
    torch.manual_seed(0)
    layer = Attention(16, 2, dict(softmax_p=2.0, window=3), backend="dense").double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cache = KVCache()
    first = layer(x[:, :4], cache=cache)
    kept = (cache.layer(0).k, cache.layer(0).v)
    layer.backend = "sdpa"                                   # p = 2: sdpa refuses it, inside attend
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run this spec"):
        layer(x[:, 4:], cache=cache)
    assert cache.layer(0).seen == 4 and cache.layer(0).k is kept[0] and cache.layer(0).v is kept[1]
    layer.backend = "dense"
    rest = layer(x[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), layer(x), rtol=1e-10, atol=1e-10)


def test_batch_norm_decodes_in_eval_mode_and_refuses_training_mode():
    net = model(norm="batch")
    assert_cache_equals_recomputation(net)   # eval mode: running statistics, one token at a time
    net.train()
    with pytest.raises(ValueError, match="norm='batch' in training mode .* decode in eval mode"):
        net(tokens(), cache=KVCache())
    net.generate(tokens()[:, :3], 2)          # generate runs in eval mode and restores the mode
    assert net.training


@pytest.mark.parametrize("name", ["baseline", "combined"])
def test_sampling_with_and_without_cache_draws_the_same_tokens(name):
    net = model(attention=SPECS[name])
    prompt = tokens(length=3)
    draw = lambda cache: net.generate(prompt, 10, temperature=0.8, top_k=5, cache=cache,  # noqa: E731
                                      generator=torch.Generator().manual_seed(7))
    sampled = draw(True)
    assert torch.equal(sampled, draw(False))
    assert not torch.equal(sampled, net.generate(prompt, 10))   # not the greedy continuation
    one = net.generate(prompt, 6, temperature=5.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(one, net.generate(prompt, 6))


def test_next_token_top_k_draws_only_the_k_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).expand(2000, -1)
    g = torch.Generator().manual_seed(0)
    drawn = next_token(logits, temperature=1.0, top_k=2, generator=g)
    assert set(drawn.flatten().tolist()) == {1, 3}
    free = next_token(logits, temperature=1.0, generator=g)
    assert set(free.flatten().tolist()) == {0, 1, 2, 3, 4}
    assert next_token(logits[:1]).tolist() == [[1]]


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
def test_a_tiny_temperature_draws_the_argmax(temperature):
    """logits / 1e-45 overflow to inf (a softmax of nan) unless shifted by their maximum first."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).expand(50, -1)
    drawn = next_token(logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert drawn.flatten().tolist() == [1] * 50


@pytest.mark.parametrize("attention", ["baseline", "gated"])
def test_an_empty_batch_generates_an_empty_batch(attention):
    """(A gated model raised torch's reshape error here.)"""
    assert model(attention=attention).generate(torch.zeros(0, 5, dtype=torch.long), 3).shape == (0, 8)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_new_tokens=-1), ConfigError, r"^max_new_tokens=-1 is not valid; it must be an integer >= 0$"),
    (dict(temperature=-0.5), ConfigError, r"^temperature=-0.5 is not valid; it must be a finite float32 number >= 0$"),
    (dict(top_k=0), ConfigError, r"^top_k=0 is not valid; it must be an integer >= 1, or none$"),
    (dict(prompt=torch.zeros(3, dtype=torch.long)), ValueError, r"prompt must be \(batch, length >= 1\)"),
    (dict(prompt=torch.zeros(1, 3)), ValueError, r"token ids \(torch.long\), got torch.float32"),
    (dict(prompt=[[1, 2, 3]]), ValueError, r"^GPT.generate: prompt must be \(batch, length >= 1\) token ids "
     r"\(torch.long\), got list$"),     # a list was an AttributeError
    (dict(prompt=torch.tensor([[1, VOCAB]])), ValueError, rf"token ids must be in \[0, {VOCAB}\) \(model.vocab_size\), "
                                                          rf"got {VOCAB}"),
    (dict(prompt=torch.tensor([[-1, 2]])), ValueError, r"must be in \[0, \d+\) \(model.vocab_size\), got -1"),
])
def test_bad_generation_arguments(kwargs, error, match):
    args = {"prompt": tokens(length=3), "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        model().generate(args.pop("prompt"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize("head", ["regress", "classify"])
def test_generate_needs_an_lm_head(head):
    with pytest.raises(ValueError, match=rf"GPT.generate needs an lm head; this model's head is '{head}'"):
        model(head=head, num_classes=3).generate(tokens(length=3), 2)


def test_generate_masks_documents_at_each_bos():
    """With ``bos_id`` a document-masking model attends within each document, as in training, prompt and
    continuation alike: every generated token is the argmax of the full forward with BOS-derived doc_ids."""
    bos = 5
    net = model(attention=dict(doc_masking=True, query_scaling="log_n"))
    prompt = torch.tensor([[bos, 1, 2, 3, bos, 7, 8], [bos, 9, 9, 2, 4, 4, 1]])
    out = net.generate(prompt, 12, bos_id=bos)
    assert torch.equal(out, net.generate(prompt, 12, bos_id=bos, cache=False))
    with torch.no_grad():
        seen = out[:, :-1]
        logits = net(seen, doc_ids=(seen == bos).long().cumsum(1))
        assert torch.equal(logits.argmax(-1)[:, prompt.shape[1] - 1:], out[:, prompt.shape[1]:])
        assert not torch.equal(net(prompt)[0, -1], logits[0, prompt.shape[1] - 1])   # the documents matter
    forced = net.generate(torch.cat([out, torch.full((2, 1), bos)], 1), 3, bos_id=bos)   # a BOS late in the row
    with torch.no_grad():
        seen = forced[:, :-1]
        want = net(seen, doc_ids=(seen == bos).long().cumsum(1)).argmax(-1)[:, -3:]
    assert torch.equal(want, forced[:, -3:])
    with pytest.raises(ConfigError, match=rf"^bos_id={VOCAB} is not valid"):
        net.generate(prompt, 1, bos_id=VOCAB)


def test_a_chunk_of_another_batch_leaves_the_cache_usable():
    net = model()
    toks = tokens(batch=2, length=6)
    cache = KVCache()
    with torch.no_grad():
        net(toks[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"start a new KVCache for each batch"):
            net(tokens(batch=3, length=1), cache=cache)
        assert cache.length == 5 and all(layer.seen == 5 for layer in cache.layers.values())
        torch.testing.assert_close(net(toks[:, 5:], cache=cache)[:, -1], net(toks)[:, -1], **F32)


def test_a_forward_that_fails_part_way_breaks_the_cache(monkeypatch):
    net = model()
    cache = KVCache()
    with torch.no_grad():
        net(tokens(length=4), cache=cache)
        monkeypatch.setattr(net.blocks[1], "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            net(tokens(length=1), cache=cache)          # layer 0 was extended, layer 1 not
        monkeypatch.undo()
        with pytest.raises(ValueError, match="failed part-way; start a new KVCache"):
            net(tokens(length=1), cache=cache)


@pytest.mark.parametrize("cache", [True, {}])
def test_a_cache_that_is_not_a_kv_cache_is_named(cache):
    """``net(tokens, cache=True)`` (generate's flag) was an AttributeError: 'bool' object has no attribute 'length'."""
    with pytest.raises(ValueError, match=rf"^GPT: cache must be a KVCache \(lengthgen.attention\) or None, got "
                                         rf"{type(cache).__name__}$"):
        model()(tokens(length=4), cache=cache)


def test_two_attention_layers_with_one_layer_index_are_refused():
    torch.manual_seed(0)
    a1, a2 = Attention(16, 2), Attention(16, 2)
    cache = KVCache()
    x = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="two attention layers use layer_index 0"):
        a2(a1(x, cache=cache), cache=cache)


def test_top_k_keeps_exactly_k_tokens_when_logits_tie():
    logits = torch.zeros(500, 50)
    drawn = next_token(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert len(set(drawn.flatten().tolist())) == 3


def test_an_mlp_ratio_that_rounds_to_no_unit_is_refused():
    with pytest.raises(ConfigError, match=r"GPTConfig.mlp_ratio=0.01 is not valid; it must be 0 \(attention-only "
                                          r"blocks\) or more than 0.03125"):
        GPTConfig(vocab_size=10, dim=16, layers=2, heads=2, mlp_ratio=0.01)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_are_an_error_not_a_token(temperature, bad):
    """A diverged model: greedy would return the NaN's index, a draw torch's multinomial error."""
    logits = torch.tensor([[0.0, bad, 1.0]])
    with pytest.raises(ValueError, match=r"^next_token: the logits hold NaN or \+inf"):
        next_token(logits, temperature=temperature)
    masked = next_token(torch.tensor([[0.0, float("-inf"), 5.0]]).expand(200, -1), temperature=temperature,
                        generator=torch.Generator().manual_seed(0))   # -inf is a masked token, never drawn
    assert 1 not in masked.flatten().tolist() and 2 in masked.flatten().tolist()
    net = model()
    with torch.no_grad():
        net.head.weight.fill_(bad)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        net.generate(tokens(length=3), 2, temperature=temperature)


def test_generation_under_bf16_autocast_picks_from_full_precision_logits(monkeypatch):
    """The features run in bf16, the head's logits in the weights' float32 (bf16 would round them)."""
    import lengthgen.model.gpt as gpt
    seen = []
    monkeypatch.setattr(gpt, "next_token", lambda logits, *a: seen.append(logits) or logits.argmax(-1, keepdim=True))
    net = model()
    prompt = tokens(length=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net.generate(prompt, 2)
        features = net.features(out[:, :-1])[:, -1]
    assert [t.dtype for t in seen] == [torch.float32] * 2
    torch.testing.assert_close(seen[-1], net.logits(features.float()), rtol=0, atol=0)
    assert not torch.equal(seen[-1], seen[-1].bfloat16().float())   # the rounding the head no longer does


def test_generation_ends_when_every_row_has_written_a_stop_id():
    """``stop_ids``: the tokens are those generated without them, up to the step at which the last row wrote one
    (`lengthgen sample` stops at the document's end, not after ``max_new_tokens``)."""
    net = model()
    prompt = tokens(length=4)
    full = net.generate(prompt, 9)
    new = full[:, 4:]
    first, second = int(new[0, 2]), int(new[1, 5])
    step = lambda row, ids: next(i for i, t in enumerate(new[row].tolist()) if t in ids)      # noqa: E731
    ends = max(step(0, (first, second)), step(1, (first, second)))
    got = net.generate(prompt, 9, stop_ids=[first, second])
    assert ends < 8 and torch.equal(got, full[:, :4 + ends + 1])
    assert torch.equal(net.generate(prompt, 9, stop_ids=[first, second], cache=False), got)
    assert torch.equal(net.generate(prompt, 9, stop_ids=[]), full)
    for bad in ([VOCAB], [-1], 3, ["a"]):
        with pytest.raises(ConfigError, match="stop_ids"):
            net.generate(prompt, 9, stop_ids=bad)
