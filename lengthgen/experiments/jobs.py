"""The runs of a comparison as jobs: train one run (or reuse / continue it) and evaluate it with the one evaluator.

A `Runner` runs them one after another, or ``workers`` at a time, each in its own spawned process
(``compare.workers``). The results are the same either way: a run seeds its weights, data and evaluation from its
own ``train.seed`` and uses its own ``train.threads`` (required with several workers, so the runs share the
cores instead of each taking all of them), and it writes only its own folder, under that folder's lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lengthgen.config import counted, steps_trained, to_plain
from lengthgen.eval import RunEval, eval_source, evaluate
from lengthgen.experiments.needle import needle_filler, run_map
from lengthgen.model import GPT
from lengthgen.train import NonFiniteLossError, Trainer
from lengthgen.train.config import RunConfig
from lengthgen.train.setup import autocast_dtype, denormals_flushed, device_type, flush_denormals, resolve, run_threads

Log = Callable[[str], None]


class WorkerLost(Exception):
    """A worker process of `Runner` ended without a result (killed by a signal, e.g. by the system when out of
    memory); the message says what to do."""


@dataclass(frozen=True)
class Job:
    """One run: its config and folder, its label in the log (``l2 seed 0``: its lines, its training steps' too,
    start ``[l2 seed 0]``) and, unless it is only trained (a pretraining run: ``name`` None), the variant name its
    evaluations are filed under, the evaluation lengths, tokens per length, the metric its log line shows and the
    retrieval map's needle depths (none: no map) and samples per cell."""
    config: RunConfig
    run_dir: Path
    label: str
    name: str | None = None
    lengths: tuple[int, ...] = ()
    tokens: int = 0
    metric: str = "loss"
    needle_depths: tuple[float, ...] = ()
    needle_samples: int = 100
    resume: bool = False
    progress: bool = True


class Runner:
    """Runs lists of jobs (`run`), one after another or, with ``workers`` > 1, that many at once in spawned
    processes (started once, kept until `close`; a context manager). The workers ignore Ctrl-C: the comparison's
    process gets it and, leaving the context on it or on any error, ends the workers at once instead of waiting
    for their runs to finish (their checkpoints are atomic: ``--resume`` continues them)."""

    def __init__(self, workers: int, log: Log) -> None:
        self.log, self.sources, self.shown = log, {}, set()
        self.pool = None if workers == 1 else ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
            initargs=(denormals_flushed(),))

    def run(self, jobs: list[Job]) -> list[list[tuple[str, RunEval]]]:
        """Each job's ``(variant name, evaluation)`` pairs (`run_job`), in the jobs' order. In the worker
        processes: without progress bars, each job's warnings issued here (so the command shows them as its own)
        and its log lines logged when it ends, before its error when it raises one (`_in_worker`); in one process
        its warnings come when issued. Either way a warning shown alike before is not shown again (`_once`). An
        error a job raises comes back as it was raised, with the job's label as its ``run_label`` (`_named`), which
        the command's one-line error shows."""
        with self._once():
            return self._run(jobs)

    def _run(self, jobs: list[Job]) -> list[list[tuple[str, RunEval]]]:
        if self.pool is None:
            results = []
            for job in jobs:
                with _named(job):
                    results.append(run_job(job, self.log, self.sources))
            return results
        with _sigint_ignored():         # the workers, spawned by submit, inherit it
            futures = [self.pool.submit(_in_worker, dataclasses.replace(job, progress=False)) for job in jobs]
        results = []
        for job, future in zip(jobs, futures):
            try:
                with _named(job):
                    evaluations, lines, caught = future.result()
            except BrokenProcessPool:
                raise WorkerLost(f"a worker process ended abruptly (killed by a signal, e.g. by the system when out "
                                 f"of memory) while [{job.label}] or a run beside it trained or was evaluated; the "
                                 "checkpoints on disk are intact: --resume continues the comparison") from None
            except Exception as err:
                self._replay(*getattr(err, "worker_output", ([], [])))
                raise
            self._replay(lines, caught)
            results.append(evaluations)
        return results

    def _replay(self, lines: list[str], caught: list[tuple[str, type, str, int]]) -> None:
        """A worker job's warnings and log lines, shown here."""
        for warning in caught:
            warnings.warn_explicit(*warning)
        for line in lines:
            self.log(line)

    @contextlib.contextmanager
    def _once(self):
        """Inside, a warning of the same text, category and place as one shown before is not shown again. Python's
        own record of the warnings it showed is reset by every `warnings.catch_warnings` (the runs make several),
        and each worker has its own: either way each run would show its warnings again."""
        show = warnings.showwarning

        def once(message, category, filename, lineno, *rest):
            key = (str(message), category, filename, lineno)
            if key not in self.shown:
                self.shown.add(key)
                show(message, category, filename, lineno, *rest)

        warnings.showwarning = once
        try:
            yield
        finally:
            warnings.showwarning = show

    def close(self, abort: bool = False) -> None:
        """Shut the workers down after their runs (``abort``: now, ending the runs they are in)."""
        if self.pool is None:
            return
        if abort:
            for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                process.terminate()
        self.pool.shutdown(cancel_futures=True)

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(abort=kind is not None)


@contextlib.contextmanager
def _named(job: Job):
    """Set ``run_label`` to ``job``'s label on an error raised inside, its type and message kept: with several
    workers the run's log lines, which name it, never came back, and the error line named no run (the command's
    one-line error shows it: ``error: [l2 seed 0] out of memory ...``)."""
    try:
        yield
    except Exception as err:
        err.run_label = job.label
        raise


class _sigint_ignored:
    """Ignore SIGINT in this process while inside (spawned processes inherit it; only from the main thread)."""

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.saved = signal.getsignal(signal.SIGINT) if main else None
        if self.saved is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            signal.signal(signal.SIGINT, self.saved)


def _start_worker(flush: bool) -> None:
    """A worker's initializer: denormals flushed as in the comparison's process (``flush``: `flush_denormals`), so
    that the workers compute as one process would; and a daemon thread ends the worker as soon as the comparison's
    process is gone, even after ``kill -9`` (orphans kept training under their run folders' locks). Checkpoints
    are atomic: ``--resume`` continues the runs."""
    flush_denormals(flush)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the parent's to handle (`Runner`)
    parent = multiprocessing.parent_process()

    def watch() -> None:
        parent.join()                   # waits on the parent's sentinel, which closes when it dies
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _in_worker(job: Job) -> tuple[list[tuple[str, RunEval]], list[str], list[tuple[str, type, str, int]]]:
    """`run_job`'s evaluations, log lines and warnings (message, category, file, line: picklable); an error it
    raises (`_sendable`) carries the lines and warnings before it as ``worker_output``."""
    lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        try:
            evaluations = run_job(job, lines.append, {})
        except Exception as err:
            sent = _sendable(err)
            sent.worker_output = (lines, _picklable(caught))
            raise sent
    return evaluations, lines, _picklable(caught)


def _picklable(caught: list[warnings.WarningMessage]) -> list[tuple[str, type, str, int]]:
    return [(str(w.message), w.category, w.filename, w.lineno) for w in caught]


def _sendable(err: Exception) -> Exception:
    """``err``, or where pickle cannot rebuild it (the comparison's process would find the pool broken and take it
    for a killed worker, the error lost) a RuntimeError of its type and message, caused by it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        sent = RuntimeError(f"{type(err).__name__}: {err}")
        sent.__cause__ = err
        return sent


def run_job(job: Job, log: Log, sources: dict[str, Any]) -> list[tuple[str, RunEval]]:
    """Train ``job``'s run (``resume``: reuse or continue the one in its folder) and, when it has a ``name``,
    evaluate it (`evaluate_run`) with its training seconds (summed over the sessions that trained it) and tokens
    recorded. ``sources``: `evaluate_run`'s. The log says ``training ...`` only when steps are left to train (the
    run built and its checkpoint read first: a finished run is only ``reused``)."""
    steps = job.config.train.steps
    start = time.perf_counter()
    try:
        trainer = Trainer(job.config, job.run_dir, progress=job.progress, resume=job.resume, name=job.label)
        try:
            if trainer.start_step < steps:
                log(f"[{job.label}] training {counted(steps, 'step')} at length {max(job.config.lengths())}"
                    + (f" (resuming from step {trainer.start_step})" if trainer.start_step else ""))
            trained = trainer.fit()
        finally:
            trainer.close()
    except NonFiniteLossError as err:
        if job.name is None:        # a pretraining run: its variants have no weights to start from (named by
            raise                   # `Runner.run`, as every error of a run)
        return diverged_run(job, log_divergence(err, job.label, log), sources)
    started, seconds = trained.trainer.start_step, round(time.perf_counter() - start, 2)
    if started == steps:
        log(f"[{job.label}] reused the finished run {job.run_dir}")
    else:
        log(f"[{job.label}] trained {steps_trained(started, steps) + ' ' if started else ''}in {seconds:.0f} s")
    if job.name is None:
        return []
    start = time.perf_counter()
    out = []
    for key, evaluation in evaluate_run(trained, job, sources):
        out.append((key, dataclasses.replace(evaluation, train_seconds=trained.trainer.train_seconds,
                                             train_tokens=trained.trainer.tokens)))
        log(f"[{key} seed {job.config.train.seed}] {job.metric} at length " + ", ".join(
            f"{r.length}: {r.value_text(job.metric)}" for r in evaluation.lengths)
            + f" (evaluated in {time.perf_counter() - start:.0f} s)")
    return out


def evaluate_run(trained, job: Job, sources: dict[str, Any]) -> list[tuple[str, RunEval]]:
    """(variant name, evaluation) of a trained run's weights and, with BEMA on, of its BEMA weights
    (``name+bema``), with the one evaluator under the run's autocast and CPU threads, seeded with its seed, in
    forward passes of the run's ``eval_batch_size`` x training length tokens; with ``job.needle_depths`` also its
    retrieval map. ``sources``: data config JSON -> what it is evaluated on (text: single long validation
    documents) and its needles' filler, filled as needed."""
    cfg, trainer = trained.config, trained.trainer
    evaluated = _sources(cfg, job, sources, lambda: (trainer.eval_source, trainer.source))

    def one(bema: bool) -> RunEval:
        evaluation = _evaluate(trained.model, cfg, job, evaluated, trainer.autocast_dtype)
        return dataclasses.replace(evaluation, bema=bema, run_dir=str(trained.run_dir),
                                   final_train_loss=trained.history[-1])

    out = [(job.name, one(False))]
    if trainer.bema is not None and trainer.bema.started:
        with trainer.use_bema():
            out.append((f"{job.name}+bema", one(True)))
    return out


def diverged_run(job: Job, why: str, sources: dict[str, Any]) -> list[tuple[str, RunEval]]:
    """The evaluations of a run whose training diverged (``why``: the trainer's message): its weights are not
    finite, so it is evaluated as a model whose output is not finite anywhere, every scored position taking the
    evaluator's worst value (+inf loss, -inf for higher-is-better metrics), never a number that could be named best;
    `RunEval.diverged` says why. With BEMA on (started by ``train.steps``), as ``name+bema`` too, so that every variant
    keeps a run per seed."""
    cfg, source = resolve(job.config)
    evaluated = _sources(cfg, job, sources, lambda: (eval_source(cfg.data, source), source))
    autocast = autocast_dtype(cfg.train, device_type(cfg.train))
    evaluation = evaluate_diverged(cfg, lambda model: _evaluate(model, cfg, job, evaluated, autocast), why)
    evaluation = dataclasses.replace(evaluation, run_dir=str(job.run_dir))
    started = cfg.train.bema.enabled and cfg.train.steps >= cfg.train.bema.tau     # as its finished seeds' BEMA
    bema = [(f"{job.name}+bema", dataclasses.replace(evaluation, bema=True))] if started else []
    return [(job.name, evaluation), *bema]


def log_divergence(err: NonFiniteLossError, label: str, log: Log) -> str:
    """Why a run's training diverged, for its report (the trainer's message up to its first ``;``: ``training loss
    is nan at step 3``), said in the log under ``label``."""
    why = str(err).split("; ")[0]
    log(f"[{label}] diverged ({why}): it counts as the worst value at every length")
    return why


def evaluate_diverged(cfg: RunConfig, evaluate: Callable[[GPT], RunEval], why: str) -> RunEval:
    """``evaluate`` (an evaluator of a model of the resolved ``cfg``) of a diverged run: a model of ``cfg`` on its
    device whose every weight is NaN, so that its output is not finite anywhere and every scored position takes the
    evaluator's worst value; `RunEval.diverged` is ``why``."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():    # the caller's RNG stays as it was
        model = GPT(cfg.model).to(device_type(cfg.train))
        for parameter in model.parameters():
            parameter.fill_(math.nan)
    with warnings.catch_warnings():     # each length's "output is not finite" warning (the log says it diverged);
        warnings.filterwarnings("ignore", r".*the model's output is not finite")    # the source's own still warn
        return dataclasses.replace(evaluate(model), diverged=why)


def _sources(cfg: RunConfig, job: Job, sources: dict[str, Any], make: Callable[[], tuple[Any, Any]]
             ) -> tuple[Any, Any]:
    """(what a run of ``cfg`` is evaluated on, its needles' filler or None), from ``sources`` (data config JSON ->
    that pair), filled from ``make()`` -> (evaluation source, training source) when it lacks them."""
    key = json.dumps(to_plain(cfg.data), sort_keys=True)
    if key not in sources:
        evaluated, trained_on = make()
        sources[key] = (evaluated, needle_filler(cfg.data, trained_on) if job.needle_depths else None)
    return sources[key]


def _evaluate(model: GPT, cfg: RunConfig, job: Job, evaluated: tuple[Any, Any], autocast: torch.dtype | None
              ) -> RunEval:
    """``model`` evaluated at ``job``'s lengths with the one evaluator under ``autocast`` and the run's CPU threads,
    seeded with its seed, in forward passes of its ``eval_batch_size`` x training length tokens (and its retrieval
    map with ``job.needle_depths``); ``evaluated``: `_sources`."""
    lengths = list(job.lengths)
    with run_threads(cfg.train):
        evaluation = evaluate(model, evaluated[0], lengths, tokens_per_length=job.tokens, seed=cfg.train.seed,
                              autocast=autocast, forward_tokens=cfg.train.eval_batch_size * max(cfg.lengths()))
        if job.needle_depths:
            evaluation.needle = run_map(model, cfg, evaluated[1], lengths, list(job.needle_depths),
                                        samples=job.needle_samples, autocast=autocast)
    return dataclasses.replace(evaluation, config=cfg.to_dict(), seed=cfg.train.seed)


__all__ = ["Job", "Runner", "WorkerLost", "diverged_run", "evaluate_diverged", "evaluate_run", "log_divergence",
           "run_job"]
