"""FSDP2 (``train.parallel=fsdp``, gloo on CPU): 2 sharded ranks give the losses of 1 process, and checkpoints
hold full weights that load anywhere and resume exactly.

The test launches this file with ``torchrun --standalone --nproc_per_node=2``; run as a script, it trains
run A (AdamW, 2 micro-batches per rank: the path that skips gradient sync) for 3 steps, then resumes it to 5
from its checkpoint (run P, seed 001's PaLMAdamW, likewise), and runs M (Muon on the hidden weights) and N
(NorMuon, cautious weight decay) straight through. AdamW on shards is exact to float32 rounding; Muon's
Newton-Schulz iteration runs in bfloat16 (torch.optim.Muon), and a sharded matrix product sums in another order,
which moves its update by about bfloat16's precision (measured: 3% of the update's norm, as far as either is from
the float64 iteration), so runs M and N are compared more loosely.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import DISTRIBUTED_RUN as BASE
from helpers import logged_losses, torchrun_two

RUN_A = BASE + ["train.grad_accum=2"]
RUN_M = BASE + ["train.optimizer=muon", "train.muon_lr=0.05", "model.tie_embeddings=false"]
#: seed 000's optimizers: NorMuon (its statistics over sharded matrices) and cautious weight decay
RUN_N = BASE + ["train.optimizer=normuon", "train.muon_lr=0.05", "model.tie_embeddings=false",
                "train.cautious_weight_decay=true", "train.weight_decay=0.1", "train.muon_weight_decay=1.0"]
#: a language model: its evaluation calls the model's features and logits, not forward (FSDP2 hooks forward only)
RUN_T = BASE + ["data.kind=text", "data.task_kwargs={}", 'data.text={corpus = "stdlib", tokenizer = "byte"}']
#: 0-d parameters, which FSDP2 cannot shard (kept whole on every rank, their gradients averaged): seed 000's U-net
#: skip weight and a global query-scaling multiplier shared by every layer
RUN_S = BASE + ["model.skips=[[0, 1]]", "model.attention.query_scaling=log_n",
                "model.attention.learnable_scaling=global"]
#: seed 001's optimizer (PaLMAdamW) on shards, stopped and resumed from its gathered state as run A
RUN_P = BASE + ["train.optimizer=adamw_palm", "train.weight_decay=0.1", "train.weight_decay_on=all"]
#: seed 000's AdamW every other step on summed (sharded) gradients, stopped at step 1 (before AdamW's first step: no
#: state yet, which torch's set_optimizer_state_dict would create by a step on zero gradients) and at step 3, each
#: with one pending (gathered into the checkpoint, sharded back on resume), with a 0-d parameter FSDP2 leaves whole
RUN_E = BASE + ["train.grad_accum=2", "train.adam_every=2", "model.skips=[[0, 1]]"]


def test_two_sharded_processes_match_one(tmp_path):
    from lengthgen.eval import RunEval
    from lengthgen.train import train
    from lengthgen.train.config import RunConfig
    from lengthgen.train.weights import load_run

    proc = torchrun_two(__file__, tmp_path)
    assert "returned a view tensor" not in proc.stderr          # FSDP2's warning, once per rank, before
    for name, overrides, tol in (("a", RUN_A, 1e-5), ("m", RUN_M, 3e-3), ("n", RUN_N, 3e-3), ("t", RUN_T, 1e-5),
                                 ("s", RUN_S, 1e-5), ("p", RUN_P, 1e-5), ("e", RUN_E, 1e-5)):
        single = train(RunConfig().override(*overrides), tmp_path / f"single-{name}", progress=False)
        sharded = logged_losses(tmp_path / f"fsdp-{name}")
        assert len(sharded) == 5
        for step, (x, y) in enumerate(zip(sharded, single.history)):
            assert abs(x - y) <= tol * max(1.0, abs(y)), (name, step, sharded, single.history)
        # rank 0 wrote full weights: a plain model loads them; AdamW's are the single process's weights (Muon's
        # bfloat16 differences grow through 5 steps of a tiny model: its losses are the check)
        cfg, model = load_run(tmp_path / f"fsdp-{name}")
        assert cfg.train.parallel == "fsdp"
        if name in ("a", "s", "p", "e"):
            for (key, got), want in zip(model.state_dict().items(), single.model.state_dict().values()):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=key)
        evaluation = RunEval.load(tmp_path / f"fsdp-{name}" / "eval.json")
        assert [r.length for r in evaluation.lengths] == [16, 32]
        if name not in ("m", "n"):
            for got, want in zip(evaluation.lengths, single.evaluation.lengths):
                assert got.at_length["loss"] == pytest.approx(want.at_length["loss"], rel=1e-4), name
    records = [json.loads(line) for line in (tmp_path / "fsdp-a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]       # steps 4-5 after the resume
    for name in ("p", "e"):
        records = [json.loads(line) for line in (tmp_path / f"fsdp-{name}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("key", ["train.bema.enabled=true", "train.qk_clip=1.0"])
def test_fsdp_refuses_whole_weight_features(key):
    from lengthgen.config import ConfigError
    from lengthgen.train.config import RunConfig
    from lengthgen.train.setup import check_world

    check_world(RunConfig().override(*BASE, key), 2)                              # fine under DDP
    with pytest.raises(ConfigError, match=f"{key.split('=')[0]} does not work with train.parallel='fsdp'"):
        check_world(RunConfig().override(*BASE, key, "train.parallel=fsdp"), 2)


def test_parallel_choices_are_checked():
    from lengthgen.config import ConfigError
    from lengthgen.train.config import RunConfig

    with pytest.raises(ConfigError, match="train.parallel='zero3' is not valid.*ddp.*fsdp"):
        RunConfig().override("train.parallel=zero3")


def test_fsdp_in_one_process_says_it_shards_nothing():
    from lengthgen.train.config import RunConfig
    from lengthgen.train.setup import split_batch_notes

    cfg = RunConfig().override(*BASE, "train.parallel=fsdp")
    assert split_batch_notes(cfg, 1) == ["train.parallel='fsdp' has no effect in one process (WORLD_SIZE=1): nothing "
                                         "is sharded; launch with torchrun --nproc_per_node=N to shard across N ranks"]
    assert split_batch_notes(cfg, 2) == [] and split_batch_notes(RunConfig().override(*BASE), 1) == []


def test_a_sharded_regression_head_returns_no_view_and_the_same_gradients():
    """FSDP2 warned once per rank that the model 'returned a view tensor' (a regression head's squeeze(-1)); in one
    gloo process: the sharded model's forward warns of nothing and its gradients are the plain model's."""
    import warnings

    import torch.distributed as dist

    from lengthgen.model import GPT, GPTConfig
    from lengthgen.train import distributed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = GPT(GPTConfig(vocab_size=4, dim=16, layers=2, heads=2, head="regress"))
        sharded = copy.deepcopy(plain)
        distributed.parallelize(sharded, "fsdp", torch.device("cpu"))
        tokens = torch.randint(0, 4, (2, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = sharded(tokens)
        out.square().sum().backward()
        plain(tokens).square().sum().backward()
        for (key, got), want in zip(sharded.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(got.grad.full_tensor(), want.grad), key
    finally:
        dist.destroy_process_group()


def _worker(out: Path) -> None:
    from lengthgen.train import Trainer, train
    from lengthgen.train.config import RunConfig
    from lengthgen.train.distributed import cleanup

    cfg = RunConfig().override(*RUN_A, "train.parallel=fsdp")
    Trainer(cfg, out / "fsdp-a", progress=False).fit(stop_at=3)
    Trainer(cfg, out / "fsdp-a", progress=False, resume=True).fit()
    train(RunConfig().override(*RUN_M, "train.parallel=fsdp"), out / "fsdp-m", progress=False)
    train(RunConfig().override(*RUN_N, "train.parallel=fsdp"), out / "fsdp-n", progress=False)
    train(RunConfig().override(*RUN_T, "train.parallel=fsdp"), out / "fsdp-t", progress=False)
    train(RunConfig().override(*RUN_S, "train.parallel=fsdp"), out / "fsdp-s", progress=False)
    cfg = RunConfig().override(*RUN_P, "train.parallel=fsdp")
    Trainer(cfg, out / "fsdp-p", progress=False).fit(stop_at=3)
    Trainer(cfg, out / "fsdp-p", progress=False, resume=True).fit()
    cfg = RunConfig().override(*RUN_E, "train.parallel=fsdp")
    Trainer(cfg, out / "fsdp-e", progress=False).fit(stop_at=1)
    Trainer(cfg, out / "fsdp-e", progress=False, resume=True).fit(stop_at=3)
    Trainer(cfg, out / "fsdp-e", progress=False, resume=True).fit()
    cleanup()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
