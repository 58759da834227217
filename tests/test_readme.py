"""The README works as written: every command of its ```bash blocks runs in README order in a scratch folder
(later commands use the earlier ones' runs), made tiny by flags and ``--set`` overrides appended to it (and
prints the log lines of its ```text block, numbers aside), and every ```python block runs. A command that needs
a GPU or a download is listed in `SKIP` with the reason, and the README's line says so."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

MODEL = ["--set", "model.dim=16", "--set", "model.layers=1", "--set", "model.heads=2", "--set", "model.mlp_ratio=1.0"]
#: appended to each subcommand's README line: few steps, a tiny model, few evaluation tokens
TINY = {
    "train": MODEL + ["--set", "train.steps=3", "--set", "train.batch_size=4", "--set", "train.tokens_per_step=none",
                      "--set", "train.eval_batches=1", "--set", "train.eval_batch_size=2", "--log-every", "2"],
    "compare": MODEL + ["--steps", "2", "--eval-tokens", "256", "--set", "train.batch_size=4", "--log-every", "1",
                        "--workers", "1", "--set", "compare.needle_samples=2"],
    "needle": ["--samples", "2"],
    "eval": ["--tokens", "256"],
    "retrofit": ["--steps", "2", "--eval-tokens", "256", "--set", "train.batch_size=4"],
    "bench": ["--variants", "baseline", "--head-dims", "64", "--reps", "1", "--warmup", "1"],
    "sample": ["--max-new-tokens", "8"], "report": [], "theory": [], "config": [], "export": [],
}
#: appended after TINY to the README lines holding the key: what these lines need on top of tiny sizes
EXTRA = {"--extend": ["--set", "train.steps=5"]}    # longer than the run it extends (TINY: 3 steps)
#: README commands not run here (a substring of the line -> why); the README's comment must say so too
SKIP = {
    "configs/seed000_avnorm.toml": "seed 000's ~124M model and its protocol (or FineWeb .bin shards): GPU-sized",
}
#: lines of the bash blocks that are not lengthgen commands (a prefix -> why they are not run)
NOT_RUN = {"make ": "sets up the environment this test runs in", "source ": "environment setup",
           "pip ": "environment setup", "tensorboard ": "a server"}
#: the local Hugging Face model directory the README's Python blocks load
HF_MODEL = "models/llama"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def commands() -> list[str]:
    """The runnable lines of the README's bash blocks, in order, continuation lines joined."""
    lines = []
    for block in blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if not line or line.startswith("#") or line.startswith(tuple(NOT_RUN)):
                continue
            assert re.match(r"(lengthgen|python -m lengthgen|torchrun) ", line), \
                f"README bash line {line!r} is neither a lengthgen command nor in NOT_RUN"
            lines.append(line)
    return lines


def subcommand(argv: list[str]) -> str:
    """The lengthgen subcommand of a command line (``lengthgen X``, ``python -m lengthgen X``, ``torchrun ... -m
    lengthgen X``)."""
    return argv[argv.index("lengthgen") + 1]


def shape(line: str) -> str:
    """A log line with each number (``100/200``, ``1.8e-03``, ``34.3k``, ``0:06``) replaced by ``N``."""
    return re.sub(r"(?<![\w.])\d[\w.+:/-]*", "N", line.strip())


def test_commands_are_found_and_skips_are_marked():
    lines = commands()
    assert len(lines) >= 10 and lines[0].startswith("lengthgen compare")
    for marker, reason in SKIP.items():
        marked = [line for line in lines if marker in line]
        assert marked, f"SKIP entry {marker!r} matches no README command; remove it"
        for line in marked:
            comment = line.partition("  #")[2]
            assert re.search(r"GPU|download|network", comment), f"README line {line!r} is skipped here " \
                f"({reason}); its comment must say it needs a GPU, a download or a network"
    for line in lines:
        assert subcommand(shlex.split(line, comments=True)) in TINY, f"no tiny overrides for {line!r}: add to TINY"


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "LENGTHGEN_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE"):
        env.pop(key, None)
    return env


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = _environment(tmp_path)
    printed: set[str] = set()       # every stdout line, numbers aside
    for line in commands():
        if any(marker in line for marker in SKIP):
            continue
        argv = shlex.split(line, comments=True)
        argv += TINY[subcommand(argv)] + [arg for key, args in EXTRA.items() if key in line for arg in args]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        output = proc.stdout + proc.stderr
        printed |= {shape(out_line) for out_line in proc.stdout.splitlines()}
        assert proc.returncode == 0 and "Traceback" not in output, f"README command failed: {line}\n{output[-4000:]}"
        assert "\r" not in proc.stdout, f"{line}: a redirected log must have no progress-bar frames"
        if subcommand(argv) in ("train", "compare") and "--resume" not in argv:
            assert re.search(r"^\[[^]]+\] step 1/\d+  loss ", proc.stdout, flags=re.M), f"{line}: no step lines\n" \
                f"{proc.stdout[-2000:]}"
    for example in "\n".join(blocks("text")).splitlines():    # the README's log lines, as a README command prints
        assert shape(example) in printed, f"README log line {example!r} is not what lengthgen prints"


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    code = blocks("python")[index]
    monkeypatch.chdir(tmp_path)
    if HF_MODEL in code:
        transformers = pytest.importorskip("transformers", reason="the Hugging Face block needs transformers "
                                                                 "(pip install -e '.[dev]')")
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        transformers.LlamaForCausalLM(config).save_pretrained(HF_MODEL)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
