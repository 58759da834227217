"""Evaluation: position buckets, blockwise diagnostics against the dense weights, the one evaluator on a tiny
model (its device, autocast, mode and seeding), long-document sources."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from lengthgen.attention import Attention, AttentionSpec, attend
from lengthgen.config import ConfigError
from lengthgen.data.tasks import make_task
from lengthgen.data.tasks.base import Batch
from lengthgen.eval import LengthEval, LongDocuments, eval_generator, evaluate
from lengthgen.eval.buckets import bucket_edges, bucket_means, prefix_means
from lengthgen.eval.diagnostics import attention_stats, model_diagnostics
from lengthgen.model import GPT, GPTConfig


#: what `LongDocuments.describe` says of packed rows (no document is that long)
JOINED = ("a row joins documents, so a position's context spans earlier documents, or under document masking only "
          "its own")


def test_bucket_edges_are_powers_of_two_cut_at_length():
    assert bucket_edges(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert bucket_edges(8) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert bucket_edges(1) == [(0, 1)]


def test_bucket_means_on_hand_made_losses():
    # positions 0..7 carry losses 1..8; position 2 of row 1 is undefined
    values = torch.tensor([[1., 2, 3, 4, 5, 6, 7, 8], [1., 2, math.nan, 4, 5, 6, 7, 8]])
    rows = bucket_means(values)
    assert [(r.lo, r.hi) for r in rows] == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert [r.count for r in rows] == [2, 2, 3, 8]
    assert rows[1].mean == 2.0
    assert rows[2].mean == pytest.approx((3 + 4 + 4) / 3)
    assert rows[3].mean == pytest.approx(6.5)
    prefix = prefix_means(values)
    assert [(r.lo, r.hi) for r in prefix] == [(0, 1), (0, 2), (0, 4), (0, 8)]
    assert prefix[2].mean == pytest.approx((1 + 2 + 3 + 4 + 1 + 2 + 4) / 7)


def test_empty_bucket_is_nan():
    rows = bucket_means(torch.tensor([[1.0, math.nan, math.nan]]))   # buckets [0,1), [1,2), [2,3)
    assert math.isnan(rows[1].mean) and rows[1].count == 0


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


def test_diagnostics_in_query_blocks_equal_formulas_written_out(monkeypatch):
    """Blocks of 4 queries (each against its window's keys only), p = 2, ALiBi, log_n scaling, a window and
    documents; the distribution pi = softmax(logit) written out with F ops (not the library's dense oracle)."""
    from lengthgen.eval import diagnostics
    monkeypatch.setattr(diagnostics, "_query_block", lambda batch, heads, length: 4)
    torch.manual_seed(0)
    spec = AttentionSpec(softmax_p=2.0, distance="alibi", query_scaling="log_n", window=5, doc_masking=True)
    q, k, v = torch.randn(2, 2, 23, 8), torch.randn(2, 2, 23, 8), torch.randn(2, 2, 23, 8)
    doc = torch.tensor([[0] * 9 + [1] * 14, [0] * 20 + [1] * 3])
    stats = attention_stats(q, k, v, spec, doc_ids=doc)
    i, j = torch.arange(23)[:, None], torch.arange(23)[None]
    visible = (j <= i) & (i - j < 5) & (doc[:, None, :, None] == doc[:, None, None, :])      # (B, 1, L, L)
    slopes = torch.tensor([2.0 ** -4, 2.0 ** -8])[:, None, None]                             # 2^(-8(h+1)/H)
    logit = visible.sum(-1, keepdim=True).log() * (q @ k.transpose(-1, -2)).double() / math.sqrt(8) - slopes * (i - j)
    pi = logit.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = {"inv_wmax": 1 / pi.amax(-1), "entropy": -(pi * pi.clamp_min(1e-300).log()).sum(-1),
                "participation": pi.pow(2).sum(-1)}
    for name, value in expected.items():
        torch.testing.assert_close(stats[name], value.mean(0).float(), rtol=1e-5, atol=1e-5, msg=name)


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


def test_model_diagnostics_holds_one_layers_capture_at_a_time():
    # a long evaluation's diagnostics pass would hold every layer's q, k, v and outputs (4 L x dim each) at once,
    # beyond what the evaluation's memory check allows for; each layer's are released once its statistics are taken
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Attention(16, 2, layer_index=i) for i in range(3)])
    held = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: held.append(sum(bool(m.capture) for m in layers)))
    x = torch.randn(1, 24, 16)
    stats = model_diagnostics(layers, lambda: layers[2](layers[1](layers[0](x))))
    assert held == [0, 0, 0]
    assert [s["inv_wmax"].shape for s in stats] == [(2, 24)] * 3


def test_evaluate_tiny_model_by_length():
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    results = evaluate(model, task, [32, 8, 16], tokens_per_length=64, seed=3).lengths
    assert [r.length for r in results] == [8, 16, 32]
    assert [r.batch_size for r in results] == [8, 4, 2] and results[0].batch == "8 sampled sequences"
    last = results[-1]
    assert {"loss", "abs_error"} <= set(last.at_length)
    assert [b.lo for b in last.buckets["abs_error"]] == [0, 1, 2, 4, 8, 16]
    assert last.diagnostics and not results[0].diagnostics
    assert len(last.diagnostics) == 1 and "inv_wmax" in last.diagnostics[0]
    # at_length is the mean over positions [L/2, L): the last bucket
    assert last.at_length["abs_error"] == pytest.approx(last.buckets["abs_error"][-1].mean, rel=1e-6)
    # the seeding rule: a length's batch depends on (seed, length) only, and forward passes may be split
    again = evaluate(model, task, [32], tokens_per_length=64, seed=3, diagnostics=False, forward_tokens=32)
    assert again.lengths[0].at_length == pytest.approx(last.at_length, rel=1e-6)
    assert again.eval_seed == 3 and again.provenance.device == "cpu"
    other = evaluate(model, task, [32], tokens_per_length=64, seed=4, diagnostics=False).lengths[0]
    assert other.at_length != last.at_length


@pytest.mark.parametrize("name, kwargs, metric, worst", [
    ("counting", {}, "abs_error", math.inf), ("counting", {}, "sq_error", math.inf),
    ("counting", {}, "rel_error", math.inf), ("dyck", {"num_types": 8}, "tvd", math.inf),
    ("dyck", {"num_types": 8}, "legal_accuracy", -math.inf)])
def test_a_non_finite_output_counts_as_the_worst_value_not_as_unscored(name, kwargs, metric, worst):
    """NaN marks unscored positions; a model whose output is NaN on some sequences must not vanish from the means
    of the loss or of any metric whose direction the task states."""
    task = make_task(name, **kwargs)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2, head=task.head,
                          tie_embeddings=False))
    poison = 1 if name == "counting" else 7                          # a token some sequences hold, others not
    clean = evaluate(model, task, [16], tokens_per_length=128, diagnostics=False).lengths[0]
    assert math.isfinite(clean.at_length["loss"]) and math.isfinite(clean.at_length[metric])
    with torch.no_grad():
        model.embed.weight[poison] = math.nan      # a sequence holding it is NaN (0 * NaN in the masked matmul)
    batch = task.sample(8, 16, eval_generator(0, 16))
    seen = (batch.tokens == poison).any(1, keepdim=True) & batch.loss_mask
    assert 0 < int(seen.sum()) < seen.numel()
    with pytest.warns(UserWarning, match=f"not finite at {int(seen.sum())} scored positions: .*{metric}.* count as "
                                         r"their worst value \(\+-inf\) there"):
        failed = evaluate(model, task, [16], tokens_per_length=128, diagnostics=False).lengths[0]
    assert failed.at_length["loss"] == math.inf and failed.mean["loss"] == math.inf
    assert failed.at_length[metric] == worst and failed.buckets[metric][-1].mean == worst


def test_a_roc_auc_over_one_class_is_undefined_with_its_reason():
    """Tomita's ROC AUC over a length's batch of one sequence (one class) is NaN: the evaluation says why, and keeps
    the reason through results.json; a batch of two or more holds both classes."""
    task = make_task("tomita")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2, head="classify", num_classes=2))
    short, long = evaluate(model, task, [16, 64], tokens_per_length=96, diagnostics=False).lengths   # 6 and 1 rows
    assert math.isfinite(short.at_length["roc_auc"]) and short.undefined == {}
    assert math.isnan(long.at_length["roc_auc"]) and math.isfinite(long.at_length["accuracy"])
    assert long.undefined == {"roc_auc": "one class at this length (a batch of 1 sequence)"}
    assert LengthEval.from_dict(dataclasses.asdict(long)).undefined == long.undefined


def test_evaluate_rejects_lengths_beyond_the_task():
    task = make_task("set_complement", num_tokens=16)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2))
    with pytest.raises(ValueError, match="set_complement"):
        evaluate(model, task, [8, 64], tokens_per_length=64)


@pytest.mark.parametrize("task, config, match", [
    ("dyck", dict(vocab_size=3), r"^evaluate: the model embeds 3 token ids but task 'dyck' uses 5$"),
    ("counting", dict(vocab_size=32), r"^evaluate: the model's lm head does not fit task 'counting', which needs the "
                                      r"regress head$"),
    ("dyck", dict(vocab_size=5, head="regress"), r"^evaluate: the model's regress head does not fit task 'dyck', "
                                                 r"which needs the lm head$"),
    ("tomita", dict(vocab_size=4), r"^evaluate: the model's lm head does not fit task 'tomita'")])
def test_evaluate_refuses_a_model_that_does_not_fit_the_task(task, config, match):
    """A model of too small a vocabulary or of another head ended in torch's 'index out of range in self' or a
    tensor size mismatch inside the loss or the task's metrics."""
    model = GPT(GPTConfig(dim=16, layers=1, heads=2, **config))
    with pytest.raises(ValueError, match=match):
        evaluate(model, make_task(task), [8], tokens_per_length=16)


def test_evaluate_names_a_model_or_source_of_the_wrong_type():
    """A task's name as the source was "AttributeError: 'str' object has no attribute 'sample'", and a model that is
    no module "'str' object has no attribute 'parameters'"."""
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    with pytest.raises(ValueError, match=r"^evaluate: source must be a data source with sample\(batch_size, length, "
                                         r"generator\) .*, got str$"):
        evaluate(model, "counting", [8], tokens_per_length=16)
    with pytest.raises(ValueError, match=r"^evaluate: model must be a torch.nn.Module, got str$"):
        evaluate("model.pt", task, [8], tokens_per_length=16)
    # a module of one's own with the default measure was "AttributeError: 'Embedding' object has no attribute
    # 'head_kind'"; with its own measure it runs
    with pytest.raises(ValueError, match=r"^evaluate: the model is a Embedding, not a lengthgen GPT, which the default "
                                         r"measure \(measure_gpt\) reads; give measure=\(model, source, batch\) -> "
                                         r"per-position values$"):
        evaluate(torch.nn.Embedding(task.vocab_size, 1), task, [8], tokens_per_length=16)
    def measure(model, source, batch):
        out = model(batch.tokens)[..., 0]
        return {"loss": (out - batch.targets).abs(), **source.metrics(out, batch)}

    own = evaluate(torch.nn.Embedding(task.vocab_size, 1), task, [8], tokens_per_length=16, measure=measure)
    assert own.at(8).at_length["loss"] > 0


@pytest.mark.parametrize("name, edit, message", [
    ("counting", lambda b: setattr(b, "targets", b.targets[:, 1:]),
     r"returned targets \(4, 7\) torch.float32; with head 'regress' it must be \(B, L\) = \(4, 8\) float"),
    ("mqar", lambda b: setattr(b, "loss_mask", b.loss_mask.long()),
     r"returned loss_mask \(4, 8\) torch.int64; with head 'lm' it must be \(B, L\) = \(4, 8\) bool"),
    ("mqar", lambda b: setattr(b, "targets", b.targets + 1000),
     r"returned targets in \[\d+, \d+\] where loss_mask is set; they must be in \[0, vocab_size\) = \[0, 256\)")])
def test_evaluate_holds_a_sources_batches_to_the_contract(monkeypatch, name, edit, message):
    """evaluate() from Python drew batches unchecked (training checks a task's first sequence): short targets were a
    broadcasting RuntimeError deep in the loss, an integer loss mask torch.where's, targets beyond the vocabulary the
    cross-entropy's IndexError."""
    task = make_task(name)
    sample = task.sample

    def broken(batch_size, length, generator):
        batch = sample(batch_size, length, generator)
        edit(batch)
        return batch

    monkeypatch.setattr(task, "sample", broken)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head=task.head, dim=16, layers=1, heads=2))
    with pytest.raises(ConfigError, match=rf"^data.task: .*\.sample\(4, 8, generator\) {message}"):
        evaluate(model, task, [8], tokens_per_length=32)


@pytest.mark.parametrize("lengths, match", [([16, 0], r"lengths\[1\]=0 is not valid"),
                                            (16, r"^lengths=16 is not valid; it must be a list"),   # was a TypeError
                                            ("16", r"^lengths='16' is not valid; it must be a list"),
                                            ([-3], r"lengths\[0\]=-3 is not valid"),
                                            ([8.5], r"lengths\[0\]=8.5 is not valid")])
def test_evaluate_refuses_lengths_below_one_naming_them(lengths, match):
    """A length of 0 was a ZeroDivisionError, a negative one torch's 'expected non-negative integer'."""
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    with pytest.raises(ConfigError, match=match):
        evaluate(model, task, lengths, tokens_per_length=64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_per_length=0), r"^tokens_per_length=0 is not valid; it must be an integer >= 1$"),
    (dict(tokens_per_length=-64), r"^tokens_per_length=-64 is not valid"),
    (dict(seed=-1), r"^seed=-1 is not valid; it must be an integer >= 0$"),
    (dict(forward_tokens=0), r"^forward_tokens=0 is not valid; it must be an integer >= 1, or none$"),
    (dict(autocast=torch.int32), r"^autocast=torch.int32 is not valid; it must be None, torch.float16 or "
                                 r"torch.bfloat16$")])
def test_evaluate_refuses_bad_arguments_naming_them(kwargs, match):
    """tokens_per_length <= 0 and forward_tokens = 0 silently ran one sequence (one row) at a time, an integer
    autocast dtype silently ran without autocast (torch only warns), and a negative seed was NumPy's 'expected
    non-negative integer'."""
    task = make_task("counting")
    model = GPT(GPTConfig(vocab_size=task.vocab_size, head="regress", dim=16, layers=1, heads=2))
    with pytest.raises(ConfigError, match=match):
        evaluate(model, task, [8], **{"tokens_per_length": 64, **kwargs})


def test_eval_batches_follow_the_seeding_rule():
    task = make_task("counting")
    a = task.sample(2, 16, eval_generator(5, 16)).tokens
    assert torch.equal(a, task.sample(2, 16, eval_generator(5, 16)).tokens)
    assert not torch.equal(a, task.sample(2, 16, eval_generator(6, 16)).tokens)
    # the evaluation stream is not the training stream of the same seed and index
    from lengthgen.data.config import step_generator

    assert not torch.equal(a, task.sample(2, 16, step_generator(5, 16)).tokens)


class _Stop(Exception):
    pass


class DeviceProbe(torch.nn.Module):
    """An lm model whose parameter is on ``device``: records where its inputs are, then stops the evaluation."""

    head_kind = "lm"

    def __init__(self, device: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=device))
        self.seen: list[tuple] = []

    def features(self, tokens, doc_ids=None):
        self.seen.append((tokens.device, doc_ids.device))
        raise _Stop


class PackedSource:
    """Two documents per row, so batches carry doc_ids."""

    name, vocab_size, max_length = "packed", 4, None

    def sample(self, batch_size, length, generator):
        tokens = torch.randint(4, (batch_size, length), generator=generator)
        doc_ids = (torch.arange(length) >= length // 2).long().expand(batch_size, length)
        return Batch(tokens, tokens, torch.ones(batch_size, length, dtype=torch.bool), doc_ids)


def test_evaluate_runs_batches_on_the_models_device_and_restores_its_mode():
    probe = DeviceProbe("meta")               # no batch is ever created on "meta"
    probe.train()
    with pytest.raises(_Stop):
        evaluate(probe, PackedSource(), [8], tokens_per_length=16)
    meta = torch.device("meta")
    assert probe.seen == [(meta, meta)]
    assert probe.training                     # eval mode during the evaluation, the caller's mode after


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_evaluate_runs_under_the_given_autocast(dtype):
    task = make_task("mqar", vocab_size=16)
    model = GPT(GPTConfig(vocab_size=task.vocab_size, dim=16, layers=1, heads=2))
    seen = []
    model.head.register_forward_hook(lambda m, args, out: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype, m.training)))
    evaluate(model, task, [16, 32], tokens_per_length=64, autocast=dtype)
    assert len(seen) == 3                                   # two lengths + the diagnostics pass (one chunk each)
    for enabled, autocast_dtype, out_dtype, training in seen:
        assert not training and enabled == (dtype is not None)
        assert out_dtype == (torch.bfloat16 if dtype else torch.float32)
        if dtype:
            assert autocast_dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


class FakeText:
    """A TextData stand-in: documents of the given lengths; rows are documents 0, 1, ... ."""

    vocab_size, name = 8, "fake"

    def __init__(self, lengths):
        self.stream = type("Stream", (), {"doc_lengths": np.array(lengths), "num_tokens": sum(lengths)})()

    def long_batch(self, length, count, seed):
        tokens = torch.full((count, length), 1)
        return Batch(tokens, tokens, torch.ones(count, length, dtype=torch.bool), torch.zeros(count, length).long())

    def sample(self, batch_size, length, generator):
        tokens = torch.full((batch_size, length), 2)
        return Batch(tokens, tokens, torch.ones(batch_size, length, dtype=torch.bool))


def test_long_documents_prefer_the_first_split_with_a_long_document():
    val, train = FakeText([40, 10]), FakeText([100, 90, 80])
    source = LongDocuments([("val split", val), ("train split", train)], train, trained_on=train)
    assert source.describe(4, 32) == "1 long document (val split; all there are, the same for every seed)"
    assert source.sample(4, 32, torch.Generator().manual_seed(0)).tokens.shape == (1, 32)
    assert source.describe(4, 64) == ("3 long documents (train split, which the run trained on; all there are, the "
                                      "same for every seed)")
    assert source.describe(2, 64) == "2 long documents (train split, which the run trained on)"
    batch = source.sample(4, 128, torch.Generator().manual_seed(0))
    assert source.describe(4, 128) == ("4 packed rows of the train split, which the run trained on (no document of "
                                       f"128 tokens: {JOINED})")
    assert batch.tokens.shape == (4, 128) and int(batch.tokens[0, 0]) == 2
    assert source.describe(4, 270) == ("4 packed rows of the train split, which the run trained on (no document of "
                                       f"270 tokens: {JOINED}; its 270 tokens repeat within each row)")


def test_a_length_evaluated_on_the_training_split_is_warned_once_when_it_is_sampled():
    """A length whose only long enough documents were in the training split fell back to them with no word on the
    console (only the results' label said so): now one `ConfigWarning` per length, none for the val split's."""
    import warnings

    from lengthgen.config import ConfigWarning

    val, train = FakeText([40, 10]), FakeText([100, 90, 80])
    source = LongDocuments([("val split", val), ("train split", train)], train, trained_on=train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for length in (32, 64, 128):
                source.sample(4, length, torch.Generator().manual_seed(0))
    assert [(w.category, str(w.message)) for w in caught] == [(ConfigWarning, (
        "no document of the val split has 64 tokens: length 64 is evaluated on 3 long documents (train split, "
        "which the run trained on; all there are, the same for every seed)"))]


def test_an_eval_length_beyond_the_whole_text_is_one_warning_line_about_the_text_it_evaluates(tmp_path, capsys):
    """Packed rows longer than the whole text repeat it: that was a two-line Python warning, a second one about
    the training split (check_length's probe, not what is evaluated), and the results said nothing about it."""
    import json

    from lengthgen.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"line {i} " * 40}) + "\n" for i in range(40)), encoding="utf-8")
    args = ["model.dim=16", "model.layers=1", "model.heads=2", "train.steps=1", "data.length=16", "data.kind=text",
            f"data.text.corpus={json.dumps(str(docs))}", "train.device=cpu"]
    assert main(["train", *[x for a in args for x in ("--set", a)], "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--lengths", "16,20000", "--tokens", "1", "--out",
                 str(tmp_path / "eval.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("lengthgen eval: warning: text:") and "/val:byte: rows of 20000 " \
        "tokens hold more than all" in err[0]
    rows = json.loads((tmp_path / "eval.json").read_text())["lengths"]
    total = err[0].split("all ")[1].split(" ")[0]
    assert rows[1]["batch"].endswith(f"(no document of 20000 tokens: {JOINED}; its {total} tokens repeat within each "
                                     "row)")
