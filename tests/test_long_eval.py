"""Long evaluation in bounded memory: `measure_gpt` takes an lm head's logits a chunk of positions at a time
(`GPT.logit_chunks`, `Batch.positions`), with the same loss and metrics as the whole forward, and no tensor of
the vocabulary's width beyond one chunk, whatever the length."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lengthgen import memory
from lengthgen.config import ConfigError
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


def test_an_evaluation_that_cannot_fit_in_memory_fails_before_it_runs(monkeypatch):
    """On the CPU, a length whose one forward pass needs more memory than the host has left was run anyway and Linux
    killed the process ("Killed", nothing else); now it is a MemoryError naming the length, the need and what is
    available, raised before any length is evaluated."""
    evaluate_module = importlib.import_module("lengthgen.eval.evaluate")   # the package's `evaluate` is the function
    source, model = RandomText(), GPT(GPTConfig(vocab_size=97, dim=16, layers=1, heads=2))
    monkeypatch.setattr(evaluate_module, "available_memory", lambda: (2**30, "host"))
    run = []
    monkeypatch.setattr(GPT, "features", lambda self, *a, **k: run.append(1))
    need = gpt_module.forward_memory(model.config, 2**22) + 8 * 2**22
    with pytest.raises(MemoryError, match=rf"^evaluating length 4194304 \(1 sequence\) needs at least "
                                          rf"{need / 2**30:.1f} GiB of memory, 1.0 GiB available$"):
        evaluate(model, source, [64, 2**22], tokens_per_length=64, diagnostics=False)
    assert run == []


def test_an_evaluation_short_of_memory_runs_fewer_rows_at_once_with_the_same_values(monkeypatch):
    """Where the whole batch does not fit the CPU's available memory but one row does, the rows run a few at a time
    (a batch's values are the same row by row)."""
    evaluate_module = importlib.import_module("lengthgen.eval.evaluate")
    source, model = RandomText(), GPT(GPTConfig(vocab_size=97, dim=16, layers=1, heads=2))
    whole = evaluate(model, source, [64], tokens_per_length=1024, diagnostics=False)
    row = gpt_module.forward_memory(model.config, 64)
    monkeypatch.setattr(evaluate_module, "available_memory", lambda: (2 * (3 * row + 8192), "host"))   # 3 rows in half
    rows: list[int] = []
    features = GPT.features
    monkeypatch.setattr(GPT, "features", lambda self, tokens, *a, **k: (
        rows.append(tokens.shape[0]), features(self, tokens, *a, **k))[1])
    split = evaluate(model, source, [64], tokens_per_length=1024, diagnostics=False)
    assert rows == [3] * 5 + [1]
    assert split.lengths[0].at_length == whole.lengths[0].at_length
    assert split.lengths[0].buckets == whole.lengths[0].buckets


GIB, MIB, NO_LIMIT = 2**30, 2**20, "9223372036854771712"      # cgroup v1's "no limit"


def fake_host(root, cgroup: str, files: dict[str, object]):
    """A /proc and /sys/fs/cgroup under ``root``: MemAvailable 8 GiB, ``/proc/self/cgroup`` ``cgroup`` and the
    cgroup ``files`` (paths under /sys/fs/cgroup)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       16777216 kB\nMemAvailable:    {8 * 2**20} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (root / "sys/fs/cgroup" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "sys/fs/cgroup" / name).write_text(f"{text}\n")
    return root


V1 = "4:memory:/docker/0123abcd\n2:cpu,cpuacct:/docker/0123abcd\n0::/\n"     # hybrid: memory on v1


@pytest.mark.parametrize("cgroup, files, available", [
    ("0::/job\n", {"job/memory.max": GIB, "job/memory.current": 256 * MIB, "job/memory.stat": "inactive_file 0"},
     (768 * MIB, "cgroup")),                                                   # v2: the limit is below MemAvailable
    ("0::/job\n", {"job/memory.max": "max", "job/memory.current": GIB}, (8 * GIB, "host")),
    ("0::/job\n", {"job/memory.max": 16 * GIB, "job/memory.current": GIB}, (8 * GIB, "host")),   # above the host's
    ("0::/slice/job\n", {"slice/memory.max": 2 * GIB, "slice/memory.current": 1536 * MIB,        # a parent's limit
                         "slice/job/memory.max": "max", "slice/job/memory.current": GIB}, (512 * MIB, "cgroup")),
    ("0::/job\n", {"job/memory.max": GIB, "job/memory.current": GIB,            # page cache is reclaimed first
                   "job/memory.stat": "file 536870912\ninactive_file 402653184"}, (384 * MIB, "cgroup")),
    (V1, {"memory/memory.limit_in_bytes": GIB, "memory/memory.usage_in_bytes": 768 * MIB,      # the container's own
          "memory/memory.stat": "inactive_file 0\ntotal_inactive_file 268435456"}, (512 * MIB, "cgroup")),  # at root
    (V1, {"memory/docker/0123abcd/memory.limit_in_bytes": GIB, "memory/docker/0123abcd/memory.usage_in_bytes": 0,
          "memory/memory.limit_in_bytes": NO_LIMIT, "memory/memory.usage_in_bytes": 4 * GIB}, (GIB, "cgroup")),
    (V1, {"memory/memory.limit_in_bytes": NO_LIMIT, "memory/memory.usage_in_bytes": GIB}, (8 * GIB, "host")),
    (V1, {}, (8 * GIB, "host")),                                                # no cgroup files: MemAvailable
    ("0::/../..\n", {"memory.max": GIB, "memory.current": 0}, (GIB, "cgroup")),  # outside the mount: its root
])
def test_the_available_memory_is_the_cgroup_limit_where_that_is_lower(tmp_path, cgroup, files, available):
    """In a container (docker, k8s, CI, slurm) the memory cgroup's limit, often far below the host's MemAvailable,
    is where the kernel kills the process with no message; the check read MemAvailable alone and let such an
    evaluation run. Now the smaller of the two: limit minus usage (less the inactive file cache) of the cgroup and
    each ancestor, cgroup v2 or v1, read at the mount's root where the container's path is not under it."""
    assert memory.available_memory(fake_host(tmp_path, cgroup, files)) == available


def test_the_available_memory_is_unknown_without_proc(tmp_path):
    assert memory.available_memory(tmp_path) is None


def test_an_evaluation_over_the_cgroup_limit_says_the_limit_bounds_it(tmp_path, monkeypatch):
    """Where the cgroup's limit is what leaves too little, the error says so: the user raises the container's limit
    (the host may have plenty free)."""
    evaluate_module = importlib.import_module("lengthgen.eval.evaluate")
    root = fake_host(tmp_path, "0::/job\n", {"job/memory.max": GIB, "job/memory.current": 0})
    monkeypatch.setattr(evaluate_module, "available_memory", lambda: memory.available_memory(root))
    model = GPT(GPTConfig(vocab_size=97, dim=16, layers=1, heads=2))
    with pytest.raises(MemoryError, match=r", 1.0 GiB available under the cgroup \(container\) memory limit$"):
        evaluate(model, RandomText(), [2**22], tokens_per_length=64, diagnostics=False)


_PEAK = """
import resource, sys, torch
from lengthgen.data.tasks import make_task
from lengthgen.eval import evaluate
from lengthgen.model import GPT, GPTConfig
from lengthgen.model.gpt import forward_memory
torch.set_num_threads(1)
source = make_task("counting")
model = GPT(GPTConfig(vocab_size=source.vocab_size, head="regress", dim=64, layers=2, heads=2,
                      attention={"window": 32}))
evaluate(model, source, [64], tokens_per_length=64, diagnostics=False)
with open("/proc/self/statm") as statm:                 # resident now, not the peak of the imports
    before = int(statm.read().split()[1]) * resource.getpagesize()
evaluate(model, source, [2**18], tokens_per_length=1, diagnostics=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, forward_memory(model.config, 2**18))
"""


def test_the_memory_estimate_is_a_lower_bound_of_the_measured_peak():
    """`forward_memory` (what the CPU check compares with the available memory) against the peak resident memory
    an evaluation of one sequence of 2^18 positions adds in a fresh process: below it (1.2x to 1.4x on a quiet
    host), loosely: a busy host may page out some of the process's library code while it runs."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    peak, estimate = map(int, out.stdout.split())
    assert 0.8 * estimate <= peak <= 2 * estimate, (peak, estimate)


def test_lengths_that_cannot_fit_in_memory_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """`lengthgen eval`, `train` and `compare` check each evaluation length against the CPU's available memory
    when they check its config, before the data samples a sequence of it or anything trains; compare checks every
    run's model (a variant may be wider than the config's)."""
    from lengthgen.cli import main
    from lengthgen.experiments.compare import base_config, run_compare

    evaluate_module = importlib.import_module("lengthgen.eval.evaluate")
    tiny = ["--set", "model.dim=16", "--set", "model.layers=1", "--set", "model.heads=2", "--set", "train.steps=1",
            "--set", "data.length=8", "--set", "model.attention.window=8", "--set", "train.device=cpu"]
    assert main(["train", *tiny, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(evaluate_module, "available_memory", lambda: (2**26, "host"))
    need = gpt_module.forward_memory(GPTConfig(vocab_size=2, dim=16, layers=1, heads=2), 2**17) + 8 * 2**17
    said = f"evaluating length 131072 (1 sequence) needs at least {need / 2**30:.1f} GiB of memory, 0.1 GiB available"
    assert main(["eval", str(tmp_path / "run"), "--lengths", f"8,{2**17}"]) == 2
    assert capsys.readouterr().err == f"lengthgen eval: error: lengths: {said}\n"
    assert main(["train", *tiny, "--set", f"train.eval_lengths=[{2**17}]", "--out", str(tmp_path / "r2")]) == 2
    assert capsys.readouterr().err == f"lengthgen train: error: train.eval_lengths: {said}\n"
    assert not (tmp_path / "r2").exists()
    wide = "compare.variants={baseline = {}, wide = {model.dim = 256}}"
    cfg = base_config(None, [a for a in tiny if a != "--set"] + ["compare.eval_lengths=[8, 8192]", "compare.seeds=[0]",
                                                               wide])
    with pytest.raises(ConfigError, match=r"^compare.eval_lengths \(run wide\): evaluating length 8192 .*0.1 GiB"):
        run_compare(cfg, tmp_path / "c", progress=False, log=lambda _: None)
    assert not (tmp_path / "c").exists()
