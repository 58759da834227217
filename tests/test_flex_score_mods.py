"""benchmarks/flex_score_mods.py: every way it writes a distance term is the library's term (through FlexAttention
itself, on CPU's eager path, and on CUDA's compiled one), and its command line refuses bad input in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import flex_score_mods as sweep  # noqa: E402
from lengthgen.attention import AttentionSpec, mods  # noqa: E402
from lengthgen.attention.backends import flex  # noqa: E402

FORM_CASES = [(mod, form) for mod, forms in sweep.FORMS.items() for form in forms]


@pytest.mark.parametrize("mod, form", FORM_CASES)
def test_each_form_is_the_library_term(mod, form):
    """Logits on every (query, key) of a 300-position grid, in float64: the ``table`` form to float32 rounding of
    its tables, the others to float64 rounding (log(1 + x) against log1p(x) included)."""
    length = 300
    library = sweep.score_mod(mod, "library", length, "cpu")
    other = sweep.score_mod(mod, form, length, "cpu")
    b, h, q_idx, kv_idx = mods.grids(1, 1, torch.arange(length), torch.arange(length))
    score = torch.randn(1, 1, length, length, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want, got = library(score, b, h, q_idx, kv_idx), other(score, b, h, q_idx, kv_idx)
    tolerance = 1e-6 if form == "table" else 1e-12
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert float((want - score).abs().max()) > 1      # the term changes the logits: the test could fail


@pytest.mark.parametrize("mod, form", FORM_CASES)
def test_each_form_runs_in_flex_attention(mod, form):
    """The same attention output as the library's term through FlexAttention's eager path (inference, CPU): a table
    indexed by the distance is a captured buffer, as the kernels take it."""
    length, gen = 200, torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, length, 16, generator=gen) for _ in range(3))
    mask = flex.build_block_mask(AttentionSpec(), length, length, None, "cpu")

    def run(f):
        with torch.no_grad():
            return flex._eager(q, k, v, score_mod=sweep.score_mod(mod, f, length + flex.BLOCK_SIZE, "cpu"),
                               block_mask=mask)
    torch.testing.assert_close(run(form), run("library"), rtol=1e-5, atol=1e-5)


def _dense_flex(q, k, v, score_mod=None, block_mask=None, kernel_options=None):
    """FlexAttention's call as dense causal attention, differentiable on CPU (the harness's stand-in there)."""
    length = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if score_mod is not None:
        scores = score_mod(scores, *mods.grids(q.shape[0], q.shape[1], torch.arange(length), torch.arange(length)))
    scores = scores + mods.additive(torch.ones(length, length).tril(), scores.dtype)
    return (torch.softmax(scores, -1).to(v.dtype) @ v)


def test_the_sweep_times_every_case_against_both_references(monkeypatch):
    """On CPU with a dense stand-in for FlexAttention: a row per case and per reference, each timed in the same
    rounds; a case whose kernel options fail is an error row, not a crash; cases past the budget are listed."""
    ns = sweep.parser().parse_args(["--out", "x", "--length", "64", "--head-dims", "16", "--tokens", "64",
                                    "--model-dim", "32", "--reps", "2", "--warmup", "1",
                                    "--kernel-options", "default,fwd64x64w4", "--tile-head-dims", "16"])

    def flex_or_fail(*a, kernel_options=None, **kw):
        if kernel_options == sweep.KERNEL_OPTIONS["fwd64x64w4"]:
            raise RuntimeError("no valid config")
        return _dense_flex(*a, **kw)
    rows = sweep.sweep(ns, torch.device("cpu"), flex_or_fail)
    by_key = {(r["mod"], r["form"], r["kernel_options"]): r for r in rows}
    assert len(rows) == 2 + 7 * 2 and len(by_key) == len(rows)
    for mod, form in FORM_CASES:
        ok, failed = by_key[mod, form, "default"], by_key[mod, form, "fwd64x64w4"]
        assert ok["status"] == "ok" and ok["max_diff"] < 8e-3 and ok["ratio_vs_sdpa_flash"] > 0, ok
        assert failed["status"] == "error: RuntimeError: no valid config"
    assert by_key[sweep.SDPA]["ratio_vs_sdpa_flash"] == 1 and by_key[sweep.BASELINE]["ratio_vs_flex_baseline"] == 1
    ns.budget = 1e-9
    rows = sweep.sweep(ns, torch.device("cpu"), flex_or_fail)
    assert {r["status"] for r in rows if r["form"] != "-"} == {"skipped: time budget"}
    text = sweep.markdown(dict(device="cpu", torch=torch.__version__, date="today", reps=2), rows)
    assert "| 16 | scale_invariant | table | default | - | - [-, -] | - | - | - | skipped: time budget |" in text


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        sweep.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--forms", "library,exp"], "--forms: exp is not valid; choose from library, fast, rsqrt, table"),
    (["--kernel-options", "huge"], "--kernel-options: huge is not valid; choose from default, fwd128x64w4"),
    (["--mods", "alibi"], "--mods: alibi is not valid; choose from scale_invariant, log_bias"),
    (["--head-dims", "64,x"], "--head-dims: '64,x' is not valid"),
    (["--budget", "0"], "--budget: '0' is not valid; give a finite number > 0"),
])
def test_bad_options_are_one_line_errors(argv, message, tmp_path, capsys):
    assert message in _refused(["--out", str(tmp_path / "r"), *argv], capsys)


def test_existing_results_are_kept_and_a_cpu_machine_is_told_why(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    out.with_suffix(".md").write_text("earlier sweep")
    assert "r.md exists; pass --overwrite" in _refused(["--out", str(out)], capsys)
    assert out.with_suffix(".md").read_text() == "earlier sweep"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _refused(["--out", str(out), "--overwrite"], capsys)
    assert "needs a CUDA device; none is visible" in line and out.with_suffix(".md").read_text() == "earlier sweep"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_small_sweep_on_cuda(tmp_path):
    """Every form of scale_invariant at one tile option besides the default, at L = 512: each compiles, matches the
    library's output to bf16 rounding and is timed against both references."""
    out = tmp_path / "sweep"
    assert sweep.main(["--out", str(out), "--length", "512", "--head-dims", "64", "--mods", "scale_invariant",
                       "--kernel-options", "default,fwd128x64w4", "--reps", "2", "--warmup", "1"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 2 + 4 * 2 and all(r["status"] == "ok" for r in rows), rows
    assert all(r["max_diff"] < 2e-2 for r in rows if r["form"] != "-")
    assert all(r["ratio_vs_sdpa_flash"] > 0 for r in rows)
    assert "| 64 | scale_invariant | table | fwd128x64w4 |" in out.with_suffix(".md").read_text()
