"""Long evaluation in bounded memory: `measure_gpt` takes an lm head's logits a chunk of positions at a time
(`GPT.logit_chunks`, `Batch.positions`), with the same loss and metrics as the whole forward, and no tensor of
the vocabulary's width beyond one chunk, whatever the length."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lengthgen.data.tasks import make_task
from lengthgen.data.tasks.base import Batch
from lengthgen.data.text import make_text_data
from lengthgen.eval import evaluate, measure_gpt
from lengthgen.model import GPT, GPTConfig
from lengthgen.model import gpt as gpt_module


def whole_forward(model: GPT, source, batch: Batch) -> dict[str, torch.Tensor]:
    """What `measure_gpt` computed before chunking: every logit at once."""
    output = model(batch.tokens, doc_ids=batch.doc_ids)
    per = model.loss(output, batch)[1].masked_fill(~batch.loss_mask, float("nan"))
    return {"loss": per, **source.metrics(output.float(), batch)}


def text_source(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"line {i} " * 40}) + "\n" for i in range(8)), encoding="utf-8")
    return make_text_data(str(docs), "byte", split="all")


@pytest.mark.parametrize("name", ["dyck", "set_complement", "mqar", "passkey", "text"])
def test_chunked_loss_and_metrics_equal_the_whole_forward(name, tmp_path, monkeypatch):
    source = text_source(tmp_path) if name == "text" else make_task(name)
    length = 40 if name != "mqar" else 35
    batch = source.sample(3, length, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=source.vocab_size, dim=16, layers=2, heads=2, init_std=0.3, z_loss=1e-3,
                          logit_cap=5.0)).eval()
    monkeypatch.setattr(gpt_module, "LOGIT_CHUNK", 3 * 7 * source.vocab_size)   # 7 positions of 3 rows
    assert len(list(model.logit_chunks(torch.zeros(3, length, 16)))) == -(-length // 7)
    with torch.no_grad():
        chunked, whole = measure_gpt(model, source, batch), whole_forward(model, source, batch)
    reported = {"loss"} if name == "text" else {"loss", source.metric, *source.also_reported}
    assert chunked.keys() == whole.keys() == reported
    for key in whole:
        torch.testing.assert_close(chunked[key], whole[key], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_positions_cut_per_position_fields_and_keep_the_rest():
    batch = make_task("dyck").sample(2, 12, torch.Generator().manual_seed(0))
    part = batch.positions(4, 9).positions(1, 3)
    assert part.start == 5 and part.tokens.shape == (2, 2)
    assert torch.equal(part.tokens, batch.tokens[:, 5:7]) and torch.equal(part.targets, batch.targets[:, 5:7])
    assert torch.equal(part.extra["legal"], batch.extra["legal"][:, 5:7])
    sets = make_task("set_complement", num_tokens=12).sample(2, 12, torch.Generator().manual_seed(0))
    assert torch.equal(sets.positions(3, 5).extra["first_pos"], sets.extra["first_pos"])   # per sequence
    tomita = make_task("tomita").sample(2, 12, torch.Generator().manual_seed(0))
    assert torch.equal(tomita.positions(3, 5).targets, tomita.targets)                      # one label per row


class WidestVocabTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns whose last axis is the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel())
        return out


class RandomText:
    """Random tokens as an lm source (no metrics beyond the loss)."""

    name, head, max_length, vocab_size = "random", "lm", None, 97

    def sample(self, batch_size, length, generator):
        tokens = torch.randint(self.vocab_size, (batch_size, length + 1), generator=generator)
        return Batch(tokens[:, :-1], tokens[:, 1:], torch.ones(batch_size, length, dtype=torch.bool))


def test_long_evaluation_holds_one_chunk_of_logits_at_any_length(monkeypatch):
    source, chunk = RandomText(), 2 * 97 * 16
    monkeypatch.setattr(gpt_module, "LOGIT_CHUNK", chunk)
    model = GPT(GPTConfig(vocab_size=source.vocab_size, dim=16, layers=1, heads=2))
    for length in (256, 1024):
        with WidestVocabTensor(source.vocab_size) as widest:
            evaluate(model, source, [length], tokens_per_length=2 * length, diagnostics=False)
        assert widest.most == chunk            # 16 positions of 2 rows at a time, at either length
    batch = source.sample(2, 1024, torch.Generator().manual_seed(0))
    with WidestVocabTensor(source.vocab_size) as widest, torch.no_grad():
        model(batch.tokens)                    # the whole forward: every logit at once
    assert widest.most == 2 * 1024 * 97


def test_lengthgen_eval_runs_forward_passes_no_larger_than_the_trainers(tmp_path, monkeypatch):
    """`eval_run` ran each length's whole batch (``--tokens`` of them) in one forward pass, so its memory grew with
    --tokens; the trainer and compare pass at most ``train.eval_batch_size`` x training length tokens."""
    from lengthgen.experiments.eval_run import eval_run
    from lengthgen.train import train
    from lengthgen.train.config import RunConfig

    cfg = RunConfig().override("model.dim=16", "model.layers=1", "model.heads=2", "train.steps=1", "train.batch_size=2",
                               "train.eval_batches=0", "train.eval_batch_size=4", "data.task=counting",
                               "data.length=8", "train.threads=1")
    train(cfg, tmp_path / "run", progress=False)
    rows: list[tuple[int, int]] = []
    features = GPT.features
    monkeypatch.setattr(GPT, "features", lambda self, tokens, *a, **k: (
        rows.append(tuple(tokens.shape)), features(self, tokens, *a, **k))[1])
    result = eval_run(tmp_path / "run", lengths=[8, 32], tokens=512)
    assert [r.batch_size for r in result.lengths] == [64, 16]
    assert max(n * length for n, length in rows) <= 4 * 8           # the diagnostics pass: one row
    assert sum(n for n, length in rows if length == 8) == 64 and sum(n for n, length in rows if length == 32) == 17
