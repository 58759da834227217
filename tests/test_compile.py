"""``train.compile=true``: the trainer runs the model through ``torch.compile`` on every device (CPU too).

Inductor's CPU code generation takes minutes on 2 cores, so the tests compile with the ``aot_eager`` backend:
TorchDynamo traces the model and AOTAutograd builds the joint forward and backward graphs, which is where a model
that does not compile fails; the kernels themselves are eager. SDPA (and FlexAttention on CUDA) are traced into the
model's graph; the other backends are one graph break each (`lengthgen.attention.backends.TRACED`).
On CUDA (skipped without it) Inductor compiles the model and bf16 training matches eager training.
"""

from __future__ import annotations

import pytest
import torch

BASE = ["model.dim=32", "model.layers=2", "model.heads=2", "model.mlp_ratio=2.0", "train.steps=3",
        "train.lr=1e-2", "train.batch_size=4", "train.eval_batches=0", "train.threads=1", "train.device=cpu",
        "data.task=counting", "data.task_kwargs={vocab_size = 4}", "data.length=16", "train.grad_accum=2"]


def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    from lengthgen.train import Trainer
    from lengthgen.train.config import RunConfig

    compiled = []
    real = torch.compile

    def aot_eager(model, **kwargs):
        compiled.append(model)
        return real(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", aot_eager)
    cfg = RunConfig().override(*BASE, "model.attention=l2")
    eager = Trainer(cfg, tmp_path / "eager", progress=False).fit()
    assert not compiled
    torch._dynamo.reset()
    trainer = Trainer(cfg.override("train.compile=true"), tmp_path / "compiled", progress=False)
    assert compiled == [trainer.model, trainer.model.loss]        # the model and, apart, its loss
    assert isinstance(trainer.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    result = trainer.fit()
    assert len(result.history) == 3
    torch.testing.assert_close(torch.tensor(result.history), torch.tensor(eager.history), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention, traced", [("baseline", True), ("ssmax", True), ("l2", False),
                                               ({"preset": "baseline", "doc_masking": True}, True)])
def test_attention_in_the_model_graph(attention, traced):
    """SDPA attention (query scaling, documents) is traced into the compiled model's one graph: the attention call
    was a graph break in every layer (the query scaling and casts left eager between graphs). A backend that runs
    eager (p = 2 here) breaks the graph at its call. Values and gradients equal eager's."""
    from lengthgen.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, dim=32, layers=3, heads=2, attention=attention))
    tokens, docs = torch.randint(0, 16, (2, 24)), torch.tensor([[0] * 9 + [1] * 15, [0] * 24])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(tokens, docs)
    if traced:
        assert explained.graph_count == 1, explained.break_reasons
    else:           # every break is the eager backend's call
        assert explained.graph_count > 1 and all("torch.compiler.disable" in r.reason for r in explained.break_reasons)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    outputs = [m(tokens, docs) for m in (model, compiled)]
    grads = [torch.autograd.grad(out.square().mean(), list(model.parameters())) for out in outputs]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention, backend", [("l2", "flex"), ("l2", "triton"),
                                                ('{preset = "baseline", window = 8}', "auto")])
def test_cuda_compiled_bf16_training_matches_eager(tmp_path, attention, backend):
    """Inductor on CUDA, bf16 autocast: p = 2 through FlexAttention (traced into the model's graph) or the Triton
    kernel (a graph break), and a sliding window through `auto` (FlexAttention)."""
    from lengthgen.train import Trainer
    from lengthgen.train.config import RunConfig

    cfg = RunConfig().override(*BASE, f"model.attention={attention}", f"model.attention_backend={backend}",
                               "train.device=cuda", "train.dtype=bfloat16")
    precision = torch.get_float32_matmul_precision()
    eager = Trainer(cfg, tmp_path / "eager", progress=False).fit()
    compiled = Trainer(cfg.override("train.compile=true"), tmp_path / "compiled", progress=False).fit()
    torch.testing.assert_close(torch.tensor(compiled.history), torch.tensor(eager.history), rtol=2e-2, atol=2e-2)
    # training uses TF32 on CUDA and gives the caller's setting back (later float32 work in the process is exact)
    assert torch.get_float32_matmul_precision() == precision
