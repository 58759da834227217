"""`lengthgen.experiments.bench`: the attention benchmark runs on CPU at tiny sizes and writes the expected JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lengthgen.cli import bench as cli_bench
from lengthgen.experiments import bench

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_causal_flops_flashattention_convention():
    fwd, bwd = bench.causal_flops(2, 16, 1024, 64)
    assert fwd == 4 * 2 * 1024 ** 2 * 16 * 64 / 2
    assert bwd == 2.5 * fwd


def test_packed_doc_ids_are_runs():
    docs = bench.packed_doc_ids(3, 256, "cpu")
    assert docs.shape == (3, 256)
    assert (docs.diff(dim=-1) >= 0).all() and (docs[:, -1] >= 3).all()      # several documents per row


def test_bench_cpu_rows_and_json(tmp_path):
    out = tmp_path / "bench.json"
    rows = bench.bench_attention(lengths=(32,), head_dims=(16,), variants=("baseline", "l2", "doc_l2"),
                                 backends=("dense", "tiled", "sdpa", "flex"), batch=1, heads=2, dtype="float32",
                                 out_json=out, device="cpu", warmup=0, reps=1, verbose=False)
    data = json.loads(out.read_text())
    assert data["columns"] == list(bench.COLUMNS)
    assert data["meta"]["device"] == "cpu"
    assert len(data["rows"]) == len(rows) == 2 + 3 * 4
    for row in data["rows"]:
        assert set(row) == set(bench.COLUMNS)
        assert (row["length"], row["head_dim"], row["batch"], row["heads"], row["dtype"]) == (32, 16, 1, 2, "float32")
    by = {(r["backend"], r["variant"]): r for r in rows}
    ref, default = by[("sdpa_flash", "baseline")], by[("sdpa_default", "baseline")]
    assert ref["status"] == "ok" and ref["ratio_vs_sdpa_flash"] == 1.0 and ref["mode"] == "fwd+bwd"
    assert default["status"] == "ok" and default["ratio_vs_sdpa_default"] == 1.0
    for name in ("dense", "tiled"):
        for variant in ("baseline", "l2", "doc_l2"):
            row = by[(name, variant)]
            assert row["status"] == "ok" and row["mode"] == "fwd+bwd", row
            assert row["total_ms"] > 0 and row["fwd_ms"] > 0 and row["total_tflops"] > 0
            assert row["rounds"] == 1 and row["check_error"] < 1e-5       # checked against the dense oracle
            # one round: the per-round ratio is the ratio of the times
            assert row["ratio_vs_sdpa_flash"] == pytest.approx(row["total_ms"] / ref["total_ms"])
            assert row["ratio_q1"] == row["ratio_q3"] == row["ratio_vs_sdpa_flash"]
            assert row["peak_mem_mib"] is None                                  # CUDA only
    assert by[("sdpa", "baseline")]["status"] == "ok"
    assert by[("sdpa", "l2")]["status"].startswith("unsupported: softmax_p")
    for variant in ("baseline", "l2", "doc_l2"):                               # FlexAttention: CPU forward only
        row = by[("flex", variant)]
        assert row["status"] == "ok" and row["mode"] == "fwd" and row["bwd_ms"] is None, row
    table = bench.format_table(rows)
    assert "fwd*" in table and "forward only" in table and "x flash" in table


def test_bench_rejects_unknown_names():
    with pytest.raises(ValueError, match="variant"):
        bench.bench_attention(lengths=(16,), variants=("nope",), device="cpu", verbose=False)
    with pytest.raises(ValueError, match="backend"):
        bench.bench_attention(lengths=(16,), backends=("cudnn",), device="cpu", verbose=False)


def test_add_arguments_parses_lists():
    args = cli_bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--device", "cpu", "--lengths", "256,1k", "--head-dims", "64", "--variants", "l2,alibi",
         "--backends", "tiled", "--dtype", "float32"])
    assert args.lengths == (256, 1024) and args.head_dims == (64,)
    assert args.variants == ("l2", "alibi") and args.backends == ("tiled",)


def test_cli_script_on_cpu(tmp_path):
    out = tmp_path / "cli.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "benchmarks/attention_gpu.py", "--device", "cpu", "--lengths", "32",
                           "--head-dims", "16", "--variants", "baseline,alibi", "--backends", "dense,sdpa",
                           "--warmup", "0", "--reps", "1", "--heads", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x flash" in proc.stdout and str(out) in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["variant"]) for r in rows] == [
        ("sdpa_flash", "baseline"), ("sdpa_default", "baseline"), ("dense", "baseline"), ("sdpa", "baseline"),
        ("dense", "alibi"), ("sdpa", "alibi")]
    assert rows[5]["status"].startswith("unsupported")
    again = subprocess.run(proc.args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.strip().endswith(f"--out {out} exists; pass --overwrite to "
                                                                   "replace it, or give another --out")
    assert json.loads(out.read_text())["rows"] == rows                # untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_cuda_small(tmp_path):
    rows = bench.bench_attention(lengths=(1024,), head_dims=(64,), variants=("baseline", "l2"),
                                 backends=("triton", "flex", "sdpa"), dtype="bfloat16", out_json=tmp_path / "b.json",
                                 device="cuda", warmup=1, reps=2, verbose=False)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["backend"], r["variant"]) for r in ok} >= {("triton", "l2"), ("flex", "l2"), ("sdpa", "baseline")}
    assert all(r["mode"] == "fwd+bwd" and r["peak_mem_mib"] > 0 and r["ratio_vs_sdpa_flash"] > 0 for r in ok)


def test_out_of_memory_is_a_row(monkeypatch):
    """An allocation failure (here the CPU allocator's own words) is an ``oom`` row; other errors say what they were."""
    errors = {"l2": RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 512000000 bytes."),
              "alibi": RuntimeError("shape mismatch")}

    def attend(q, k, v, spec, **kwargs):
        raise errors[{2.0: "l2"}.get(spec.softmax_p, "alibi")]
    monkeypatch.setattr(bench, "attend", attend)
    rows = bench.bench_attention(lengths=(16,), head_dims=(16,), variants=("l2", "alibi"), backends=("dense",),
                                 batch=1, heads=2, dtype="float32", device="cpu", warmup=0, reps=1, verbose=False)
    assert [r["status"] for r in rows] == ["ok", "ok", "oom", "error: RuntimeError: shape mismatch"]


def test_time_budget_skips_the_cases_not_started():
    rows = bench.bench_attention(lengths=(16,), head_dims=(16,), variants=("baseline", "l2"), backends=("dense",),
                                 batch=1, heads=2, dtype="float32", device="cpu", warmup=0, reps=1,
                                 time_budget_s=0.0, verbose=False)
    assert [(r["backend"], r["status"]) for r in rows] == [("sdpa_flash", "ok"), ("sdpa_default", "ok"),
                                                           ("dense", "skipped: time budget"),
                                                           ("dense", "skipped: time budget")]


def test_measure_interleaved_alternates_the_calls():
    """Warm-up calls of each, then one call of each per round, so that a slow moment hits every case."""
    from lengthgen.experiments.timing import measure_interleaved

    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    ms = measure_interleaved(fns, torch.device("cpu"), warmup=1, reps=3)
    assert order == ["a", "b", "c"] + ["a", "b", "c"] * 3
    assert set(ms) == {"a", "b", "c"} and all(len(t.rounds) == 3 and t.median >= 0 for t in ms.values())


def test_timing_ratios_are_per_round():
    from lengthgen.experiments.timing import Timing

    case, ref = Timing((2.0, 9.0, 4.0, 6.0)), Timing((1.0, 3.0, 4.0, 3.0))
    assert (case / ref).rounds == (2.0, 3.0, 1.0, 2.0) and (case / ref).median == 2.0
    assert case.median / ref.median != (case / ref).median        # not the ratio of the medians
    assert (case / ref).quartiles() == (1.75, 2.25)
    assert (case - ref).rounds == (1.0, 6.0, 0.0, 3.0)
    assert Timing((5.0,)).quartiles() == (5.0, 5.0)


def test_a_case_that_differs_from_the_oracle_is_an_error_row(monkeypatch):
    """Each case is checked against the dense oracle before it is timed: a wrong kernel is not reported as fast."""
    real = bench.attend

    def attend(q, k, v, spec, **kwargs):
        out = real(q, k, v, spec, **kwargs)
        return out * 1.1 if kwargs.get("backend") == "tiled" else out
    monkeypatch.setattr(bench, "attend", attend)
    rows = bench.bench_attention(lengths=(16,), head_dims=(16,), variants=("l2",), backends=("dense", "tiled"),
                                 batch=1, heads=2, dtype="float32", device="cpu", warmup=0, reps=1, verbose=False)
    by = {r["backend"]: r for r in rows}
    assert by["dense"]["status"] == "ok" and by["dense"]["check_error"] == 0
    assert by["tiled"]["status"].startswith("error: differs from the dense oracle by 0.1")
    assert by["tiled"]["total_ms"] is None


def test_out_path_is_checked_before_measuring(tmp_path, monkeypatch, capsys):
    """An existing --out is refused (nothing measured, the file kept) unless --overwrite; the JSON is written
    after each group, so an interrupted run keeps what it measured."""
    from lengthgen.cli import main as cli_main

    out = tmp_path / "b.json"
    out.write_text("keep")
    monkeypatch.setattr(bench, "bench_attention", lambda *a, **k: pytest.fail("measured before checking --out"))
    assert cli_main(["bench", "attention", "--device", "cpu", "--out", str(out)]) == 2
    assert out.read_text() == "keep" and "pass --overwrite" in capsys.readouterr().err
    # --overwrite replaced any file, e.g. the user's notes, with the benchmark's JSON
    assert cli_main(["bench", "attention", "--device", "cpu", "--out", str(out), "--overwrite"]) == 2
    assert out.read_text() == "keep" and "exists and is not a benchmark's results" in capsys.readouterr().err
    bench.write_json([], out, torch.device("cpu"))                     # an earlier benchmark's: replaced
    monkeypatch.setattr(bench, "bench_attention", lambda *a, **k: [])
    assert cli_main(["bench", "attention", "--device", "cpu", "--out", str(out), "--overwrite"]) == 0
    monkeypatch.undo()
    writes = []
    monkeypatch.setattr(bench, "write_json", lambda rows, path, device: writes.append(len(rows)))
    bench.bench_attention(lengths=(16, 32), head_dims=(16,), variants=("baseline",), backends=("dense",), batch=1,
                          heads=2, dtype="float32", out_json=out, device="cpu", warmup=0, reps=1, verbose=False)
    assert writes == [3, 6]


def test_lengths_beyond_max_size_are_a_one_line_error():
    parser = cli_bench.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--lengths", "99999999999999999999"])


def test_oracle_check_warns_of_nothing():
    """`lengthgen bench attention` printed torch's 'Converting a tensor with requires_grad=True to a scalar'
    warning from the oracle check of a backend's training output, in the middle of its table."""
    import warnings

    from lengthgen.attention import AttentionSpec, attend

    q, k, v, grad = (torch.randn(1, 2, 32, 16) for _ in range(4))
    spec = AttentionSpec()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        error = bench._check(lambda *x: attend(*x, spec, backend="tiled"), spec, None, q, k, v, grad, True)
    assert error < 1e-4


def test_a_gradient_that_is_exactly_zero_is_no_error_row():
    """At L = 1 (and with documents of one token each) every query sees one key, so the oracle's dq is exactly 0;
    each tensor's error was divided by its own largest magnitude, so a kernel's rounding noise in dq (1e-8) made
    a correct case an 'error: differs from the dense oracle by 9e+22' row, with no time."""
    for length, variant in ((1, "baseline"), (4, "doc_l2")):
        rows = bench.bench_attention(lengths=(length,), head_dims=(8,), variants=(variant,),
                                     backends=("tiled", "cpu_flash", "sdpa"), batch=1, heads=1, dtype="float32",
                                     device="cpu", warmup=0, reps=1, verbose=False)
        for row in rows[2:]:
            assert row["status"] == "ok" or row["status"].startswith("unsupported"), row
            assert row["status"] != "ok" or row["check_error"] < 1e-5
    q, k, v, grad = (torch.randn(1, 2, 8, 8) for _ in range(4))          # a wrong kernel is still caught
    from lengthgen.attention import AttentionSpec, attend
    spec = AttentionSpec()
    wrong = lambda q_, k_, v_: attend(q_ * 1.01, k_, v_, spec, backend="tiled")   # noqa: E731
    assert bench._check(wrong, spec, None, q, k, v, grad, True) > 1e-3


def test_table_columns_line_up_for_every_backend_name():
    """The table's backend column was 10 wide, so 'sdpa_default' (12) pushed every later cell of its row two
    characters right of the header's."""
    rows = [dict(backend=name, variant="baseline", length=256, head_dim=64, mode="fwd+bwd", fwd_ms=1.0, bwd_ms=2.0,
                 status="ok") for name in (bench.REFERENCE, bench.DEFAULT_SDPA, "dense", "cpu_flash")]
    lines = bench.format_table(rows).splitlines()
    ends = {line.index(" L ") + 2 if line is lines[0] else line.index(" 256 ") + 4 for line in lines}   # L's end
    assert len(ends) == 1, "\n".join(lines)
