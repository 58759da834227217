"""The benchmark scripts' command lines (benchmarks/attention_cpu.py, attention_crossover.py, train_step_cpu.py,
triton_configs.py, triton_code.py): bad input is a one-line error, exit status 2, before anything is measured;
results are written atomically and replace an existing file only with ``--overwrite``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention_cpu  # noqa: E402
import attention_crossover  # noqa: E402
import train_step_cpu  # noqa: E402
import triton_code  # noqa: E402
import triton_configs  # noqa: E402


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch):
    """Nothing here may measure: each script's measuring step fails the test."""
    def measured(*args, **kwargs):
        pytest.fail("measured")
    monkeypatch.setattr(attention_cpu, "run", measured)
    monkeypatch.setattr(attention_crossover, "time_backends", measured)
    monkeypatch.setattr(train_step_cpu.subprocess, "run", measured)


def _refused(main, argv, capsys) -> str:
    """The one line ``main(argv)`` printed on its way out with exit status 2."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("main, argv, message", [
    (train_step_cpu.main, ["--lengths", "abc"], "--lengths: 'abc' is not valid; give positive integers"),
    (train_step_cpu.main, ["--threads", "x"], "--threads: 'x' is not valid; give positive integers"),
    (train_step_cpu.main, ["--threads", "1,0"], "--threads: '1,0' is not valid"),
    (train_step_cpu.main, ["--repeats", "0"], "--repeats: '0' is not valid; give a positive integer"),
    (attention_cpu.main, ["--backends", "tiled,foo"], "--backends: foo is not valid; choose from auto, dense, sdpa"),
    (attention_cpu.main, ["--threads", "0"], "--threads: '0' is not valid"),
    (attention_cpu.main, ["--lengths", "1k"], "--lengths: '1k' is not valid"),
    (attention_cpu.main, ["--variants", ","], "--variants: ',' is not valid; choose from baseline, window"),
    (attention_cpu.main, ["--memory-variants", "l3"], "--memory-variants: l3 is not valid; choose from baseline"),
    (attention_cpu.main, ["--repeats", "0"], "--repeats: '0' is not valid"),
    (attention_crossover.main, ["--shapes", "foo"], "--shapes: foo is not valid; choose from single, demo"),
    (attention_crossover.main, ["--lengths", "16,x"], "--lengths: '16,x' is not valid"),
    (attention_crossover.main, ["--threads", "0"], "--threads: '0' is not valid"),
    (attention_crossover.main, ["--specs", "alibi,rope"], "--specs: rope is not valid; choose from window, doc"),
    (attention_crossover.main, ["--backends", "flex"], "--backends: flex is not valid; choose from dense, sdpa"),
    (triton_configs.main, ["--out", "x.json", "--length", "0"], "--length: '0' is not valid; give a positive integer"),
    (triton_configs.main, ["--out", "x.json", "--head-dims", "64", "-1"], "--head-dims: '-1' is not valid"),
    (triton_configs.main, ["--out", "x.json", "--ps", "2", "0"], "--ps: '0' is not valid; give a finite number > 0"),
    (triton_configs.main, ["--out", "x.json", "--ps", "nan"], "--ps: 'nan' is not valid"),
    (attention_cpu.main, ["--timeout", "-5"], "--timeout: '-5' is not valid; give a finite number > 0"),
    (attention_cpu.main, ["--timeout", "inf"], "--timeout: 'inf' is not valid"),
    (triton_code.main, ["--head-dims", "64,96"], "--head-dims: 96 is not valid; give powers of two from 16 to 128"),
    (triton_code.main, ["--distances", "none,rope"], "--distances: rope is not valid; choose from none"),
])
def test_bad_lists_are_one_line_errors(main, argv, message, capsys):
    assert message in _refused(main, argv, capsys)


def test_lists_parse():
    assert attention_cpu.bench_args.ints(" 64, 256,") == (64, 256)
    assert attention_cpu.bench_args.names(attention_cpu.VARIANTS, empty=True)("") == ()


#: script -> (main, options that measure next to nothing with `fake_measuring`)
PAIRS = {"attention_cpu": (attention_cpu.main, []),
         "attention_crossover": (attention_crossover.main, ["--shapes", "single", "--lengths", "16"]),
         "train_step_cpu": (train_step_cpu.main, ["--lengths", "64", "--threads", "1", "--presets", "baseline"])}


@pytest.fixture
def fake_measuring(monkeypatch):
    """Each script measures made-up figures at once; the paths written through `atomic_write_text` are listed."""
    import lengthgen.atomic

    row = dict(L=64, batch=32, threads=1, preset="baseline", clock="cpu", step_ms=1.0, ratio=1.0, spread=[1.0, 1.0],
               backend="dense")
    monkeypatch.setattr(attention_cpu, "run", lambda args: dict(setup={}, time=[], skipped=[], memory=[]))
    monkeypatch.setattr(attention_crossover, "time_backends", lambda *a: {"dense": 1.0})
    monkeypatch.setattr(train_step_cpu.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout=json.dumps([row]) + "\n", stderr=""))
    written = []

    def atomic_write_text(path, text, write=lengthgen.atomic.atomic_write_text):
        written.append(Path(path).name)
        return write(path, text)
    monkeypatch.setattr(lengthgen.atomic, "atomic_write_text", atomic_write_text)
    monkeypatch.setattr(attention_crossover, "atomic_write_text", atomic_write_text)
    return written


@pytest.mark.parametrize("script", PAIRS)
def test_existing_results_are_kept_unless_overwrite(script, tmp_path, capsys, fake_measuring):
    """An existing OUT.md (or OUT.json) is refused before anything is measured; ``--overwrite`` replaces both,
    atomically."""
    main, argv = PAIRS[script]
    out = tmp_path / "sub" / "r"
    out.parent.mkdir()
    out.with_suffix(".md").write_text("earlier results")
    line = _refused(main, [*argv, "--out", str(out)], capsys)
    assert f"--out: {out}.md exists; pass --overwrite to replace it, or choose another --out" in line
    assert out.with_suffix(".md").read_text() == "earlier results" and not out.with_suffix(".json").exists()
    assert fake_measuring == []
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0
    assert fake_measuring == ["r.json", "r.md"] and "earlier results" not in out.with_suffix(".md").read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json", "r.md"]        # no temporary file left


@pytest.mark.parametrize("script", PAIRS)
def test_unwritable_out_is_refused_before_measuring(script, tmp_path, capsys):
    main, argv = PAIRS[script]
    (tmp_path / "r.json").mkdir()
    line = _refused(main, [*argv, "--out", str(tmp_path / "r"), "--overwrite"], capsys)
    assert f"--out: {tmp_path / 'r.json'} is a folder; choose another --out" in line
    (tmp_path / "file").write_text("")
    line = _refused(main, [*argv, "--out", str(tmp_path / "file" / "r")], capsys)
    assert f"{tmp_path / 'file'} is a file, not a folder" in line


@pytest.mark.parametrize("script", PAIRS)
def test_a_runs_files_are_refused_before_measuring(script, tmp_path, capsys):
    """As `lengthgen bench` refuses them: ``--out RUN/config --overwrite`` replaced the run's config.json with the
    benchmark's results, and ``--out RUN/checkpoints/r`` wrote into its checkpoints."""
    from lengthgen.train.run_folder import LOCK

    main, argv = PAIRS[script]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / LOCK).write_text("")
    (run / "config.json").write_text("{}")
    line = _refused(main, [*argv, "--out", str(run / "config"), "--overwrite"], capsys)
    assert f"--out {run / 'config.json'} would replace a file of the run" in line
    line = _refused(main, [*argv, "--out", str(run / "checkpoints" / "new" / "r")], capsys)
    assert f"is inside the folder {run} that lengthgen wrote" in line
    assert (run / "config.json").read_text() == "{}" and not any((run / "checkpoints").iterdir())


def test_crossover_times_the_chosen_specs_and_backends(tmp_path, monkeypatch):
    """``--specs`` and ``--backends`` reach the timing (at long lengths dense's L x L logits must be left out); a
    spec none of the chosen backends runs is a row without a fastest backend, not a crash."""
    calls = []

    def time_backends(spec, batch, length, head_dim, names):
        calls.append((spec.distance, spec.softmax_p, names))
        return {} if spec.softmax_p != 1 else {name: float(len(calls) + i) for i, name in enumerate(names)}
    monkeypatch.setattr(attention_crossover, "time_backends", time_backends)
    out = tmp_path / "r"
    argv = ["--shapes", "single", "--lengths", "16", "--specs", "log_bias,l2", "--backends", "tiled,cpu_flash"]
    assert attention_crossover.main([*argv, "--out", str(out)]) == 0
    assert calls == [("log_bias", 1.0, ("tiled", "cpu_flash")), ("none", 2.0, ("tiled", "cpu_flash"))]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["spec"], r["fastest"]) for r in rows] == [("log_bias", "tiled"), ("l2", None)]
    assert "| single | 16 | 1 | l2 | - | - | - | - | - | dense |" in out.with_suffix(".md").read_text()


def test_triton_configs_keeps_an_existing_sweep(tmp_path, capsys):
    """Checked before the sweep (which needs CUDA) starts."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text("earlier sweep")
    assert "exists; pass --overwrite" in _refused(triton_configs.main, ["--out", str(sweep)], capsys)
    assert sweep.read_text() == "earlier sweep"


def test_attention_cpu_claims_no_spread_from_one_round(monkeypatch):
    """Above 4K (one timed round, by design: a 16K round takes minutes) and with ``--repeats 1`` a row has no
    [min, max] spread, and says so; up to 4K ``--repeats`` rounds give one. Inputs are tiny whatever L says."""
    import torch

    tiny = attention_cpu._inputs
    monkeypatch.setattr(attention_cpu, "_inputs", lambda length, head_dim, seed=0: tiny(16, head_dim, seed))
    threads = torch.get_num_threads()
    try:
        rows = {(length, repeats): attention_cpu.time_worker(length, 1, [("l2", "tiled")], 8, repeats)["rows"]
                for length, repeats in ((8192, 3), (64, 1), (64, 3))}
    finally:
        torch.set_num_threads(threads)
    for key, rounds in (((8192, 3), 1), ((64, 1), 1), ((64, 3), 3)):
        assert {r["rounds"] for r in rows[key]} == {rounds}
        assert all((r["spread"] is None) == (rounds == 1) for r in rows[key])
    assert attention_cpu.format_rows(rows[8192, 3]).endswith("x  (1 round)")
    md = attention_cpu.markdown(dict(setup={}, time=rows[8192, 3] + rows[64, 3], memory=[]), "cmd")
    row = {length: next(line for line in md.splitlines() if line.startswith(f"| {length} |")) for length in (64, 8192)}
    assert row[8192].endswith(" (1 round) |") and "[" not in row[8192] and "round" not in row[64] and "[" in row[64]


def test_train_step_cpu_keeps_what_failed(tmp_path, monkeypatch, fake_measuring):
    """A (threads, L) whose worker failed was printed and then left out of OUT.json and OUT.md: the files read as if
    that length had never been asked for."""
    good = train_step_cpu.subprocess.run

    def run(cmd, **kwargs):
        if json.loads(cmd[-1])["length"] == 64:
            return good(cmd, **kwargs)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nMemoryError: out of memory\n")
    monkeypatch.setattr(train_step_cpu.subprocess, "run", run)
    out = tmp_path / "r"
    assert train_step_cpu.main(["--lengths", "64,4096", "--threads", "1", "--presets", "baseline", "--out",
                                str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["L"] for r in data["rows"]] == [64]
    assert data["failed"] == [dict(L=4096, threads=1, error="rc 1: Traceback ... MemoryError: out of memory")]
    assert "Failed (not measured): threads=1 L=4096: rc 1: Traceback ... MemoryError: out of memory" in \
        out.with_suffix(".md").read_text()
