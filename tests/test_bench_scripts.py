"""The CPU benchmark scripts' command lines (benchmarks/attention_cpu.py, attention_crossover.py, train_step_cpu.py,
triton_configs.py): bad input is a one-line error, exit status 2, before anything is measured."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention_cpu  # noqa: E402
import attention_crossover  # noqa: E402
import train_step_cpu  # noqa: E402


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
])
def test_bad_lists_are_one_line_errors(main, argv, message, capsys):
    assert message in _refused(main, argv, capsys)


def test_lists_parse():
    assert attention_cpu.bench_args.ints(" 64, 256,") == (64, 256)
    assert attention_cpu.bench_args.names(attention_cpu.VARIANTS, empty=True)("") == ()
