"""`lengthgen.experiments.model_bench`: the FLOPs-per-token formula, the peak table, and the measurements on CPU."""

from __future__ import annotations

import pytest
import torch

from lengthgen.experiments import model_bench as mb
from lengthgen.model import GPT, GPTConfig
from lengthgen.train.config import RunConfig


def test_flops_per_token_by_hand():
    """dim 8, 1 layer, 2 heads of 4, MLP 8 -> 16 -> 8, vocab 10: N = 4*64 (q, k, v, o) + 2*128 (MLP) + 3*8
    (RMSNorm weights) + 80 (head) = 616; the embedding table does not count, tied or not."""
    for tie in (False, True):
        model = GPT(GPTConfig(vocab_size=10, dim=8, layers=1, heads=2, mlp_ratio=2.0, norm="rms", tie_embeddings=tie))
        assert mb.matmul_parameters(model) == 616
        assert mb.flops_per_token(model, 4) == 6 * 616 + 6 * 1 * 2 * 4 * 4          # PaLM, causal attention term
        assert mb.flops_per_token(model, 8) - mb.flops_per_token(model, 4) == 6 * 2 * 4 * 4


def test_124m_preset_is_about_124m():
    from lengthgen.train.config import load_config

    cfg = load_config("benchmarks/gpt124m.toml", ["model.vocab_size=50304"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    assert 120e6 < mb.matmul_parameters(model) < 130e6                         # 12 x 768, untied head


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
                                       ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.4),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None)])
def test_peak_table(name, peak):
    assert mb.peak_bf16_tflops(name) == peak


def test_cpu_measurements_report_no_gpu_figures():
    cfg = RunConfig().override("model.vocab_size=32", "model.dim=16", "model.layers=1", "model.heads=2",
                               "model.attention={doc_masking = true}", "train.device=cpu")
    row = mb.train_throughput(cfg, batch_size=2, length=32, steps=1, warmup=1, device="cpu")
    assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    assert row["tflops"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
    assert row["mfu"] is None and row["peak_mem_gib"] is None
    assert row["optimizer_fraction"] == pytest.approx(row["optimizer_s"] / row["step_s"])    # one round
    shares = [k["share"] for k in row["top_kernels"]]
    assert 0 < len(shares) <= 10 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    # CPU: operators (which ones lead is timing: the first profile of a process gave layer norm half the time)
    assert any(k["name"].startswith("aten::") for k in row["top_kernels"]), row["top_kernels"]
    long = mb.long_eval(cfg, length=64, device="cpu")
    assert long["eval"]["seconds"] > 0 and long["eval"]["beyond_weights_gib"] is None
    layer = mb.layer_overhead(dim=16, heads=2, head_dim=8, batch=1, length=16, dtype=torch.float32, compile=False,
                              device="cpu", warmup=0, reps=1)
    assert layer["overhead"] == pytest.approx(layer["ms"]["out_norm+gate"] / layer["ms"]["baseline"] - 1)
    assert set(layer["overheads"]) == {"out_norm+gate", "out_norm", "gate", "head_gate", "seed000"}


def test_train_peak_memory_is_the_timed_steps_not_the_process(monkeypatch):
    """peak_mem_gib was torch.cuda.max_memory_allocated read at the end, never reset: the process's peak (an
    earlier case, the compiling first step) and what came after the rounds (the profiled step, Muon's comparison).
    The CUDA allocator's counter is faked here: 9 GiB before, 1 GiB in the timed rounds, 3 GiB after them."""
    allocator = {"peak": 9.0}
    rounds = mb.measure_interleaved

    def timed_rounds(*args, **kwargs):
        allocator["peak"] = max(allocator["peak"], 1.0)
        return rounds(*args, **kwargs)

    monkeypatch.setattr(mb, "_reset_peak", lambda device: allocator.update(peak=0.0), raising=False)
    monkeypatch.setattr(mb, "_peak_gib", lambda device: allocator["peak"])
    monkeypatch.setattr(mb, "measure_interleaved", timed_rounds)
    monkeypatch.setattr(mb, "top_kernels", lambda step, device: allocator.update(peak=3.0) or [])
    cfg = RunConfig().override("model.vocab_size=32", "model.dim=16", "model.layers=1", "model.heads=2",
                               "train.device=cpu")
    assert mb.train_throughput(cfg, batch_size=2, length=16, steps=1, warmup=1, device="cpu")["peak_mem_gib"] == 1.0


def test_synthetic_batch_packs_documents():
    batch = mb.synthetic_batch(50, 2, 64, True, torch.device("cpu"))
    assert batch.tokens.shape == batch.targets.shape == batch.doc_ids.shape == (2, 64)
    assert batch.loss_mask.all() and int(batch.tokens.max()) < 50 and (batch.doc_ids[:, -1] > 0).all()
    assert mb.synthetic_batch(50, 2, 64, False, torch.device("cpu")).doc_ids is None
