"""The training loop: `train(config, out_dir)` and `Trainer`.

One step (`Trainer._train_step`): draw the step's batch from a generator seeded with (seed, step) at the staged
length (``batch = tokens_per_step // length``; with ``train.restart_at_stages`` a new stage starts with fresh
optimizers and a new warmup), forward/backward it in ``grad_accum`` micro-batches under the
run's autocast, stop on a non-finite loss, clip the gradient norm, set the scheduled learning rate, step AdamW
(and Muon), apply QK-clip, update BEMA. With ``train.adam_every`` > 1 AdamW steps only where (step + 1) %
adam_every == 0 (seed 000's DistAdam: odd steps), on its parameters' gradients summed since its last step: they
are not zeroed in between, the clip sees them at AdamW's steps only, a checkpoint between two AdamW steps keeps
them, and a restart at a stage hands them to the fresh AdamW. `fit` then logs, checkpoints and evaluates (in that
order: an evaluation that fails or is interrupted loses no step, and the resumed run evaluates that step first).
On CPU a resumed run reproduces the losses of an uninterrupted run exactly (with the same ``train.threads`` and
number of ranks: another count sums in another order; with batch norm or dropout, per rank, another number of ranks
changes the steps: it warns).

`Trainer.evaluate` is `lengthgen.eval.evaluate` under the training device and autocast: every
``train.eval_every`` steps and at the end it logs the mean loss and metrics at each eval length; when
``train.eval_lengths`` go beyond the training length, the end also writes the by-position evaluation to
``eval.json`` (``eval_bema.json`` with BEMA weights), a `lengthgen.eval.RunEval`.

Beside the loop: `setup` (config, lengths, device, dtype, what a resume may change), `weights`
(``train.init_from``, `load_run`), `checkpoint`, `run_folder` (its lock and rules: fresh or resume, checkpoint
fallback), `log` (``metrics.jsonl``), `optim` (optimizers, QK-clip). Under ``torchrun`` the model is wrapped in DDP
or sharded with FSDP2 (``train.parallel``) and each rank trains on its contiguous share of the global batch
(`distributed`); only rank 0 holds the folder's lock, logs, checkpoints (full weights) and writes ``eval.json``;
under DDP it alone evaluates too, and hands the results to the other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.config import ConfigError, ConfigWarning, check_value
from lengthgen.data.config import step_generator
from lengthgen.data.tasks import own_task
from lengthgen.data.tasks.base import Batch
from lengthgen.eval import Provenance, ResultsError, RunEval, eval_source, evaluate
from lengthgen.eval.evaluate import sequences
from lengthgen.model import GPT
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train import distributed, run_folder
from lengthgen.train.bema import BEMA
from lengthgen.train.config import RunConfig, save_config
from lengthgen.train.data import split_batch
from lengthgen.train.log import RunLog
from lengthgen.train.optim import (build_optimizers, capture_logits, captured_max_logits, clip_logits, set_lr,
                                   set_muon_momentum)
from lengthgen.train.schedule import lr_multiplier, momentum_at
from lengthgen.train.setup import (DATA_LOCATION, autocast_dtype, check_backend, check_resume, check_world, device_type,
                                   resolve, run_threads, split_batch_notes, world_change_note)
from lengthgen.train.tracking import Trackers, import_wandb, record_start, run_header, text_size
from lengthgen.train.weights import load_initial_weights


#: the train keys that say what the final evaluation (eval.json) holds
_EVAL_KEYS = ("eval_lengths", "eval_batches", "eval_batch_size")


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN or infinite; the message names the step and the last checkpoint.
    Under torchrun every rank raises it at the same step (the loss and gradients are averaged over ranks)."""

    every_rank = True       # rank 0 alone reports it (`distributed.reported_by_rank0`)


@dataclass
class TrainResult:
    model: GPT                    # the trained model (final weights, eval mode)
    run_dir: Path
    step: int                     # optimizer updates done
    history: list[float]          # training loss of every step from 0 (including resumed-from steps)
    config: RunConfig             # the resolved config (model filled from the data source)
    metrics: dict[str, Any] = field(default_factory=dict)   # the last periodic evaluation's log entry (eval, ...)
    checkpoint: Path | None = None
    trainer: "Trainer | None" = None
    evaluation: RunEval | None = None   # the final evaluation by position (eval.json), when it ran


class Trainer:
    """Holds the model, optimizers, BEMA and bookkeeping of one run. `train` is the usual entry point.

    Everything that can fail on the configuration (data source, task kwargs, lengths, model) or on the run folder
    (in use, holding another run, a resume that would change the trajectory) fails in the constructor, before any
    step. The trainer holds the folder's lock until `close` (`train` closes it).
    """

    def __init__(self, config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
                 resume: bool = False, overwrite: bool = False, extend: bool = False, name: str | None = None
                 ) -> None:
        if resume and overwrite:
            raise ValueError("resume or overwrite a run folder, not both")
        if extend and not resume:       # as the CLI's --extend without --resume
            raise ValueError("extend changes train.steps of a resumed run: give resume=True too")
        if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
            raise ConfigError(f"out_dir must be the run's folder, a str or Path, got {out_dir!r}", "out_dir")
        cfg, self.source = resolve(config)
        self.config, tc = cfg, cfg.train
        if cfg.data.kind == "text" and cfg.data.text.get("val_corpus") is not None:
            _ = self.eval_source      # a validation corpus of its own is read now: a bad one fails before training
        self.run_dir, self.name = Path(out_dir), name
        kind = device_type(tc)
        self.rank, self.world, local_rank = distributed.env_world()
        if self.world > 1:      # before joining the process group: rank 0 alone reports a bad config
            check_world(cfg, self.world)
        distributed.setup(kind)
        if self.world > 1:      # the same config and options on every rank; the text by its tokens, wherever read
            distributed.check_same({**cfg.to_dict(), "data digest": self.source.digest(), "--out": str(out_dir),
                                    "--resume": resume, "--overwrite": overwrite, "--extend": extend},
                                   ignore=DATA_LOCATION)
        self.is_main = self.rank == 0
        self.progress = progress and self.is_main
        self.device = torch.device(f"cuda:{local_rank}" if kind == "cuda" and self.world > 1 else kind)
        if self.is_main:
            for note in split_batch_notes(cfg, self.world):
                warnings.warn(note, ConfigWarning, stacklevel=2)
        self.autocast_dtype = autocast_dtype(tc, kind)
        if tc.wandb and self.is_main:
            import_wandb(tc.wandb)

        torch.manual_seed(tc.seed)
        self.model = GPT(cfg.model).to(self.device)
        check_backend(self.model, cfg, self.device)
        if own_task(cfg.data.task):     # its metrics and chance levels meet the contract, or fail before training
            evaluate(self.model, self.source, [cfg.data.length], tokens_per_length=2 * cfg.data.length, seed=tc.seed,
                     autocast=self.autocast_dtype, diagnostics=False)
        self.initialized_from: dict[str, Any] | None = None
        self.step, self.tokens = 0, 0
        self.train_seconds: float | None = 0.0          # in the training loop, summed over sessions (None: unknown)
        self._session: tuple[float, float | None] | None = None    # (perf_counter at this fit's start, seconds before)
        self.history: list[float] = []
        self.metrics: dict[str, Any] = {}
        self.last_checkpoint: Path | None = None
        self._saved_step: int | None = None
        self._unlogged_eval = False     # resumed from a checkpoint whose step's evaluation was not logged
        self.evaluation: RunEval | None = None
        self.folder: run_folder.FolderLock | None = None
        self.extended: dict[str, Any] | None = None     # the log entry of a resume with --extend
        self._read: tuple | None = None                 # a checkpoint read by `_read_checkpoint`, until restored
        try:
            ckpt = distributed.on_main(lambda: self._open_folder(resume, overwrite, extend))
            if ckpt is None and tc.init_from:
                self.initialized_from = load_initial_weights(self.model, tc.init_from, self.device)
            # DDP wrapper or the FSDP2-sharded model itself (None in one process); optimizers after sharding
            self.parallel: nn.Module | None = None
            if self.world > 1:
                self.parallel = distributed.parallelize(self.model, tc.parallel, self.device)
            self.forward_model: nn.Module = self.model if self.parallel is None else self.parallel
            # the loss is compiled apart from the model: its cross-entropy over (B, L, vocab) fp32 logits is
            # several full passes in eager mode (14 of 165 ms of a 124M step on an H100, benchmarks/results)
            self.loss_fn = self.model.loss
            if tc.compile:
                self.forward_model = torch.compile(self.forward_model)
                self.loss_fn = torch.compile(self.model.loss)
            self.optimizers = build_optimizers(self.model, tc)
            b = tc.bema
            self.bema = (BEMA(self.model, kappa=b.kappa, eta=b.eta, rho=b.rho, gamma=b.gamma, tau=b.tau,
                              update_every=b.update_every) if b.enabled else None)
            if ckpt is not None:
                if not self.is_main:
                    self._read_checkpoint(ckpt, extend)
                self._restore(ckpt)
            elif overwrite:     # only now: a config error found above (weights to start from, optimizer keys) keeps it
                distributed.on_main(lambda: run_folder.clear(self.run_dir))
        except BaseException:
            self.close(failed=True)
            raise
        self.start_step = self.step     # the resumed checkpoint's step, else 0
        if ckpt is None and self.bema is not None:
            self.bema.update(0)

    def close(self, failed: bool = False) -> None:
        """Release the run folder's lock (``failed``: removing the folder if it created it and wrote nothing), and
        the DDP wrapper: destroyed after the process group (by whoever still held the trainer), its gloo reducer
        could deadlock the process at exit."""
        if self.folder is not None:
            self.folder.release(failed)
        if getattr(self, "parallel", None) is not None:
            self.parallel, self.forward_model = None, self.model

    # -- the run folder and checkpoints --------------------------------------------------------------
    def _open_folder(self, resume: bool, overwrite: bool, extend: bool) -> Path | None:
        """Rank 0: lock the folder and apply `run_folder`'s rules. A new run needs an empty folder (or
        ``overwrite``); a resumed one loads the newest readable checkpoint (else starts at step 0, if the folder's
        ``config.json`` agrees) and cuts ``metrics.jsonl`` back to its step. Returns the checkpoint or None."""
        self.folder = run_folder.lock(self.run_dir)
        if not resume:       # with overwrite, emptied once the run is built (`__init__`)
            run_folder.check_fresh(self.run_dir, overwrite=overwrite, keep=self.config.train.init_from, delete=False)
            return None
        run_folder.check_kind(self.run_dir, "training run")
        try:
            ckpt, step = run_folder.load_newest(self.run_dir, lambda c: self._read_checkpoint(c, extend),
                                                set_aside=True)
        except FileNotFoundError:       # no checkpoint yet: step 0, if the folder's config.json agrees
            ckpt, step, saved = None, 0, run_folder.saved_run_config(self.run_dir)
            if saved is not None:
                check_resume(saved, self.config, self.run_dir / "config.json", step=0, extend=extend)
        run_folder.cut_metrics(self.run_dir, step)
        return ckpt

    def _read_checkpoint(self, ckpt: Path, extend: bool) -> int:
        """Read checkpoint ``ckpt`` (full weights into a CPU model, optimizer and BEMA states) once `check_resume`
        accepts its config; returns its step. `_restore` puts it into the run."""
        state = ckpt_io.read_state(ckpt)
        where = ckpt / "state.json"
        trained_on, now = state.get("data_digest"), self.source.digest()
        same = trained_on is not None and trained_on == now and state.get("eval_digest") == self._eval_digest()
        self.extended = check_resume(ckpt_io.saved_config(state["config"], where), self.config, where,
                                     step=state["step"], extend=extend, same_data=same)
        if trained_on is not None and trained_on != now:
            raise ConfigError(f"cannot resume {ckpt}: its training data differ from the data here "
                              f"({ckpt_io.data_change(trained_on, now)}); resume with the data it trained on, or start "
                              "over with --overwrite or another --out", "data")
        with torch.random.fork_rng(devices=[]):      # building the copy must not move the run's RNG
            full = GPT(self.config.model)
        ckpt_io.load_weights(full, ckpt)
        pending = state["step"] % self.config.train.adam_every != 0
        self._read = (state, full.state_dict(), ckpt_io.read_optimizers(ckpt),
                      ckpt_io.load_bema_tensors(ckpt, state.get("bema")),
                      ckpt_io.load_pending_grads(ckpt, pending, full))
        return state["step"]

    def _restore(self, ckpt: Path) -> None:
        """Every rank: the checkpoint read by `_read_checkpoint` becomes the run's weights (sharded with FSDP2),
        optimizer and BEMA states, step, history and RNG state."""
        state, weights, optimizer_states, bema_tensors, pending_grads = self._read
        self._read = None
        note = world_change_note(self.config, state.get("world"), self.world)
        if note is not None and self.is_main and state["step"] < self.config.train.steps:    # steps left to train
            warnings.warn(note, ConfigWarning, stacklevel=2)
        if distributed.is_sharded(self.model):
            distributed.load_full(self.model, self.optimizers, weights, optimizer_states)
        else:
            self.model.load_state_dict(weights)
            for opt, opt_state in zip(self.optimizers, optimizer_states, strict=True):
                opt.load_state_dict(opt_state)
        params = dict(self.model.named_parameters())
        for name, grad in (pending_grads or {}).items():      # AdamW's, summed since its last step
            params[name].grad = distributed.shard_like(params[name], grad.to(self.device))
        if self.bema is not None:     # no tensors: BEMA had not started (step < tau)
            self.bema.load({k: v.to(self.device) for k, v in (bema_tensors or {}).items()},
                           state.get("bema", {"step": state["step"]}))
        self.step = state["step"]
        self.history = list(state["history"])
        self.tokens = state.get("tokens", 0)
        self.train_seconds = state.get("train_seconds")        # absent in checkpoints written before it was kept
        evaluated_at, self.metrics = run_folder.last_evaluation(self.run_dir, self.step)
        self._unlogged_eval = self._evaluates_at(self.step) and evaluated_at != self.step
        self.last_checkpoint, self._saved_step = ckpt, self.step
        ckpt_io.set_rng_state(state["rng"])

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint (every rank calls it: FSDP2 gathers the full state on rank 0, which writes it;
        the others wait until it is on disk and return None)."""
        model, optimizer_states = self.model, None
        self.train_seconds = self.seconds_trained()
        pending_grads = self._pending_grads()
        if distributed.is_sharded(self.model):
            model, optimizer_states = distributed.gather_full(self.model, self.optimizers,
                                                              lambda: GPT(self.config.model))
        if self.is_main:
            if optimizer_states is None:
                optimizer_states = [o.state_dict() for o in self.optimizers]
            self.last_checkpoint = self._write_checkpoint(model, optimizer_states, pending_grads)
        self._saved_step = self.step
        distributed.barrier()           # no rank goes on (and perhaps resumes) before the checkpoint is complete
        return self.last_checkpoint if self.is_main else None

    def _write_checkpoint(self, model: nn.Module, optimizer_states: list[dict[str, Any]],
                          pending_grads: dict[str, torch.Tensor] | None) -> Path:
        state = {
            "config": self.config.to_dict(),
            "rng": ckpt_io.rng_state(),
            "data_rng": {"scheme": "torch.Generator seeded per step with SeedSequence([seed, 0, step])",
                         "seed": self.config.train.seed, "next_step": self.step},
            "history": self.history,
            "tokens": self.tokens,
            "world": self.world,
            "train_seconds": self.train_seconds,
            "data_digest": self.source.digest(),
            "eval_digest": self._eval_digest(),
            "tokenizer": getattr(getattr(self.source, "tokenizer", None), "cache_key", None),   # text: its id mapping
        }
        bema_tensors = None
        if self.bema is not None:
            state["bema"] = self.bema.meta()
            bema_tensors = self.bema.tensors() or None
        return ckpt_io.save_checkpoint(self.run_dir, self.step, model, optimizer_states, state, bema_tensors,
                                       keep=self.config.train.keep_checkpoints, pending_grads=pending_grads)

    def _pending_grads(self) -> dict[str, torch.Tensor] | None:
        """Collective under FSDP2 (whole tensors): AdamW's parameters' gradients summed since its last step, by
        name, when the run stands between two AdamW steps (``train.adam_every``), else None."""
        if self.step % self.config.train.adam_every == 0:
            return None
        waiting = self._waiting(self.step - 1)
        return {name: distributed.full_tensor(p.grad).detach() for name, p in self.model.named_parameters()
                if id(p) in waiting and p.grad is not None}

    def seconds_trained(self) -> float | None:
        """Seconds in the training loop (steps, periodic evaluations, checkpoints) over every session of this run up
        to now; None when the checkpoint it resumed from predates the record. Saved in each checkpoint."""
        if self._session is None or self._session[1] is None:
            return self.train_seconds
        start, before = self._session
        return before + time.perf_counter() - start

    # -- BEMA ----------------------------------------------------------------------------------------
    def bema_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with BEMA weights (ValueError when BEMA is off)."""
        if self.bema is None:
            raise ValueError("BEMA is off for this run (train.bema.enabled = false)")
        return self.bema.state_dict_for_model()

    @contextlib.contextmanager
    def use_bema(self) -> Iterator[GPT]:
        """``with trainer.use_bema() as model:`` evaluates with BEMA weights; the live weights come back after."""
        if self.bema is None:
            raise ValueError("BEMA is off for this run (train.bema.enabled = false)")
        with self.bema.swapped() as model:
            yield model

    # -- evaluation ----------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _eval_digest(self) -> str | None:
        """The token digest of what the run is evaluated on (text: `LongDocuments.digest`; tasks: None)."""
        digest = getattr(self.eval_source, "digest", None)
        return digest() if digest is not None else None

    @functools.cached_property
    def eval_source(self) -> Any:
        """What the run is evaluated on (`lengthgen.eval.eval_source`: long documents for text)."""
        return eval_source(self.config.data, self.source)

    def evaluate(self, lengths: list[int] | None = None, *, diagnostics: bool = False) -> RunEval:
        """`lengthgen.eval.evaluate` of the model under the training device and autocast, seeded with
        ``train.seed``, at ``lengths`` (default ``train.eval_lengths``, else ``data.length``):
        ``eval_batches * eval_batch_size`` sequences of the training length's tokens per length, at most
        ``eval_batch_size`` of them per forward pass."""
        cfg, tc = self.config, self.config.train
        result = evaluate(self.model, self.eval_source, lengths or tc.eval_lengths or [cfg.data.length],
                          tokens_per_length=self._eval_tokens(), seed=tc.seed, autocast=self.autocast_dtype,
                          forward_tokens=tc.eval_batch_size * max(cfg.lengths()), diagnostics=diagnostics)
        return dataclasses.replace(result, config=cfg.to_dict(), seed=tc.seed, run_dir=str(self.run_dir),
                                   final_train_loss=self.history[-1] if self.history else None)

    def _evaluations(self) -> tuple[RunEval, RunEval | None]:
        """`evaluate` with the live weights and, once BEMA has started, with the BEMA weights (else None). Under
        DDP rank 0 alone evaluates and hands the results to the other ranks (`distributed.on_main`): every rank
        holds the whole model; FSDP2's forward is collective, so there every rank evaluates."""
        if distributed.is_sharded(self.model):
            return self._evaluate_both()
        return distributed.on_main(self._evaluate_both)

    def _evaluate_both(self) -> tuple[RunEval, RunEval | None]:
        live = self.evaluate()
        if self.bema is None or not self.bema.started:
            return live, None
        with self.use_bema():
            return live, dataclasses.replace(self.evaluate(), bema=True)

    def _evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates (and logs it) after ``step``: every ``train.eval_every`` steps and the last."""
        tc = self.config.train
        return bool(tc.eval_batches) and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps)

    def _evaluate_step(self, log: RunLog) -> tuple[RunEval, RunEval | None] | None:
        """Evaluate at the current step and log it; returns the evaluations at ``train.steps`` (for eval.json),
        else None."""
        evaluations = self._evaluations()
        self.metrics = self._log_entry(*evaluations)
        log.evaluation(self.step, self.metrics)
        return evaluations if self.step == self.config.train.steps else None

    @staticmethod
    def _log_entry(live: RunEval, bema: RunEval | None) -> dict[str, Any]:
        """The log entry of an evaluation: mean loss and metrics per length (``eval``; ``bema_eval``)."""
        means = lambda result: {str(r.length): r.mean for r in result.lengths}  # noqa: E731
        return {"eval": means(live), **({"bema_eval": means(bema)} if bema is not None else {})}

    def _final_eval(self, evaluations: tuple[RunEval, RunEval | None] | None = None) -> None:
        """At the end of training, when eval lengths go beyond the training length: eval.json and eval_bema.json,
        from ``evaluations`` (the last step's periodic ones, the same batches and weights) or evaluated now
        (`_evaluations`; rank 0 writes)."""
        cfg, tc = self.config, self.config.train
        if not (tc.eval_batches and tc.eval_lengths and max(tc.eval_lengths) > max(cfg.lengths())):
            return
        self.evaluation, bema = evaluations or self._evaluations()
        if self.is_main:
            self.evaluation.save(self.run_dir / "eval.json")
            if bema is not None:
                bema.save(self.run_dir / "eval_bema.json")

    def _eval_tokens(self) -> int:
        """Tokens per evaluated length: ``eval_batches * eval_batch_size`` sequences of the training length."""
        tc = self.config.train
        return max(1, tc.eval_batches) * tc.eval_batch_size * max(self.config.lengths())

    def _evaluated(self) -> bool:
        """Whether the folder holds the final evaluation that this config asks for: eval.json, and eval_bema.json
        once BEMA has started, each of the same ``train.eval_lengths``, ``eval_batches`` and ``eval_batch_size``,
        evaluated at those lengths with as many sequences per length. A finished run resumed with other eval
        lengths, after a kill between the two files, or whose eval.json ``lengthgen eval --out`` replaced (other
        lengths or ``--tokens``), is evaluated again."""
        names = ["eval.json"] + (["eval_bema.json"] if self.bema is not None and self.bema.started else [])
        tc = self.config.train
        asked = json.loads(json.dumps({k: getattr(tc, k) for k in _EVAL_KEYS}))
        try:
            stored = [RunEval.load(self.run_dir / name) for name in names]
        except (FileNotFoundError, ResultsError):
            return False
        tokens = self._eval_tokens()
        return all({k: run.config.get("train", {}).get(k) for k in _EVAL_KEYS} == asked
                   and [row.length for row in run.lengths] == sorted(set(tc.eval_lengths))
                   and all(row.batch_size == sequences(tokens, row.length) for row in run.lengths) for run in stored)

    # -- the loop ------------------------------------------------------------------------------------
    def _stepping(self, step: int) -> list[torch.optim.Optimizer]:
        """The optimizers that step at ``step``: Muon every step, AdamW where (step + 1) % ``train.adam_every`` == 0
        (seed 000's DistAdam, `odd_step_only`: steps 1, 3, 5, ...)."""
        every = self.config.train.adam_every
        return [opt for opt in self.optimizers if isinstance(opt, torch.optim.Muon) or (step + 1) % every == 0]

    def _waiting(self, step: int) -> set[int]:
        """The ids of the parameters whose optimizer does not step at ``step``: their gradients are kept and summed
        with the next steps' (seed 000 zeroes only Muon's gradients on those steps)."""
        stepping = self._stepping(step)
        return {id(p) for opt in self.optimizers if opt not in stepping for group in opt.param_groups
                for p in group["params"]}

    def _forward_backward(self, parts: list[tuple[Batch, float]], step: int
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Accumulate the gradient of step ``step``'s mean loss over its micro-batches ``parts`` (on the device), each
        with its weight in that mean (`_micro_batches`), onto zeroed gradients but those of the optimizers that did
        not step at ``step - 1`` (`_waiting`); DDP / FSDP2 synchronize once, in the last one's backward (the
        summed gradients of AdamW's parameters, already synchronized, plus the step's: synchronized sums).
        Returns the loss, averaged over ranks, on the device (read after the optimizer step: reading it waits for
        the GPU), and with QK-clip each layer's max logits over every micro-batch (as one full-batch forward would
        see them)."""
        tc = self.config.train
        self.model.train()
        for opt in self._stepping(step - 1):
            opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        maxima = None
        for i, (micro, weight) in enumerate(parts):
            last = i == len(parts) - 1
            if tc.qk_clip is not None:
                capture_logits(self.model.attentions)
            with distributed.gradient_sync(self.parallel, enabled=last):
                with self._autocast():
                    output = self.forward_model(micro.tokens, micro.doc_ids)
                if tc.qk_clip is not None:
                    maxima = captured_max_logits(self.model.attentions, maxima)
                loss, _ = self.loss_fn(output, micro)
                (loss * weight).backward()
            total += loss.detach() * weight
        if distributed.is_sharded(self.model):
            distributed.sync_replicated(self.model)
        return distributed.all_reduce_mean(total), maxima

    def _micro_batches(self, batch: Batch) -> list[tuple[Batch, float]]:
        """This rank's ``grad_accum`` micro-batches of the sampled global ``batch``, moved to the device, each with
        its weight in the batch's mean loss: its share of the counted positions (`split_batch`, counted on the host:
        no wait for the device), times the world size under DDP / FSDP2, which average the ranks' gradients. Each
        rank takes a contiguous share of the rows (equal shares, see check_world)."""
        scale = 1.0
        if self.world > 1:
            batch, share = split_batch(batch, self.world)[self.rank]
            scale = share * self.world
        parts = split_batch(batch, self.config.train.grad_accum)
        return [(micro.to(self.device), weight * scale) for micro, weight in parts]

    def _train_step(self, step: int) -> dict[str, Any]:
        """One optimizer update; returns its log entry (without the step and throughput)."""
        cfg, tc = self.config, self.config.train
        length, batch_size = cfg.length_at(step), cfg.batch_size_at(step)
        parts = self._micro_batches(self.source.sample(batch_size, length, step_generator(tc.seed, step)))
        restart = cfg.stage_start(step) if tc.restart_at_stages else 0
        if restart and step == restart:   # seed 001: every stage re-creates its optimizer
            self.optimizers = build_optimizers(self.model, tc)
        multiplier = lr_multiplier(step, total=tc.steps, schedule=tc.schedule, warmup=tc.warmup_steps,
                                   cooldown_frac=tc.cooldown_frac, min_ratio=tc.min_lr_ratio, restart=restart)
        set_lr(self.optimizers, multiplier)
        set_muon_momentum(self.optimizers, momentum_at(step, total=tc.steps, peak=tc.muon_momentum,
                                                       low=tc.muon_momentum_min, warmup=tc.muon_momentum_warmup,
                                                       cooldown=tc.muon_momentum_cooldown))
        loss, max_logits = self._forward_backward(parts, step)
        entry: dict[str, Any] = {}
        grad_norm = None
        if tc.grad_clip > 0:        # the gradients stepped on now: not AdamW's summed ones between its steps
            waiting = self._waiting(step)
            params = [p for p in self.model.parameters() if p.grad is not None and id(p) not in waiting]
            if params:              # none: adamw alone, between its steps
                grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        for opt in self._stepping(step):
            opt.step()
        # read after the step, whose kernels are queued by then (reading waits for the GPU); a non-finite loss or
        # gradient has spoiled only the weights in memory, never a checkpoint
        loss = float(loss)
        where = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
            "; no checkpoint was written yet"
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"training loss is {loss} at step {step}; stopping{where}")
        if grad_norm is not None:
            entry["grad_norm"] = float(grad_norm)
            if not math.isfinite(entry["grad_norm"]):
                raise NonFiniteLossError(f"gradient norm is {entry['grad_norm']} at step {step}; stopping{where}")
        if tc.qk_clip is not None:
            entry["max_logit"] = clip_logits(self.model.attentions, max_logits, tc.qk_clip, distributed.all_reduce_max)
        self.step = step + 1
        if self.bema is not None:
            self.bema.update(self.step)
        self.history.append(loss)
        self.tokens += batch_size * length
        entry.update(loss=loss, lr_mult=multiplier, length=length, batch_size=batch_size)
        if self.world > 1:
            entry["rank_batch_size"] = sum(int(micro.tokens.shape[0]) for micro, _ in parts)
        return entry

    def _open_log(self, end: int) -> RunLog:
        """This session's log; on rank 0, when there are steps to train until ``end``, it adds the start to
        ``run.json``, prints the header and opens TensorBoard (and W&B). A finished run reused as it is logs
        nothing."""
        cfg = self.config
        active = self.is_main and (self.step < end or self._unlogged_eval)
        log = RunLog(self.run_dir, total=cfg.train.steps, start=self.step, lr=cfg.train.lr, enabled=active,
                     progress=self.progress, name=self.name)
        if active:
            provenance = Provenance.capture(self.device)
            parameters = sum(p.numel() for p in self.model.parameters())
            info = record_start(self.run_dir, self.step, parameters, provenance)
            dtype = f"{self.autocast_dtype} autocast".replace("torch.", "") if self.autocast_dtype else "float32"
            header = run_header(cfg, self.run_dir, parameters=parameters, dtype=dtype, world=self.world,
                                start=self.step, provenance=provenance, data_size=text_size(cfg, self.source))
            log.start(header, Trackers(self.run_dir, cfg, self.step, header, info))
        return log

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train until ``train.steps`` (or until ``stop_at`` steps, then checkpoint as if interrupted); a
        ``stop_at`` that is not an integer >= 0 is a `ConfigError` naming it, before the folder is written."""
        stop_at = check_value("stop_at", stop_at, int | None, ge=0)
        cfg, tc = self.config, self.config.train
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        end = tc.steps if stop_at is None else min(tc.steps, stop_at)
        log = self._open_log(end)
        last: tuple[RunEval, RunEval | None] | None = None     # the evaluations at train.steps, for eval.json
        if self.extended:
            log.record(self.extended)
            self.extended = None
        start_time, start_tokens = time.perf_counter(), self.tokens
        self._session = (start_time, self.train_seconds)
        saved_precision = torch.get_float32_matmul_precision()
        if self.device.type == "cuda":   # TF32 for float32 matmuls while training; the caller's setting after
            torch.set_float32_matmul_precision("high")
        ran = self.step < end
        try:
            with run_threads(tc):          # train.threads, the caller's after
                if self._unlogged_eval:     # killed between its step's checkpoint and evaluation: evaluate it now
                    self._unlogged_eval = False
                    last = self._evaluate_step(log)
                while self.step < end:
                    entry = self._train_step(self.step)
                    step, elapsed = self.step, time.perf_counter() - start_time
                    tokens_per_s = (self.tokens - start_tokens) / max(elapsed, 1e-9)
                    entry.update(step=step, tokens=self.tokens, tokens_per_s=tokens_per_s, time=elapsed)
                    log.step(entry, tc.log_every, end)
                    # the checkpoint first: an evaluation that fails or is interrupted (Ctrl-C, out of memory at a long
                    # length) loses no step
                    if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == end:
                        self.save_checkpoint()
                    if self._evaluates_at(step):
                        last = self._evaluate_step(log)
                if self._saved_step != self.step:
                    self.save_checkpoint()
                if self.step >= tc.steps and (ran or not self._evaluated()):
                    self._final_eval(last)
        finally:
            self._session = None        # train_seconds stays as of the last checkpoint, which ends the loop
            torch.set_float32_matmul_precision(saved_precision)
            log.close()
        self.model.eval()
        return TrainResult(self.model, self.run_dir, self.step, list(self.history), cfg, self.metrics,
                           self.last_checkpoint, self, self.evaluation)


def train(config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
          resume: bool = False, overwrite: bool = False, extend: bool = False, stop_at: int | None = None,
          name: str | None = None) -> TrainResult:
    """Train a run described by ``config`` (a `RunConfig`, its dict, or a TOML path) into ``out_dir``.

    ``out_dir`` must be empty unless ``overwrite`` (delete the run there first) or ``resume``: continue from the
    folder's newest readable checkpoint (from step 0 if there is none), refused if the config changes the
    training trajectory; ``extend`` lets it change ``train.steps`` (recorded in ``metrics.jsonl``).
    ``progress``: a progress bar when stdout is a terminal, else (and with ``progress=False``) a plain line
    every ``train.log_every`` steps, each starting with ``[name]`` (default: the folder's name).
    ``stop_at`` ends after that many steps with a checkpoint, as if interrupted (the schedule still
    spans ``train.steps``). Raises `ConfigError` before training for a bad config, `RunFolderError` for a folder
    in use or holding another run, and `NonFiniteLossError` (naming the step and the last good checkpoint) when
    the loss turns NaN or infinite.
    """
    trainer = Trainer(config, out_dir, progress=progress, resume=resume, overwrite=overwrite, extend=extend,
                      name=name)
    try:
        return trainer.fit(stop_at=stop_at)
    finally:
        trainer.close()
