"""The training loop: `train(config, out_dir)`, `Trainer`, `load_run(path)`.

One step: draw the step's batch from a generator seeded with (seed, step) at the staged length
(``batch = tokens_per_step // length``), split it into ``grad_accum`` micro-batches, forward/backward under
bf16 autocast on CUDA (float32 on CPU), stop on a non-finite loss, clip the gradient norm, set the scheduled
learning rate, step AdamW (and Muon), apply QK-clip, update BEMA, log, evaluate and checkpoint.
On CPU a resumed run reproduces the losses of an uninterrupted run exactly.

When ``train.eval_lengths`` go beyond the training length, the end of training also evaluates loss (and
the task's metrics) by position at every eval length (`lengthgen.train.position_eval`: long documents for
text) and writes ``eval.json`` (and ``eval_bema.json`` with BEMA) in the run folder.

``train.init_from`` starts from another run's weights (fresh optimizer); parameters that the new config's
attention adds keep their initialization (see `load_initial_weights`).

Under ``torchrun`` (WORLD_SIZE > 1) the model is wrapped in DDP and each rank trains on its contiguous share
of the step's global batch (`lengthgen.train.distributed`); only rank 0 logs, checkpoints and evaluates by
position.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lengthgen.attention.module import is_spec_parameter
from lengthgen.config import ConfigError, RunConfig, load_config, save_config
from lengthgen.model import GPT
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train import distributed
from lengthgen.train.bema import BEMA
from lengthgen.train.data import make_source, split_batch, step_generator
from lengthgen.train.optim import attention_max_logits, build_optimizers, qk_clip_, set_lr
from lengthgen.train.schedule import lr_multiplier


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN or infinite; the message names the step and the last checkpoint."""


@dataclass
class TrainResult:
    model: GPT                    # the trained model (final weights, eval mode)
    run_dir: Path
    step: int                     # optimizer updates done
    history: list[float]          # training loss of every step from 0 (including resumed-from steps)
    config: RunConfig             # the resolved config (model filled from the data source)
    metrics: dict[str, Any] = field(default_factory=dict)   # the last evaluation
    checkpoint: Path | None = None
    trainer: "Trainer | None" = None
    by_position: list[dict] | None = None   # the final evaluation by position (eval.json), when it ran


def _as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return RunConfig.from_dict(config)
    return load_config(config)


def fill_model_from_source(cfg: RunConfig, source: Any) -> RunConfig:
    """Set model.vocab_size / head / num_classes from the data source (errors if they contradict it)."""
    model = cfg.model
    head = getattr(source, "head", "lm")
    name = getattr(source, "name", cfg.data.task)
    if model.head is not None and model.head != head:
        raise ConfigError(f"model.head={model.head!r} does not fit the data: {name!r} needs head {head!r}")
    vocab = source.vocab_size
    if model.vocab_size is not None:
        if model.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the data's vocabulary "
                              f"({vocab}); leave it unset to take it from the data")
        vocab = model.vocab_size
    changes: dict[str, Any] = {"head": head, "vocab_size": vocab}
    if head == "classify":
        classes = source.num_classes
        if model.num_classes not in (0, classes):
            raise ConfigError(f"model.num_classes={model.num_classes} does not fit {name!r} ({classes} classes)")
        changes["num_classes"] = classes
    try:
        return RunConfig(model.replace(**changes), cfg.train, cfg.data, cfg.name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_lengths(cfg: RunConfig, source: Any) -> None:
    """Every training and eval length must be one the data can generate (checked by sampling one sequence)."""
    max_length = getattr(source, "max_length", None)
    for key, lengths in (("data.length", [cfg.data.length]), ("train.stages", [s[1] for s in cfg.train.stages]),
                         ("train.eval_lengths", cfg.train.eval_lengths)):
        for length in lengths:
            if max_length is not None and length > max_length:
                raise ConfigError(f"{key}: length {length} exceeds the data's maximum length {max_length}")
            try:
                source.sample(1, length, torch.Generator().manual_seed(0))
            except ValueError as err:
                raise ConfigError(f"{key}: length {length}: {err}") from None


def _diff(a: Any, b: Any, prefix: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            d = _diff(a.get(key), b.get(key), f"{prefix}.{key}")
            if d:
                return d
        return None
    return None if a == b else f"{prefix}: checkpoint {a!r}, now {b!r}"


def _check_world(cfg: RunConfig, world: int) -> None:
    """Under DDP every step's global batch must split into ``world`` equal shares of >= grad_accum rows."""
    for step in sorted({0, *(s[0] for s in cfg.train.stages)}):
        batch = cfg.batch_size_at(step)
        if batch % world or batch // world < cfg.train.grad_accum:
            raise ConfigError(f"train: the batch of {batch} sequences at length {cfg.length_at(step)} does not "
                              f"split into {world} equal shares of at least train.grad_accum="
                              f"{cfg.train.grad_accum} sequences (WORLD_SIZE={world}); change "
                              "train.batch_size / train.tokens_per_step or train.grad_accum")


def _addable(name: str) -> bool:
    """A parameter an attention spec can add without changing the others (kept at its init)."""
    return name == "scaling_multiplier" or (".attn." in name and is_spec_parameter(name.rsplit(".attn.", 1)[1]))


def load_initial_weights(model: nn.Module, path: str | Path, device: str | torch.device = "cpu"
                         ) -> dict[str, Any]:
    """Load the weights of a run folder or checkpoint into ``model`` whose attention spec may add parameters.

    Parameters of attention layers that the checkpoint lacks (gates, out-norm affine, QK-norm weights,
    learnable scaling multipliers) keep their initialization, so e.g. a 2sigmoid gate starts as the identity.
    Anything else that differs (a missing non-attention parameter, an unexpected checkpoint tensor, a shape
    change) raises `ConfigError` listing all of it. Returns {"checkpoint", "added"}.
    """
    from safetensors.torch import load_file

    ckpt = ckpt_io.find_checkpoint(path)
    stored = load_file(str(Path(ckpt) / "model.safetensors"), device=str(device))
    own = model.state_dict()
    # tied tensors are stored once under one of their names: map every alias to the stored copy
    alias: dict[str, str] = {}
    by_storage: dict[tuple[int, int], list[str]] = {}
    for name, t in own.items():
        by_storage.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    groups: dict[str, list[str]] = {}
    for names in by_storage.values():
        hit = next((n for n in names if n in stored), None)
        for n in names:
            alias[n], groups[n] = (hit if hit is not None else n), names
    problems, added, load = [], [], {}
    for name, t in own.items():
        src = alias[name]
        if src in stored:
            if tuple(stored[src].shape) != tuple(t.shape):
                problems.append(f"{name}: checkpoint shape {tuple(stored[src].shape)}, model {tuple(t.shape)}")
            else:
                load[name] = stored[src]
        elif any(_addable(n) for n in groups[name]):
            added.append(name)
        else:
            problems.append(f"{name}: not in the checkpoint")
    used = {alias[n] for n in own}
    problems += [f"{name}: in the checkpoint, not in the model" for name in stored if name not in used]
    if problems:
        raise ConfigError(f"cannot initialize from {ckpt}: the new config changes more than added attention "
                          "parameters:\n  " + "\n  ".join(problems))
    missing, unexpected = model.load_state_dict(load, strict=False)
    assert not unexpected and set(missing) == set(added), (missing, unexpected)
    return {"checkpoint": str(ckpt), "added": added}


class Trainer:
    """Holds the model, optimizers, BEMA and bookkeeping of one run. `train` is the usual entry point.

    Everything that can fail on the configuration (data source, task kwargs, lengths, model) fails in the
    constructor, before any step.
    """

    def __init__(self, config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
                 resume: bool = False) -> None:
        cfg = _as_config(config)
        self.source = make_source(cfg.data)
        cfg = fill_model_from_source(cfg, self.source)
        _check_lengths(cfg, self.source)
        self.config, tc = cfg, cfg.train
        self.run_dir = Path(out_dir)
        device_type = ("cuda" if torch.cuda.is_available() else "cpu") if tc.device == "auto" else tc.device
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but CUDA is not available")
        self.rank, self.world, local_rank = distributed.setup(device_type)
        self.is_main = self.rank == 0
        self.progress = progress and self.is_main
        self.device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" and self.world > 1 else device_type)
        if self.world > 1:
            _check_world(cfg, self.world)
        if tc.dtype == "bfloat16" or (tc.dtype == "auto" and self.device.type == "cuda"):
            self.autocast_dtype: torch.dtype | None = torch.bfloat16
        else:
            self.autocast_dtype = None
        if self.device.type == "cuda":
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
        self.step = 0
        self.history: list[float] = []
        self.tokens = 0
        self.metrics: dict[str, Any] = {}
        self.last_checkpoint: Path | None = None
        self._saved_step: int | None = None
        self.by_position: list[dict] | None = None

        if resume and existing:
            self._resume()
        else:
            if existing:
                raise FileExistsError(f"{self.run_dir} already holds a run (latest.json); resume it or use "
                                      "another output folder")
            if self.bema is not None:
                self.bema.update(0)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _resume(self) -> None:
        ckpt = ckpt_io.find_checkpoint(self.run_dir)
        state = ckpt_io.read_state(ckpt)
        saved = state["config"]
        now = self.config.to_dict()
        for section in ("model", "data"):
            d = _diff(saved[section], now[section], section)
            if d:
                raise ConfigError(f"cannot resume {self.run_dir}: the config differs from the checkpoint's ({d})")
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
        self._truncate_metrics(self.step)

    def _truncate_metrics(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not self.is_main or not path.exists():
            return
        keep = [line for line in path.read_text().splitlines() if line.strip()
                and json.loads(line).get("step", 0) <= step]
        ckpt_io.atomic_write_text(path, "".join(line + "\n" for line in keep))

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
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def evaluate(self, lengths: list[int] | None = None) -> dict[str, dict[str, float]]:
        """Mean loss and task metrics on fixed eval batches (seeded per length) at each length. Beyond the
        training length the batches keep the tokens of ``eval_batch_size`` sequences at the training length
        (at least one sequence)."""
        tc = self.config.train
        lengths = lengths or tc.eval_lengths or [self.config.data.length]
        train_length = max(self.config.lengths())
        was_training = self.model.training
        self.model.eval()
        out: dict[str, dict[str, float]] = {}
        try:
            for length in lengths:
                gen = step_generator(tc.seed, length, stream=1)
                sums: dict[str, float] = {}
                rows = tc.eval_batch_size if length <= train_length else \
                    max(1, tc.eval_batch_size * train_length // length)
                for _ in range(tc.eval_batches):
                    batch = self.source.sample(rows, length, gen).to(self.device)
                    with self._autocast():
                        output = self.model(batch.tokens, batch.doc_ids)
                    loss, _ = self.model.loss(output, batch)
                    values = {"loss": float(loss)}
                    if hasattr(self.source, "metrics"):
                        for name, t in self.source.metrics(output.float(), batch).items():
                            values[name] = float(torch.nanmean(t.float()))
                    for name, v in values.items():
                        sums[name] = sums.get(name, 0.0) + v
                out[str(length)] = {k: v / max(1, tc.eval_batches) for k, v in sums.items()}
        finally:
            self.model.train(was_training)
        return out

    def evaluate_by_position(self, lengths: list[int] | None = None, *, diagnostics: bool = False
                             ) -> list[dict]:
        """Loss and metrics by position at ``lengths`` (default train.eval_lengths), see
        `lengthgen.train.position_eval`; ``eval_batches * eval_batch_size`` sequences of the training length's
        tokens per length."""
        from lengthgen.train.position_eval import evaluate_by_position, position_eval_source

        cfg, tc = self.config, self.config.train
        lengths = lengths or tc.eval_lengths or [cfg.data.length]
        tokens = max(1, tc.eval_batches) * tc.eval_batch_size * max(cfg.lengths())
        task = position_eval_source(cfg.data, self.source)
        was_training = self.model.training
        try:
            return evaluate_by_position(self.model, task, lengths, tokens_per_length=tokens, seed=tc.seed,
                                        device=self.device, autocast=self._autocast, diagnostics=diagnostics)
        finally:
            self.model.train(was_training)

    def _final_position_eval(self) -> None:
        """At the end of training (rank 0), when eval lengths go beyond the training length: eval.json."""
        cfg, tc = self.config, self.config.train
        if not (self.is_main and tc.eval_batches and tc.eval_lengths
                and max(tc.eval_lengths) > max(cfg.lengths())):
            return
        self.by_position = self.evaluate_by_position()
        ckpt_io.atomic_write_text(self.run_dir / "eval.json", json.dumps(self.by_position, indent=1))
        if self.bema is not None and self.bema.started:
            with self.use_bema():
                rows = self.evaluate_by_position()
            ckpt_io.atomic_write_text(self.run_dir / "eval_bema.json", json.dumps(rows, indent=1))

    def _evaluate_all(self) -> dict[str, Any]:
        if self.config.train.eval_batches == 0:
            return {}
        metrics: dict[str, Any] = {"eval": self.evaluate()}
        if self.bema is not None and self.bema.started:
            with self.use_bema():
                metrics["bema_eval"] = self.evaluate()
        return metrics

    # -- the loop ------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any], writer: Any) -> None:
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if writer is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, record["step"])

    def _train_step(self, step: int) -> dict[str, Any]:
        cfg, tc = self.config, self.config.train
        length, batch_size = cfg.length_at(step), cfg.batch_size_at(step)
        batch = self.source.sample(batch_size, length, step_generator(tc.seed, step))
        if self.world > 1:  # this rank's contiguous share of the global batch (equal shares, see _check_world)
            batch = split_batch(batch, self.world)[self.rank][0]
        batch = batch.to(self.device)
        multiplier = lr_multiplier(step, total=tc.steps, schedule=tc.schedule, warmup=tc.warmup_steps,
                                   cooldown_frac=tc.cooldown_frac, min_ratio=tc.min_lr_ratio)
        set_lr(self.optimizers, multiplier)
        self.model.train()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        parts = split_batch(batch, tc.grad_accum)
        attentions = self.model.attentions
        total = torch.zeros((), device=self.device)
        for i, (micro, weight) in enumerate(parts):
            capture = tc.qk_clip is not None and i == len(parts) - 1
            if capture:
                for attn in attentions:
                    attn.capture = {}
            # DDP: all-reduce the gradients once, in the last micro-batch's backward
            sync = self.ddp is None or i == len(parts) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self._autocast():
                    output = self.forward_model(micro.tokens, micro.doc_ids)
                loss, _ = self.model.loss(output, micro)
                (loss * weight).backward()
            total += loss.detach() * weight
        loss_value = float(distributed.all_reduce_mean(total))
        where = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
            "; no checkpoint was written yet"
        if not math.isfinite(loss_value):
            raise NonFiniteLossError(f"training loss is {loss_value} at step {step}; stopping{where}")
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = None
        if tc.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
            if not math.isfinite(grad_norm):
                raise NonFiniteLossError(f"gradient norm is {grad_norm} at step {step}; stopping{where}")
        for opt in self.optimizers:
            opt.step()
        record_out: dict[str, Any] = {}
        if tc.qk_clip is not None:
            maxima = []
            for attn in attentions:
                m = distributed.all_reduce_max(attention_max_logits(attn))
                attn.capture = None
                qk_clip_(attn, m, tc.qk_clip)
                maxima.append(float(m.max()))
            record_out["max_logit"] = max(maxima)
        self.step = step + 1
        if self.bema is not None:
            self.bema.update(self.step)
        self.history.append(loss_value)
        self.tokens += batch_size * length
        record_out.update(loss=loss_value, lr_mult=multiplier, length=length, batch_size=batch_size)
        if self.world > 1:
            record_out["rank_batch_size"] = int(batch.tokens.shape[0])
        if grad_norm is not None:
            record_out["grad_norm"] = grad_norm
        return record_out

    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train until ``train.steps`` (or until ``stop_at`` steps, then checkpoint as if interrupted)."""
        cfg, tc = self.config, self.config.train
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        end = tc.steps if stop_at is None else min(tc.steps, stop_at)
        writer = _tensorboard(self.run_dir) if self.is_main else None
        bar = _progress(total=tc.steps, initial=self.step, disable=not self.progress,
                        desc=cfg.name or self.run_dir.name)
        start_time, start_tokens = time.perf_counter(), self.tokens
        saved_threads = torch.get_num_threads()
        if tc.threads:
            torch.set_num_threads(tc.threads)
        ran = self.step < end
        try:
            while self.step < end:
                record = self._train_step(self.step)
                step = self.step
                elapsed = time.perf_counter() - start_time
                tokens_per_s = (self.tokens - start_tokens) / max(elapsed, 1e-9)
                record.update(step=step, tokens=self.tokens, tokens_per_s=tokens_per_s, time=elapsed)
                if step % tc.log_every == 0 or step == end:
                    self._log(record, writer)
                bar.update(1)
                bar.set_postfix(step=step, loss=f"{record['loss']:.4g}", tok_s=f"{tokens_per_s:.3g}")
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    self.metrics = self._evaluate_all()
                    if self.metrics:
                        self._log({"step": step, **self.metrics}, writer)
                if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == end:
                    self.save_checkpoint()
            if self._saved_step != self.step:
                self.save_checkpoint()
            if self.step >= tc.steps and (ran or not (self.run_dir / "eval.json").exists()):
                self._final_position_eval()
        finally:
            torch.set_num_threads(saved_threads)
            bar.close()
            if writer is not None:
                writer.close()
        self.model.eval()
        return TrainResult(self.model, self.run_dir, self.step, list(self.history), cfg, self.metrics,
                           self.last_checkpoint, self, self.by_position)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is optional
        return None
    return SummaryWriter(str(run_dir / "tb"))


def _progress(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


# ---------------------------------------------------------------------------------------------------
# public API


def train(config: RunConfig | dict | str | Path, out_dir: str | Path, *, progress: bool = True,
          resume: bool = False, stop_at: int | None = None) -> TrainResult:
    """Train a run described by ``config`` (a `RunConfig`, its dict, or a TOML path) into ``out_dir``.

    ``resume=True`` continues from the folder's latest checkpoint (starting fresh if there is none).
    ``stop_at`` ends after that many steps with a checkpoint, as if interrupted (the schedule still
    spans ``train.steps``). Raises `ConfigError` before training for a bad config and `NonFiniteLossError`
    (naming the step and the last good checkpoint) when the loss turns NaN or infinite.
    """
    return Trainer(config, out_dir, progress=progress, resume=resume).fit(stop_at=stop_at)


def load_run(path: str | Path, *, bema: bool = False, device: str | torch.device = "cpu"
             ) -> tuple[RunConfig, GPT]:
    """(config, model in eval mode) from a run folder (its latest checkpoint), a checkpoint folder or a file
    in one. ``bema=True`` loads the BEMA weights (ValueError if the run has none). FileNotFoundError names a
    missing path."""
    ckpt = ckpt_io.find_checkpoint(path)
    state = ckpt_io.read_state(ckpt)
    cfg = RunConfig.from_dict(state["config"])
    model = GPT(cfg.model)
    ckpt_io.load_weights(model, ckpt, device)
    model.to(device)
    if bema:
        tensors = ckpt_io.load_bema_tensors(ckpt, device)
        if tensors is None:
            raise ValueError(f"checkpoint {ckpt} has no BEMA weights (train.bema.enabled was false)")
        tracker = BEMA(model)
        meta = state.get("bema", {})
        for key in ("kappa", "eta", "rho", "gamma", "tau"):
            if key in meta:
                setattr(tracker, key, meta[key])
        tracker.load(tensors, meta)
        model.load_state_dict(tracker.state_dict_for_model())
    return cfg, model.eval()
