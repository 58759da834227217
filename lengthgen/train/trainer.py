"""The training loop: `train(config, out_dir)` and `Trainer`.

One step (`Trainer._train_step`): draw the step's batch from a generator seeded with (seed, step) at the staged
length (``batch = tokens_per_step // length``), forward/backward it in ``grad_accum`` micro-batches under the
run's autocast, stop on a non-finite loss, clip the gradient norm, set the scheduled learning rate, step AdamW
(and Muon), apply QK-clip, update BEMA; `fit` then logs, evaluates and checkpoints. On CPU a resumed run
reproduces the losses of an uninterrupted run exactly.

`Trainer.evaluate` is `lengthgen.eval.evaluate` under the training device and autocast: every
``train.eval_every`` steps and at the end it logs the mean loss and metrics at each eval length; when
``train.eval_lengths`` go beyond the training length, the end also writes the by-position evaluation to
``eval.json`` (``eval_bema.json`` with BEMA weights), a `lengthgen.eval.RunEval`.

Beside the loop: `setup` (config, lengths, device, dtype), `weights` (``train.init_from``, `load_run`),
`checkpoint`, `log` (``metrics.jsonl``), `optim` (optimizers, QK-clip). Under ``torchrun`` the model is wrapped
in DDP and each rank trains on its contiguous share of the global batch (`distributed`); only rank 0 logs,
checkpoints and writes ``eval.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.config import ConfigError
from lengthgen.data.config import make_source, step_generator
from lengthgen.eval import Provenance, RunEval, eval_source, evaluate
from lengthgen.model import GPT
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train import distributed
from lengthgen.train.bema import BEMA
from lengthgen.train.config import RunConfig, save_config
from lengthgen.train.data import split_batch
from lengthgen.train.log import RunLog, truncate_log
from lengthgen.train.optim import build_optimizers, clip_recorded_logits, record_logits, set_lr
from lengthgen.train.schedule import lr_multiplier
from lengthgen.train.setup import (as_config, autocast_dtype, check_lengths, check_world, config_difference,
                                   device_type, fill_model_from_source)
from lengthgen.train.tracking import Trackers, import_wandb, record_start, run_header
from lengthgen.train.weights import load_initial_weights


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN or infinite; the message names the step and the last checkpoint."""


@dataclass
class TrainResult:
    model: GPT                    # the trained model (final weights, eval mode)
    run_dir: Path
    step: int                     # optimizer updates done
    history: list[float]          # training loss of every step from 0 (including resumed-from steps)
    config: RunConfig             # the resolved config (model filled from the data source)
    metrics: dict[str, Any] = field(default_factory=dict)   # the last periodic evaluation's log entry
    checkpoint: Path | None = None
    trainer: "Trainer | None" = None
    evaluation: RunEval | None = None   # the final evaluation by position (eval.json), when it ran


class Trainer:
    """Holds the model, optimizers, BEMA and bookkeeping of one run. `train` is the usual entry point.

    Everything that can fail on the configuration (data source, task kwargs, lengths, model) fails in the
    constructor, before any step.
    """

    def __init__(self, config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
                 resume: bool = False) -> None:
        cfg = as_config(config)
        self.source = make_source(cfg.data)
        cfg = fill_model_from_source(cfg, self.source)
        check_lengths(cfg, self.source)
        self.config, tc = cfg, cfg.train
        self.run_dir = Path(out_dir)
        kind = device_type(tc)
        self.rank, self.world, local_rank = distributed.setup(kind)
        self.is_main = self.rank == 0
        self.progress = progress and self.is_main
        self.device = torch.device(f"cuda:{local_rank}" if kind == "cuda" and self.world > 1 else kind)
        if self.world > 1:
            check_world(cfg, self.world)
        self.autocast_dtype = autocast_dtype(tc, kind)
        if tc.wandb and self.is_main:
            import_wandb(tc.wandb)
        if kind == "cuda":
            torch.set_float32_matmul_precision("high")

        torch.manual_seed(tc.seed)
        self.model = GPT(cfg.model).to(self.device)
        self.initialized_from: dict[str, Any] | None = None
        existing = (self.run_dir / ckpt_io.LATEST).exists()
        if tc.init_from and not (resume and existing):
            self.initialized_from = load_initial_weights(self.model, tc.init_from, self.device)
        self.forward_model: nn.Module = self.model
        self.ddp: nn.Module | None = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = self.forward_model = DDP(self.model, device_ids=[self.device.index]
                                                if self.device.type == "cuda" else None)
        if tc.compile and self.device.type == "cuda":
            self.forward_model = torch.compile(self.forward_model)
        self.optimizers = build_optimizers(self.model, tc)
        b = tc.bema
        self.bema = (BEMA(self.model, kappa=b.kappa, eta=b.eta, rho=b.rho, gamma=b.gamma, tau=b.tau)
                     if b.enabled else None)
        self.step, self.tokens = 0, 0
        self.history: list[float] = []
        self.metrics: dict[str, Any] = {}
        self.last_checkpoint: Path | None = None
        self._saved_step: int | None = None
        self.evaluation: RunEval | None = None

        if resume and existing:
            self._resume()
        elif existing:
            raise FileExistsError(f"{self.run_dir} already holds a run (latest.json); resume it or use "
                                  "another output folder")
        elif self.bema is not None:
            self.bema.update(0)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _resume(self) -> None:
        ckpt = ckpt_io.find_checkpoint(self.run_dir)
        state = ckpt_io.read_state(ckpt)
        now = self.config.to_dict()
        for section in ("model", "data"):
            difference = config_difference(state["config"][section], now[section], section)
            if difference:
                raise ConfigError(f"cannot resume {self.run_dir}: the config differs from the checkpoint's "
                                  f"({difference})")
        ckpt_io.load_weights(self.model, ckpt, self.device)
        ckpt_io.load_optimizers(self.optimizers, ckpt, self.device)
        if self.bema is not None:
            tensors = ckpt_io.load_bema_tensors(ckpt, self.device)  # None: BEMA had not started (step < tau)
            self.bema.load(tensors or {}, state.get("bema", {"step": state["step"]}))
        self.step = state["step"]
        self.history = list(state["history"])
        self.tokens = state.get("tokens", 0)
        self.metrics = state.get("metrics", {})
        self.last_checkpoint, self._saved_step = ckpt, self.step
        ckpt_io.set_rng_state(state["rng"])
        if self.is_main:
            truncate_log(self.run_dir, self.step)

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint (rank 0 only; other ranks return None)."""
        if not self.is_main:
            self._saved_step = self.step
            return None
        state = {
            "config": self.config.to_dict(),
            "rng": ckpt_io.rng_state(),
            "data_rng": {"scheme": "torch.Generator seeded per step with SeedSequence([seed, 0, step])",
                         "seed": self.config.train.seed, "next_step": self.step},
            "history": self.history,
            "tokens": self.tokens,
            "metrics": self.metrics,
        }
        bema_tensors = None
        if self.bema is not None:
            state["bema"] = self.bema.meta()
            bema_tensors = self.bema.tensors() or None
        self.last_checkpoint = ckpt_io.save_checkpoint(self.run_dir, self.step, self.model, self.optimizers, state,
                                                       bema_tensors, keep=self.config.train.keep_checkpoints)
        self._saved_step = self.step
        return self.last_checkpoint

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
        train_tokens = tc.eval_batch_size * max(cfg.lengths())
        result = evaluate(self.model, self.eval_source, lengths or tc.eval_lengths or [cfg.data.length],
                          tokens_per_length=max(1, tc.eval_batches) * train_tokens, seed=tc.seed,
                          autocast=self.autocast_dtype, forward_tokens=train_tokens, diagnostics=diagnostics)
        return dataclasses.replace(result, config=cfg.to_dict(), seed=tc.seed, run_dir=str(self.run_dir),
                                   final_train_loss=self.history[-1] if self.history else None)

    def _periodic_eval(self) -> dict[str, Any]:
        """The log entry of an evaluation: mean loss and metrics per length (``eval``; ``bema_eval``)."""
        if self.config.train.eval_batches == 0:
            return {}
        means = lambda result: {str(r.length): r.mean for r in result.lengths}  # noqa: E731
        entry: dict[str, Any] = {"eval": means(self.evaluate())}
        if self.bema is not None and self.bema.started:
            with self.use_bema():
                entry["bema_eval"] = means(self.evaluate())
        return entry

    def _final_eval(self) -> None:
        """At the end of training (rank 0), when eval lengths go beyond the training length: eval.json."""
        cfg, tc = self.config, self.config.train
        if not (self.is_main and tc.eval_batches and tc.eval_lengths
                and max(tc.eval_lengths) > max(cfg.lengths())):
            return
        self.evaluation = self.evaluate()
        self.evaluation.save(self.run_dir / "eval.json")
        if self.bema is not None and self.bema.started:
            with self.use_bema():
                dataclasses.replace(self.evaluate(), bema=True).save(self.run_dir / "eval_bema.json")

    # -- the loop ------------------------------------------------------------------------------------
    def _forward_backward(self, batch) -> float:
        """Accumulate the gradient of the batch's mean loss over ``grad_accum`` micro-batches (DDP all-reduces
        once, in the last one's backward; QK-clip records the last one's logits). Returns the loss, averaged
        over ranks."""
        tc = self.config.train
        self.model.train()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        parts = split_batch(batch, tc.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, (micro, weight) in enumerate(parts):
            last = i == len(parts) - 1
            if last and tc.qk_clip is not None:
                record_logits(self.model.attentions)
            with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                with self._autocast():
                    output = self.forward_model(micro.tokens, micro.doc_ids)
                loss, _ = self.model.loss(output, micro)
                (loss * weight).backward()
            total += loss.detach() * weight
        return float(distributed.all_reduce_mean(total))

    def _train_step(self, step: int) -> dict[str, Any]:
        """One optimizer update; returns its log entry (without the step and throughput)."""
        cfg, tc = self.config, self.config.train
        length, batch_size = cfg.length_at(step), cfg.batch_size_at(step)
        batch = self.source.sample(batch_size, length, step_generator(tc.seed, step))
        if self.world > 1:  # this rank's contiguous share of the global batch (equal shares, see check_world)
            batch = split_batch(batch, self.world)[self.rank][0]
        batch = batch.to(self.device)
        multiplier = lr_multiplier(step, total=tc.steps, schedule=tc.schedule, warmup=tc.warmup_steps,
                                   cooldown_frac=tc.cooldown_frac, min_ratio=tc.min_lr_ratio)
        set_lr(self.optimizers, multiplier)
        loss = self._forward_backward(batch)
        where = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
            "; no checkpoint was written yet"
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"training loss is {loss} at step {step}; stopping{where}")
        entry: dict[str, Any] = {}
        if tc.grad_clip > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            entry["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
            if not math.isfinite(entry["grad_norm"]):
                raise NonFiniteLossError(f"gradient norm is {entry['grad_norm']} at step {step}; stopping{where}")
        for opt in self.optimizers:
            opt.step()
        if tc.qk_clip is not None:
            entry["max_logit"] = clip_recorded_logits(self.model.attentions, tc.qk_clip, distributed.all_reduce_max)
        self.step = step + 1
        if self.bema is not None:
            self.bema.update(self.step)
        self.history.append(loss)
        self.tokens += batch_size * length
        entry.update(loss=loss, lr_mult=multiplier, length=length, batch_size=batch_size)
        if self.world > 1:
            entry["rank_batch_size"] = int(batch.tokens.shape[0])
        return entry

    def _open_log(self) -> RunLog:
        """This session's log; on rank 0 it adds the start to ``run.json``, prints the header and opens
        TensorBoard (and W&B)."""
        cfg = self.config
        log = RunLog(self.run_dir, total=cfg.train.steps, start=self.step, lr=cfg.train.lr, enabled=self.is_main,
                     progress=self.progress)
        if self.is_main:
            provenance = Provenance.capture(self.device)
            parameters = sum(p.numel() for p in self.model.parameters())
            info = record_start(self.run_dir, self.step, parameters, provenance)
            dtype = f"{self.autocast_dtype} autocast".replace("torch.", "") if self.autocast_dtype else "float32"
            header = run_header(cfg, self.run_dir, parameters=parameters, dtype=dtype, world=self.world,
                                start=self.step, provenance=provenance)
            log.start(header, Trackers(self.run_dir, cfg, self.step, header, info))
        return log

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train until ``train.steps`` (or until ``stop_at`` steps, then checkpoint as if interrupted)."""
        cfg, tc = self.config, self.config.train
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        end = tc.steps if stop_at is None else min(tc.steps, stop_at)
        log = self._open_log()
        start_time, start_tokens = time.perf_counter(), self.tokens
        saved_threads = torch.get_num_threads()
        if tc.threads:
            torch.set_num_threads(tc.threads)
        ran = self.step < end
        try:
            while self.step < end:
                entry = self._train_step(self.step)
                step, elapsed = self.step, time.perf_counter() - start_time
                tokens_per_s = (self.tokens - start_tokens) / max(elapsed, 1e-9)
                entry.update(step=step, tokens=self.tokens, tokens_per_s=tokens_per_s, time=elapsed)
                log.step(entry, tc.log_every, end)
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    self.metrics = self._periodic_eval()
                    log.evaluation(step, self.metrics)
                if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == end:
                    self.save_checkpoint()
            if self._saved_step != self.step:
                self.save_checkpoint()
            if self.step >= tc.steps and (ran or not (self.run_dir / "eval.json").exists()):
                self._final_eval()
        finally:
            torch.set_num_threads(saved_threads)
            log.close()
        self.model.eval()
        return TrainResult(self.model, self.run_dir, self.step, list(self.history), cfg, self.metrics,
                           self.last_checkpoint, self, self.evaluation)


def train(config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
          resume: bool = False, stop_at: int | None = None) -> TrainResult:
    """Train a run described by ``config`` (a `RunConfig`, its dict, or a TOML path) into ``out_dir``.

    ``progress``: a progress bar when stdout is a terminal, else (and with ``progress=False``) a plain line
    every ``train.log_every`` steps. ``resume=True`` continues from the folder's latest checkpoint (starting
    fresh if there is none).
    ``stop_at`` ends after that many steps with a checkpoint, as if interrupted (the schedule still
    spans ``train.steps``). Raises `ConfigError` before training for a bad config and `NonFiniteLossError`
    (naming the step and the last good checkpoint) when the loss turns NaN or infinite.
    """
    return Trainer(config, out_dir, progress=progress, resume=resume).fit(stop_at=stop_at)
