"""`make gpu-check`: lengthgen's GPU half (at most 9 minutes a run on one H100; every part in two runs, see
benchmarks/README.md), summarized in one JSON and one generated markdown file.

    python3 benchmarks/gpu_check.py                 # CUDA: benchmarks/results/<device>-<date>-<HHMMSS>.json and .md
    python3 benchmarks/gpu_check.py --tiny          # CPU dry run at tiny sizes (tests/test_gpu_check.py runs it)
    python3 benchmarks/gpu_check.py --parts attention,seed001 --budget 540     # some parts, the whole budget

Parts, in this order, each in its own subprocess with a time budget (`PARTS`; a part gets at most what is left
of ``--budget``, and one that would not fit is skipped and says so; a dry run and parts chosen with ``--parts``
have no per-part budget; ``env`` always runs):

* ``env``: device name, compute capability, torch / triton / CUDA versions, date, commit;
* ``tests``: the CUDA tests, ``pytest -m gpu`` (pytest-xdist workers when installed), pass / fail / skip counts;
* ``compare``: ``lengthgen compare`` end to end on CUDA with bf16 and ``train.compile=true`` (a short run);
* ``train_compiled``, ``train``: the ~124M modded-nanogpt-like GPT's training throughput and MFU, compiled and
  eager (`lengthgen.experiments.model_bench`);
* ``eval_long``: a 64K-token evaluation of that model (time, peak memory beyond the weights);
* ``layer``: what out-norm + gate add to an attention layer's forward + backward;
* ``seed001``: our fused kernel against seed 001's own Triton kernel (read from ``--seed-kernel`` when that
  file exists; it is not shipped with lengthgen);
* ``attention``: `lengthgen.experiments.bench` (backends x variants, bf16, causal, ratio to SDPA flash p = 1),
  one subprocess per (L, head_dim) group in `GROUPS` order, until the budget is spent.

Nothing is installed or downloaded: every part runs with the Python that runs this script (on a GPU machine the
system ``python3`` with its torch; ``PYTHONPATH=.`` when lengthgen is not installed). The targets of the issue
are checked in `gpu_report` from the measured figures; a CPU dry run measures nothing that a GPU run reports
and evaluates no target.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_args  # noqa: E402
import gpu_report  # noqa: E402

#: (part, budget in seconds on one H100; None: whatever is left). On a fresh machine (cold compile caches,
#: 2026-11-23) compare, train_compiled, train and eval_long overran 65, 55, 25 and 25 s, so one default run of
#: 540 s cannot reach every part: benchmarks/README.md gives the two-call plan that does.
PARTS = (("env", 30), ("tests", 240), ("compare", 90), ("train_compiled", 75), ("train", 40), ("eval_long", 40),
         ("layer", 60), ("seed001", 45), ("attention", None))
GROUPS = ((4096, 128), (1024, 128), (16384, 128), (65536, 128), (4096, 64), (1024, 64), (16384, 64), (65536, 64))
TINY_GROUPS = ((32, 16),)
TINY_BENCH = ["--device", "cpu", "--dtype", "float32", "--warmup", "0", "--reps", "1", "--heads", "2", "--batch", "1",
              "--backends", "tiled,sdpa"]
TEST_STATES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
MIN_PART_S = 10          # a part is not started with less than this left


def _run(cmd: list[str], timeout: float, args: argparse.Namespace, log: str) -> dict[str, Any]:
    """Run ``cmd`` in its own process group (killed whole on timeout); rc, output, seconds, timed_out. The whole
    output also goes to ``<--log-dir>/<log>.log`` when ``--log-dir`` is given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, timed_out = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, timed_out = proc.communicate()[0], True
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"{log}.log").write_text(f"$ {' '.join(cmd)}\n{output or ''}")
    return dict(rc=proc.returncode, output=output or "", seconds=time.perf_counter() - start, timed_out=timed_out)


def _status(run: dict[str, Any], what: str = "") -> str:
    if run["timed_out"]:
        return f"timeout after {run['seconds']:.0f} s{what}"
    if run["rc"] != 0:
        last = [line for line in run["output"].strip().splitlines() if line.strip()][-1:] or [""]
        return f"failed (rc {run['rc']}): {last[0][-300:]}"
    return "ok"


def run_part(name: str, args: argparse.Namespace, timeout: float, work: Path) -> dict[str, Any]:
    """A measuring part of `gpu_parts` in a subprocess; its result is the JSON it wrote."""
    out = work / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--part-out", str(out),
           "--work", str(work)] + (["--tiny"] if args.tiny else [])
    cmd += ["--seed-kernel", args.seed_kernel] if args.seed_kernel else []
    run = _run(cmd, timeout, args, name)
    entry: dict[str, Any] = dict(status=_status(run), seconds=run["seconds"])
    if entry["status"] == "ok":
        entry["result"] = json.loads(out.read_text())
        entry["status"] = entry["result"].get("status", "ok")
    else:
        entry["log_tail"] = run["output"][-3000:]
    return entry


def run_tests(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """``pytest -m gpu`` with counts read from its verbose output (also when it is stopped by the timeout)."""
    workers = args.pytest_workers if importlib.util.find_spec("xdist") and not args.tiny else 0
    paths = ["tests/test_bench.py"] if args.tiny else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=",
           *(["-n", str(workers)] if workers else []), *paths]
    run = _run(cmd, timeout, args, "tests")
    counts, failed = parse_pytest(run["output"])
    status = _status(run, f" ({sum(counts.values())} tests reported)")
    if status.startswith("failed") and (counts.get("failed") or counts.get("error")):
        status = f"failed: {counts.get('failed', 0)} failed, {counts.get('error', 0)} errors"
    entry = dict(status=status, seconds=run["seconds"],
                 result=dict(command=" ".join(cmd[1:]), counts=counts, failed=failed))
    if status != "ok":
        entry["log_tail"] = run["output"][-3000:]
    return entry


def parse_pytest(output: str) -> tuple[dict[str, int], list[str]]:
    """(counts by outcome, failed or erroring test ids) from ``pytest -v`` output, with or without xdist."""
    outcomes: dict[str, str] = {}
    pattern = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
    for line in output.splitlines():
        match = (re.match(rf"^(tests/\S+::\S+)\s+{pattern}\b", line)
                 or re.search(rf"\]\s+{pattern}\s+(tests/\S+::\S+)", line))
        if match:
            test, outcome = match.groups() if match.group(1).startswith("tests/") else match.groups()[::-1]
            outcomes[test] = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(outcome, outcome.lower())
    counts = {state: sum(o == state for o in outcomes.values()) for state in TEST_STATES}
    summary = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b", output.splitlines()[-1]
                         if output.strip() else "")
    if summary and output.splitlines()[-1].startswith("="):
        counts = {state: 0 for state in TEST_STATES}
        counts.update({("error" if k.startswith("error") else k): int(n) for n, k in summary})
    return ({k: n for k, n in counts.items() if n},
            sorted(t for t, o in outcomes.items() if o in ("failed", "error")))


def run_attention(args: argparse.Namespace, deadline: float, work: Path) -> dict[str, Any]:
    """The attention benchmark, one subprocess per (L, head_dim) group until the budget is spent."""
    groups, rows, start = [], [], time.perf_counter()
    for length, head_dim in args.groups or (TINY_GROUPS if args.tiny else GROUPS):
        left = deadline - time.perf_counter()
        if left < MIN_PART_S:
            groups.append(dict(length=length, head_dim=head_dim, status=f"skipped: no time left ({left:.0f} s)"))
            continue
        out = work / f"attention-{length}-{head_dim}.json"
        cmd = [sys.executable, "benchmarks/attention_gpu.py", "--lengths", str(length), "--head-dims",
               str(head_dim), "--time-budget", str(max(1.0, left - 30)), "--out", str(out)]
        run = _run(cmd + (TINY_BENCH if args.tiny else []), left, args, f"attention-{length}-{head_dim}")
        group = dict(length=length, head_dim=head_dim, status=_status(run), seconds=run["seconds"])
        if group["status"] == "ok":
            found = json.loads(out.read_text())["rows"]
            skipped = sum(r["status"] == "skipped: time budget" for r in found)
            group["status"] = f"partial: {skipped} cases over the time budget" if skipped else "ok"
            rows += found
        else:
            group["log_tail"] = run["output"][-2000:]
        groups.append(group)
    done = [g for g in groups if g["status"] == "ok"]
    status = "ok" if len(done) == len(groups) else f"partial: {len(done)} of {len(groups)} groups complete"
    return dict(status=status, seconds=time.perf_counter() - start, result=dict(groups=groups, rows=rows))


def _write(result: dict[str, Any], stem: Path) -> None:
    from lengthgen.atomic import atomic_write_text

    result["targets"] = gpu_report.targets(result) if result["mode"] == "cuda" else []
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1))
    atomic_write_text(stem.with_suffix(".md"), gpu_report.markdown(result))


def _stem(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """``<out-dir>/<device>-<date>-<HHMMSS>``, claimed by creating its .json exclusively: a name already taken
    (another run in the same second) gets a suffix -2, -3, ..., so that no run replaces another's files."""
    env = result["parts"].get("env", {}).get("result") or {}
    name = env.get("device_name") or ("cpu" if args.tiny else "cuda")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    base = Path(args.out_dir) / f"{slug}-{result['started'][:19].replace('T', '-').replace(':', '')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        stem = base.with_name(f"{base.name}-{n}" if n > 1 else base.name)
        if stem.with_suffix(".md").exists():
            continue
        try:
            stem.with_suffix(".json").open("x").close()
        except FileExistsError:
            continue
        return stem


def check(args: argparse.Namespace) -> Path:
    """Run the parts within the budget, writing the JSON and markdown after each; returns the JSON's path."""
    import torch

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device here; `python3 benchmarks/gpu_check.py --tiny` is the CPU dry run")
    wanted = ["env", *args.parts] if args.parts else [p for p, _ in PARTS]
    start, deadline = time.perf_counter(), time.perf_counter() + args.budget
    result: dict[str, Any] = dict(schema="lengthgen-gpu-check/1", mode="tiny" if args.tiny else "cuda",
                                  started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                                  budget_s=args.budget, commit=args.commit, parts={})
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        stem = None
        for name, budget in (p for p in PARTS if p[0] in wanted):
            left = deadline - time.perf_counter()
            timeout = left if budget is None or args.parts or args.tiny else min(budget, left)
            print(f"[gpu-check] {name} (up to {timeout:.0f} s)", flush=True)
            if timeout < MIN_PART_S and name != "env":
                entry = dict(status=f"skipped: no time left ({left:.0f} s of the budget)")
            elif name == "tests":
                entry = run_tests(args, timeout)
            elif name == "attention":
                entry = run_attention(args, time.perf_counter() + timeout, Path(tmp))
            else:
                entry = run_part(name, args, timeout, Path(tmp))
            result["parts"][name] = dict(entry, budget_s=budget)
            print(f"[gpu-check] {name}: {entry['status']}", flush=True)
            result["elapsed_s"] = time.perf_counter() - start
            stem = stem or _stem(args, result)
            _write(result, stem)
    print(gpu_report.markdown(result))
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return stem.with_suffix(".json")


def _budget(text: str) -> float:
    """``--budget``: seconds, at least `MIN_PART_S`."""
    return bench_args.number(text, float, lambda v: MIN_PART_S <= v < math.inf,
                             f"a number of seconds >= {MIN_PART_S}")


def _parts(text: str) -> tuple[str, ...]:
    """``--parts``: a comma list of `PARTS` names."""
    valid = [p for p, _ in PARTS]
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in chosen if p not in valid]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or [text]}; choose from {', '.join(valid)}")
    return chosen


def _workers(text: str) -> int:
    """``--pytest-workers``: an integer >= 0 (0: no pytest-xdist)."""
    return bench_args.number(text, int, lambda v: v >= 0, "an integer >= 0 (0: no pytest-xdist)")


def _groups(text: str) -> list[tuple[int, int]]:
    """``--groups``: comma-separated ``length:head_dim`` pairs of positive integers."""
    try:
        groups = [tuple(int(n) for n in item.split(":")) for item in text.split(",") if item]
    except ValueError:
        groups = []
    if not groups or any(len(g) != 2 or min(g) < 1 for g in groups):
        raise argparse.ArgumentTypeError(f"expected length:head_dim pairs such as 16384:128,65536:64, got {text!r}")
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = bench_args.Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run at tiny sizes (no GPU figures)")
    ap.add_argument("--budget", type=_budget, default=None,
                    help=f"seconds for everything, at least {MIN_PART_S} (default 540; tiny 900)")
    ap.add_argument("--parts", type=_parts, default=None, help=f"comma list of {', '.join(p for p, _ in PARTS)} "
                    "(default all; env always runs; chosen parts share the budget without per-part limits)")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results (tiny: runs/gpu-check)")
    ap.add_argument("--seed-kernel", default=None,
                    help="seed 001's kernel.py (not shipped; without it the seed001 part is skipped)")
    ap.add_argument("--commit", default=None, help="the lengthgen commit measured (when the checkout has no .git)")
    ap.add_argument("--log-dir", default=None, help="write each part's whole output to DIR/<part>.log")
    ap.add_argument("--pytest-workers", type=_workers, default=8, help="pytest-xdist workers for the CUDA tests")
    ap.add_argument("--groups", type=_groups, default=None,
                    help="the attention part's (length:head_dim) groups, in order, e.g. 16384:128,65536:64 (default "
                         + ",".join(f"{length}:{d}" for length, d in GROUPS) + ")")
    ap.add_argument("--run-part", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_part:
        import gpu_parts

        name, compiled = args.run_part.removesuffix("_compiled"), args.run_part.endswith("_compiled")
        out = gpu_parts.PARTS[name](tiny=args.tiny, compile=compiled, out_dir=args.work, seed_kernel=args.seed_kernel)
        Path(args.part_out).write_text(json.dumps(out, indent=1))
        return 0
    if args.budget is None:
        args.budget = 900.0 if args.tiny else 540.0
    args.out_dir = args.out_dir or str(ROOT / ("runs/gpu-check" if args.tiny else "benchmarks/results"))
    for option, folder in (("--out-dir", args.out_dir), ("--log-dir", args.log_dir)):
        try:
            if folder:                                     # before any part runs, not when the first one is written
                Path(folder).mkdir(parents=True, exist_ok=True)
                if not os.access(folder, os.W_OK):
                    raise PermissionError(13, "not writable")
        except OSError as err:
            ap.error(f"argument {option}: {folder} is not a folder this can write to ({err.strerror})")
    check(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
