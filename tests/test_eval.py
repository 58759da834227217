"""Evaluation: position buckets, blockwise diagnostics against the dense weights, evaluate() on a tiny model."""

import math

import pytest
import torch

from lengthgen.attention import Attention, AttentionSpec, attend
from lengthgen.data.tasks import make_task
from lengthgen.eval.buckets import bucket_edges, bucket_means, prefix_means
from lengthgen.eval.diagnostics import attention_stats, model_diagnostics
from lengthgen.eval.evaluate import evaluate
from lengthgen.model import GPT, GPTConfig


def test_bucket_edges_are_powers_of_two_cut_at_length():
    assert bucket_edges(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert bucket_edges(8) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert bucket_edges(1) == [(0, 1)]


def test_bucket_means_on_hand_made_losses():
    # positions 0..7 carry losses 1..8; position 2 of row 1 is undefined
    values = torch.tensor([[1., 2, 3, 4, 5, 6, 7, 8], [1., 2, math.nan, 4, 5, 6, 7, 8]])
    rows = bucket_means(values)
    assert [(r["lo"], r["hi"]) for r in rows] == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert [r["count"] for r in rows] == [2, 2, 3, 8]
    assert rows[1]["mean"] == 2.0
    assert rows[2]["mean"] == pytest.approx((3 + 4 + 4) / 3)
    assert rows[3]["mean"] == pytest.approx(6.5)
    prefix = prefix_means(values)
    assert [r["length"] for r in prefix] == [1, 2, 4, 8]
    assert prefix[2]["mean"] == pytest.approx((1 + 2 + 3 + 4 + 1 + 2 + 4) / 7)


def test_empty_bucket_is_nan():
    rows = bucket_means(torch.tensor([[1.0, math.nan, math.nan]]))   # buckets [0,1), [1,2), [2,3)
    assert math.isnan(rows[1]["mean"]) and rows[1]["count"] == 0


@pytest.mark.parametrize("spec", [
    AttentionSpec(),
    AttentionSpec(softmax_p=2.0, distance="alibi", query_scaling="log_n"),
    AttentionSpec(window=5, doc_masking=True, distance="scale_invariant"),
    AttentionSpec(query_scaling="sqrt_log_n", kv_heads=1),
])
def test_diagnostics_equal_dense_weights(spec):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 37, 8)
    k, v = torch.randn(2, spec.kv_heads or 2, 37, 8), torch.randn(2, spec.kv_heads or 2, 37, 8)
    doc = torch.tensor([[0] * 11 + [1] * 26, [0] * 30 + [1] * 7])
    stats = attention_stats(q, k, v, spec, doc_ids=doc)
    _, w = attend(q.double(), k.double(), v.double(), spec, doc_ids=doc, return_weights=True)
    dist = w / w.sum(-1, keepdim=True)                       # the attention distribution
    torch.testing.assert_close(stats["inv_wmax"], (1 / dist.amax(-1)).mean(0).float(), rtol=1e-5, atol=1e-5)
    ent = -(dist * dist.clamp_min(1e-300).log()).sum(-1).mean(0)
    torch.testing.assert_close(stats["entropy"], ent.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats["participation"], dist.pow(2).sum(-1).mean(0).float(), rtol=1e-5, atol=1e-5)


def test_model_diagnostics_records_every_layer_and_out_norm_rms():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Attention(16, 2, "avnorm", layer_index=i) for i in range(2)])
    x = torch.randn(1, 40, 16)
    stats = model_diagnostics(layers, lambda: layers[1](layers[0](x)))
    assert len(stats) == 2
    assert stats[0]["inv_wmax"].shape == (2, 40)
    # per-head LayerNorm output has RMS 1 (up to eps), whatever the raw RMS was
    torch.testing.assert_close(stats[0]["rms_post"], torch.ones(2, 40), atol=1e-3, rtol=0)
    assert (stats[0]["rms_pre"] < 0.99).all()
    assert all(layer.capture is None for layer in layers)


def test_evaluate_tiny_model_by_length():
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    results = evaluate(model, task, [32, 8, 16], tokens_per_length=64, seed=3)
    assert [r["length"] for r in results] == [8, 16, 32]
    last = results[-1]
    assert {"loss", "abs_error"} <= set(last["at_length"])
    assert [b["lo"] for b in last["buckets"]["abs_error"]] == [0, 1, 2, 4, 8, 16]
    assert "diagnostics" in last and "diagnostics" not in results[0]
    assert len(last["diagnostics"]) == 1 and "inv_wmax" in last["diagnostics"][0]
    # at_length is the mean over positions [L/2, L): the last bucket
    assert last["at_length"]["abs_error"] == pytest.approx(last["buckets"]["abs_error"][-1]["mean"], rel=1e-6)
    again = evaluate(model, task, [32], tokens_per_length=64, seed=3, diagnostics=False)[0]
    assert again["at_length"] == last["at_length"]


def test_evaluate_rejects_lengths_beyond_the_task():
    task = make_task("set_complement", num_tokens=16)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2))
    with pytest.raises(ValueError, match="set_complement"):
        evaluate(model, task, [8, 64], tokens_per_length=64)
