"""`make gpu-check` (benchmarks/gpu_check.py): the CPU dry run end to end, the pytest-output parser and the target
checks on made-up figures. The GPU run itself needs CUDA; its results are committed under benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
gpu_report = _load("gpu_report")


def test_dry_run_end_to_end(tmp_path):
    """One ``--tiny`` run (one test: under pytest-xdist a shared fixture would run once per worker); seed 001's
    kernel is stood in for by a file that only defines its entry point."""
    tmp = tmp_path
    kernel = tmp / "kernel.py"
    kernel.write_text("def triton_p_softmax_attention(q, k, v, p=1.0):\n    raise AssertionError('not on CPU')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out-dir", str(tmp / "out"),
                           "--seed-kernel", str(kernel), "--commit", "abc123"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted((tmp / "out").iterdir())
    assert [f.suffix for f in files] == [".json", ".md"] and files[0].stem == files[1].stem
    result, md = json.loads(files[0].read_text()), files[1].read_text()
    _check_parts(result, files[0].stem)
    _check_figures(result)
    _check_markdown(result, md, proc.stdout)


def _check_parts(result, stem):
    assert result["schema"] == "lengthgen-gpu-check/1" and result["mode"] == "tiny" and result["commit"] == "abc123"
    assert list(result["parts"]) == [name for name, _ in gpu_check.PARTS]
    statuses = {name: part["status"] for name, part in result["parts"].items()}
    assert statuses.pop("seed001").startswith("skipped: needs CUDA (kernel loaded from")
    assert set(statuses.values()) == {"ok"}, statuses
    assert stem.startswith(result["parts"]["env"]["result"]["device_name"].lower().replace("_", "-"))
    assert 0 < result["elapsed_s"] <= result["budget_s"]


def _check_figures(result):
    """CPU figures at tiny sizes, or absent: never a GPU figure."""
    parts = {name: part.get("result") for name, part in result["parts"].items()}
    assert parts["env"]["device"] == "cpu" and parts["env"]["capability"] is None
    assert parts["tests"]["counts"] == {"skipped": 1} and parts["tests"]["failed"] == []   # no CUDA: skipped
    rows = parts["attention"]["rows"]
    assert {r["backend"] for r in rows} == {"sdpa_flash", "sdpa_default", "tiled", "sdpa"}
    assert {r["variant"] for r in rows if r["backend"] == "tiled"} == set(gpu_check.gpu_report.QUERY_SCALING) | {
        "baseline", "l2", "scale_invariant", "alibi", "log_bias", "doc_l2"}
    assert all(r["device"] == "cpu" and r["peak_mem_mib"] is None for r in rows)
    for name in ("train", "train_compiled"):
        train = parts[name]
        assert train["compile"] is (name == "train_compiled") and train["tokens_per_s"] > 0
        assert train["mfu"] is None and train["peak_tflops"] is None and train["peak_mem_gib"] is None
        muon = train["muon_step_ms"]                      # lengthgen's Muon against torch's, same run
        assert muon["matrices"] > 0 and muon["lengthgen"] > 0 and muon["torch"] > 0 and muon["ratio"] > 0
    assert parts["eval_long"]["eval"]["beyond_weights_gib"] is None and parts["eval_long"]["eval"]["seconds"] > 0
    assert parts["layer"]["ms"]["baseline"] > 0 and parts["layer"]["compile"] is True
    assert parts["compare"]["device"] == "cpu" and parts["compare"]["rc"] == 0
    assert set(parts["compare"]["runs"]) == {"l2"} and parts["compare"]["eval_lengths"] == [64, 128]
    assert result["targets"] == []                                            # never evaluated off CUDA


def _check_markdown(result, md, stdout):
    assert md.startswith(f"# lengthgen GPU check: {result['parts']['env']['result']['device_name']}")
    assert "CPU dry run" in md and "## Targets" not in md and "commit abc123" in md
    for name in result["parts"]:
        assert f"| {name} | {result['parts'][name]['status']} |" in md
    for heading in ("## CUDA tests", "## Attention backends", "## Attention layer", "## 124M GPT training",
                    "-token evaluation", "## lengthgen compare", "seed 001", "torch.optim.Muon"):
        assert heading in md
    assert md in stdout


def test_refuses_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_check.main([])


@pytest.mark.parametrize("argv, message", [
    (["--parts", "env,nope"], r"--parts: unknown part\(s\) \['nope'\]; choose from env, tests, compare"),
    (["--parts", ","], r"--parts: unknown part\(s\) \[','\]; choose from env"),
    (["--budget", "nan"], r"--budget: 'nan' is not valid; give a number of seconds >= 10"),
    (["--budget", "0"], r"--budget: '0' is not valid"),
    (["--budget", "-5"], r"--budget: '-5' is not valid"),
    (["--budget", "inf"], r"--budget: 'inf' is not valid"),
    (["--pytest-workers", "-1"], r"--pytest-workers: '-1' is not valid; give an integer >= 0"),
    (["--out-dir", "FILE"], r"--out-dir: .*FILE is not a folder this can write to \(File exists\)"),
    (["--out-dir", "out", "--log-dir", "FILE/logs"], r"--log-dir: .*FILE/logs is not a folder this can write to"),
])
def test_bad_options_exit_2_before_any_part_runs(argv, message, tmp_path, monkeypatch, capsys):
    """Each bad option is a one-line error, exit status 2, before any part runs (a budget of 0 or less
    used to run with the default, or skip even ``env``; a file as ``--out-dir`` failed after the parts)."""
    (tmp_path / "FILE").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu_check, "check", lambda args: pytest.fail("a part ran"))
    with pytest.raises(SystemExit) as exit:
        gpu_check.main(["--tiny", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and ": error: argument " in err[0] and re.search(message, err[0]), err


def test_env_runs_on_the_smallest_budget(monkeypatch, tmp_path):
    """``env`` always runs: with the smallest budget the time left for it is a hair under `MIN_PART_S`."""
    ran = []
    monkeypatch.setattr(gpu_check, "run_part", lambda name, *a: ran.append(name) or dict(status="ok", seconds=0.0))
    monkeypatch.setattr(gpu_check, "_write", lambda result, stem: None)
    monkeypatch.setattr(gpu_check.gpu_report, "markdown", lambda result: "")
    gpu_check.main(["--tiny", "--parts", "env", "--budget", str(gpu_check.MIN_PART_S), "--out-dir", str(tmp_path)])
    assert ran == ["env"]


def test_parse_pytest_outputs():
    plain = ("tests/test_a.py::test_x[fp32-softmax] PASSED                [ 33%]\n"
             "tests/test_a.py::test_y FAILED                [ 66%]\n"
             "tests/test_b.py::test_z SKIPPED (needs CUDA)  [100%]\n")
    assert gpu_check.parse_pytest(plain) == ({"passed": 1, "failed": 1, "skipped": 1}, ["tests/test_a.py::test_y"])
    xdist = ("[gw0] [ 50%] PASSED tests/test_a.py::test_x[bf16] \n[gw1] [100%] ERROR tests/test_b.py::test_w \n"
             "==== 1 passed, 1 error, 3 deselected in 2.00s ====")
    assert gpu_check.parse_pytest(xdist) == ({"passed": 1, "error": 1}, ["tests/test_b.py::test_w"])
    # stopped by the timeout: no summary line, the lines so far count
    assert gpu_check.parse_pytest(xdist.rsplit("\n", 1)[0])[0] == {"passed": 1, "error": 1}
    assert gpu_check.parse_pytest("") == ({}, [])


def _row(backend, variant, length, ratio, head_dim=128, total_ms=1.0, peak=100.0, batch=None):
    return dict(backend=backend, variant=variant, length=length, head_dim=head_dim, mode="fwd+bwd", status="ok",
                ratio_vs_sdpa_flash=ratio, total_ms=total_ms, peak_mem_mib=peak, batch=batch or 16384 // length)


def test_targets_take_the_worst_shape():
    rows = [_row("triton", "l2", 4096, 1.1), _row("triton", "l2", 16384, 1.2), _row("triton", "l2", 1024, 1.25),
            _row("flex", "alibi", 4096, 1.3), _row("flex", "baseline", 4096, 1.0, total_ms=2.0),
            _row("flex", "sqrt_log_n", 4096, 1.0, total_ms=2.1), _row("flex", "ssmax", 4096, 1.0, total_ms=2.02),
            _row("sdpa", "baseline", 1024, 1.0, peak=100.0), _row("sdpa", "baseline", 4096, 1.0, peak=130.0),
            _row("flex", "l2", 1024, 1.5, peak=100.0), _row("flex", "l2", 4096, 1.6, peak=400.0),
            dict(_row("flex", "scale_invariant", 4096, 9.0), status="oom")]
    result = {"parts": {
        "attention": {"status": "ok", "result": {"rows": rows}},
        "layer": {"status": "ok", "result": {"overhead": 0.05, "length": 2048, "head_dim": 128,
                                             "overheads": {"out_norm+gate": 0.05, "seed000": 0.02}}},
        "train_compiled": {"status": "ok", "result": {"mfu": 0.42, "tokens_per_s": 1e6}},
        "eval_long": {"status": "failed (rc 1): OOM"}}}
    got = {t["target"]: t for t in gpu_report.targets(result)}
    ge4k = got["triton l2 (p=2) / SDPA flash, L >= 4K"]
    assert (ge4k["measured"], ge4k["met"], ge4k["detail"]) == (1.2, False, "triton l2 L=16384 D=128")
    assert got["triton l2 (p=2) / SDPA flash, L = 1K"]["met"] is True
    assert got["flex alibi / SDPA flash"]["met"] is True
    assert got["flex scale_invariant / SDPA flash"]["measured"] is None        # only an OOM row: not measured
    assert got["sqrt_log_n / baseline, same backend"]["measured"] == pytest.approx(1.05)
    assert got["sqrt_log_n / baseline, same backend"]["met"] is False
    assert got["ssmax / baseline, same backend"]["met"] is True
    elementwise, seed000 = (f"out-norm + {gate}: extra fraction of an attention layer's fwd+bwd"
                            for gate in ("elementwise gate", "seed 000's per-head gate on 12 channels"))
    assert got[elementwise]["met"] is False and got[seed000]["met"] is True
    assert got["124M GPT training MFU, compiled"]["met"] is True
    memory = got["peak memory per token, longest L / shortest L (linear in L: constant)"]
    assert memory["measured"] == pytest.approx(4.0) and memory["met"] is False and "flex l2" in memory["detail"]
    assert [t["measured"] for t in got.values() if "evaluation" in t["target"]] == [None]
    # the layer doing more work measured faster is noise: not "met"
    result["parts"]["layer"]["result"] = {"overhead": -0.13, "length": 2048, "head_dim": 128}   # before seed000
    layer = {t["target"]: t for t in gpu_report.targets(result)}
    assert layer[elementwise]["met"] is None and "invalid" in layer[elementwise]["detail"] and seed000 not in layer


def test_compiled_training_alone_is_in_the_summary():
    """The training section shows the compiled run's figures also when the eager ``train`` part did not run
    (``--parts train_compiled``, or its budget spent): it was rendered only from ``train``'s."""
    train = dict(compile=True, params=124, batch=16, length=2048, first_step_s=30.0, step_s=0.14, optimizer_s=0.02,
                 tokens_per_s=234000.0, tflops=200.0, mfu=0.2, peak_mem_gib=24.0,
                 muon_step_ms=dict(matrices=72, lengthgen=5.0, torch=25.0, ratio=0.2))
    result = dict(mode="cuda", started="2026-11-24T10:00:00+00:00", elapsed_s=100.0, budget_s=540.0, targets=[],
                  parts={"env": {"status": "ok", "result": {"device_name": "NVIDIA H100"}},
                         "train_compiled": {"status": "ok", "result": train},
                         "train": {"status": "skipped: no time left (3 s of the budget)"}})
    md = gpu_report.markdown(result)
    assert "## 124M GPT training" in md and "| True | 124 | 16 x 2048 | 30 | 0.14 | 0.02 | 2.34e+05 |" in md
    assert "Muon step over the 72 hidden matrices (compiled run)" in md


def test_groups_pick_the_attention_shapes(monkeypatch, tmp_path):
    """``--groups`` runs the attention part on the given (length, head_dim) groups in order: a later GPU call can
    measure the groups an earlier one had no time for."""
    args = gpu_check.argparse.Namespace(tiny=False, log_dir=None, groups=gpu_check._groups("16384:128,1024:64"))
    ran = []

    def run(cmd, timeout, args, log):
        ran.append((cmd[cmd.index("--lengths") + 1], cmd[cmd.index("--head-dims") + 1]))
        return dict(rc=1, output="boom", seconds=0.0, timed_out=False)
    monkeypatch.setattr(gpu_check, "_run", run)
    entry = gpu_check.run_attention(args, float("inf"), tmp_path)
    assert ran == [("16384", "128"), ("1024", "64")]
    assert [(g["length"], g["head_dim"]) for g in entry["result"]["groups"]] == [(16384, 128), (1024, 64)]
    for bad in ("16384", "16384:0", "a:b", ""):
        with pytest.raises(gpu_check.argparse.ArgumentTypeError, match="length:head_dim pairs"):
            gpu_check._groups(bad)


def test_runs_in_the_same_second_keep_their_own_files(tmp_path):
    """Names are to the second and created exclusively: a second run started in the same second (or minute) gets
    ``-2``, a third ``-3``; none replaces another's files."""
    args = gpu_check.argparse.Namespace(tiny=True, out_dir=str(tmp_path))
    result = dict(started="2026-11-22T16:42:05+01:00", parts={"env": {"result": {"device_name": "x86_64"}}})
    stems = [gpu_check._stem(args, result) for _ in range(3)]
    assert [s.name for s in stems] == ["x86-64-2026-11-22-164205", "x86-64-2026-11-22-164205-2",
                                       "x86-64-2026-11-22-164205-3"]
    assert gpu_check._stem(args, dict(result, started="2026-11-22T16:42:06+01:00")).name.endswith("-164206")


def test_one_compare_step_is_singular():
    """The compare section wrote '1 steps at length 64' (the dry run's one step), where every other count phrase
    is `lengthgen.config.counted`'s."""
    compare = dict(device="cpu", compile=False, dtype="float32", steps=1, train_length=64, eval_lengths=[64],
                   runs={"l2": dict(final_train_loss=1.5, train_seconds=0.1, loss_at={"64": 1.5})})
    assert "float32, 1 step at length 64." in "\n".join(gpu_report._compare_md(compare, {}))
    assert "100 steps at length 64." in "\n".join(gpu_report._compare_md(dict(compare, steps=100), {}))
