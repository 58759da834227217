"""Run configuration: `RunConfig` = `GPTConfig` (``model``) + `TrainConfig` (``train``) + `DataConfig` (``data``).

TOML files (``configs/*.toml``) have the sections ``[model]``, ``[train]`` (with ``[train.bema]``) and ``[data]``
(with ``[data.task_kwargs]``); ``name`` may sit at the top. Overrides ``a.b.c=value`` (CLI ``--set``) parse
``value`` as a TOML literal and fall back to a plain string: ``train.steps=200``, ``model.attention=l2``
(a preset), ``model.attention.out_norm=head_rms`` (one field), ``train.stages=[[0, 32], [100, 64]]``,
``model.logit_cap=none`` (None). Every unknown key, bad choice or bad type raises `ConfigError` naming the
full key and the valid keys or choices, before anything is trained.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lengthgen.atomic import atomic_write_text
from lengthgen.config import (FOLDER_NAME, MAX_SIZE, ConfigError, build, check, documented, folder_name, invalid,
                              load_toml, option, parse_assignment, read_config_text, set_key, to_plain)
from lengthgen.data.config import DataConfig
from lengthgen.data.tasks import task_class
from lengthgen.model.config import GPTConfig

Schedule = Literal["cosine", "wsd", "constant"]
Optimizer = Literal["adamw", "adamw_palm", "muon", "normuon"]
#: the optimizers that give 2-D hidden weights to Muon (AdamW takes the rest)
MUON_OPTIMIZERS = ("muon", "normuon")
#: Muon's keys that name its parameters: refused without Muon (`build_optimizers`), not merely without effect
MUON_PATTERNS = ("muon_lr_mul", "muon_exclude")
MuonAdjust = Literal["original", "match_rms_adamw"]
Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16"]
Parallel = Literal["ddp", "fsdp"]
DecayOn = Literal["matrices", "all"]


@documented
@dataclass
class BemaConfig:
    """BEMA, the bias-corrected EMA of the weights (Block et al. 2025): see `lengthgen.train.bema`."""

    enabled: bool = option(False, "keep a BEMA of the weights and evaluate it")
    kappa: float = option(0.5, "EMA power: beta_t = (1 + gamma t)^-kappa", ge=0)
    eta: float = option(0.2, "bias-correction power: alpha_t = (1 + t)^-eta", ge=0)
    rho: int = option(10, "lag: t = max(step - tau + rho, 1)", ge=0)
    gamma: float = option(1.0, "time scale gamma of the EMA weight", ge=0)
    tau: int = option(0, "burn-in: before step tau, theta_bema = theta", ge=0)
    update_every: int = option(1, "update every this many steps after tau (the authors' update_freq)", ge=1)

    def __post_init__(self) -> None:
        check(self)


@documented
@dataclass
class TrainConfig:
    """Optimization, schedule, batch and bookkeeping of a run."""

    steps: int = option(1000, "optimizer steps", ge=1)
    lr: float = option(1e-3, "peak AdamW learning rate", ge=0)
    schedule: Schedule = option("cosine", "cosine (warmup + cosine), wsd (warmup, constant, linear cooldown) "
                                "or constant")
    warmup_steps: int = option(0, "linear warmup steps", ge=0)
    cooldown_frac: float = option(0.2, "wsd: fraction of the steps in the linear cooldown", ge=0, le=1)
    min_lr_ratio: float = option(0.0, "lr / peak lr the decay reaches at train.steps (cosine and wsd; the last "
                                 "update, at steps - 1, is one decay step above it)", ge=0, le=1)
    optimizer: Optimizer = option("adamw", "adamw, adamw_palm (AdamW with PaLM's beta2 = 1 - step^-0.8 and eps as a "
                                  "floor of sqrt(v): seed 001's heavyball AdamW(palm=True)), muon (torch Muon for "
                                  "2-D hidden weights, AdamW for the rest) or normuon (Muon with NorMuon's "
                                  "per-neuron normalization, seed 000)")
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas (adamw_palm uses the first only)", ge=0, lt=1)
    eps: float = option(1e-8, "AdamW eps (adamw_palm: the floor of sqrt(v), > 0)", ge=0)
    weight_decay: float = option(0.0, "AdamW weight decay (on the parameters weight_decay_on says)", ge=0)
    weight_decay_on: DecayOn = option("matrices", "AdamW decays matrices only (2-D weights, not norms, biases, "
                                      "scalars) or all parameters (seed 001)")
    weight_decay_mul: dict[str, float] = option({}, "AdamW parameter-name pattern -> multiplier of its weight decay "
                                                "(modded-nanogpt's wd_mul); later patterns win", ge=0)
    cautious_weight_decay: bool = option(False, "decay only the entries whose update has their sign, at seed 000's "
                                         "rates: AdamW wd x lr^2, NorMuon muon_weight_decay x muon_lr x the "
                                         "matrix's update lr (scheduled; needs adamw or normuon)")
    muon_lr: float = option(0.02, "Muon learning rate", ge=0)
    muon_momentum: float = option(0.95, "Muon momentum (the peak, with a momentum warmup or cooldown)", ge=0, lt=1)
    muon_momentum_min: float = option(0.85, "Muon momentum at the start of its warmup and the end of its cooldown",
                                      ge=0, lt=1)
    muon_momentum_warmup: int = option(0, "steps over which Muon's momentum rises linearly from muon_momentum_min "
                                       "to muon_momentum (seed 000: 300)", ge=0)
    muon_momentum_cooldown: int = option(0, "last steps over which Muon's momentum falls linearly back to "
                                         "muon_momentum_min (seed 000: 50)", ge=0)
    muon_weight_decay: float = option(0.0, "Muon weight decay", ge=0)
    muon_beta2: float = option(0.95, "normuon: decay of the per-neuron second moment", ge=0, lt=1)
    muon_adjust_lr: MuonAdjust = option("original", "torch.optim.Muon's adjust_lr_fn")
    muon_exclude: list[str] = option([], "block-matrix name patterns (fnmatch, e.g. 'blocks.*.attn.gate.weight') "
                                     "that AdamW updates instead of Muon (seed 000's gates)")
    muon_lr_mul: dict[str, float] = option({}, "Muon parameter-name pattern (fnmatch, e.g. 'blocks.*.mlp.proj."
                                           "weight') -> learning-rate multiplier (modded-nanogpt's lr_mul); "
                                           "later patterns win", gt=0)
    adam_lr_mul: dict[str, float] = option({}, "AdamW parameter-name pattern (fnmatch, e.g. 'value_embeds.*') -> "
                                           "learning-rate multiplier (modded-nanogpt's lr_mul); later patterns "
                                           "win", gt=0)
    adam_betas: dict[str, tuple[float, float]] = option({}, "AdamW parameter-name pattern -> betas for those "
                                                        "parameters (modded-nanogpt's per-group betas); later "
                                                        "patterns win", ge=0, lt=1)
    qk_clip: float | None = option(None, "QK-clip threshold tau (Kimi K2); none disables", gt=0)
    adam_every: int = option(1, "AdamW (the only optimizer with adamw or adamw_palm; with muon or normuon, the one "
                             "for the rest) steps where (step + 1) % adam_every == 0, on its parameters' gradients "
                             "summed since its last step (not zeroed in between); Muon steps every step (seed 000's "
                             "DistAdam: 2, odd steps)", ge=1)
    grad_clip: float = option(1.0, "max global grad norm; 0 disables (it sees the gradients the step's optimizers "
                              "step on: with adam_every > 1, AdamW's summed ones at its steps only)", ge=0)
    grad_accum: int = option(1, "micro-batches per step", ge=1)
    batch_size: int = option(32, "sequences per step at data.length (when tokens_per_step is none)", ge=1,
                            le=MAX_SIZE)
    tokens_per_step: int | None = option(None, "constant tokens per step: batch = tokens_per_step // length",
                                         ge=1, le=MAX_SIZE)
    stages: list[tuple[int, int]] = option([], "staged context length: [[step, length], ...]", ge=0,
                                          le=MAX_SIZE)
    restart_at_stages: bool = option(False, "at every stage after the first, re-create the optimizers (fresh "
                                     "state) and warm the learning rate up again over warmup_steps (seed 001)")
    bema: BemaConfig = option(BemaConfig(), "BEMA of the weights")
    seed: int = option(0, "seed of the weights and the data", ge=0, le=2**63 - 1)
    eval_every: int = option(0, "evaluate every this many steps; 0: at the end only", ge=0)
    eval_lengths: list[int] = option([], "evaluation lengths (default [data.length])", ge=1, le=MAX_SIZE)
    eval_batches: int = option(2, "train's evaluations: eval_batches x eval_batch_size sequences of the training "
                               "length's tokens per eval length (longer lengths: the same tokens in fewer "
                               "sequences); 0: no evaluation", ge=0)
    eval_batch_size: int = option(16, "tokens per evaluation forward pass, in sequences of the training length "
                                  "(train, and eval, needle, compare, retrofit)", ge=1, le=MAX_SIZE)
    checkpoint_every: int = option(0, "checkpoint every this many steps; 0: at the end only", ge=0)
    keep_checkpoints: int = option(2, "checkpoints kept on disk", ge=1)
    log_every: int = option(10, "log every this many steps (and the first and last): a line on the console "
                            "(without a progress bar), an entry in metrics.jsonl, TensorBoard and W&B", ge=1)
    wandb: str | None = option(None, "also log to this Weights & Biases project (pip install wandb; "
                               "WANDB_MODE=offline logs without a network); none: off")
    device: Device = option("auto", "training device")
    dtype: Dtype = option("auto", "auto (bf16 autocast on CUDA, float32 on CPU), float32 or bfloat16")
    compile: bool = option(False, "torch.compile the model (on CPU too, where compiling takes minutes)")
    parallel: Parallel = option("ddp", "under torchrun: ddp (every rank holds the model) or fsdp (FSDP2 "
                                "fully_shard: weights, gradients and optimizer states split across ranks)")
    threads: int = option(0, "CPU threads (torch.set_num_threads) while training, evaluating and sampling the run "
                          "(eval, needle, compare, retrofit, sample); 0: torch's default", ge=0, le=1024)
    init_from: str | None = option(None, "start from this run folder's or checkpoint's weights with a fresh "
                                   "optimizer; parameters the attention spec adds keep their init")

    def __post_init__(self) -> None:
        check(self)
        steps = [step for step, _ in self.stages]
        if steps != sorted(set(steps)) or any(length < 1 for _, length in self.stages):
            raise invalid("TrainConfig.stages", self.stages, "a list of [step, length] pairs with increasing "
                          "steps >= 0 and lengths >= 1, e.g. [[0, 32], [500, 64]]")
        if self.cautious_weight_decay and self.optimizer in ("muon", "adamw_palm"):
            raise invalid("TrainConfig.cautious_weight_decay", True, f"false with optimizer {self.optimizer} (it "
                          "decays every entry); set train.optimizer to normuon or adamw")
        if self.eps == 0 and self.optimizer == "adamw_palm":
            raise invalid("TrainConfig.eps", self.eps, "> 0 with optimizer adamw_palm (the floor of sqrt(v): with 0, "
                          "an entry whose gradients have all been 0, e.g. an unseen token's embedding, divides 0 by 0)")
        if self.wandb is not None and not self.wandb.strip():
            raise invalid("TrainConfig.wandb", self.wandb, "a W&B project name, or none (W&B off)")
        if self.init_from is not None and not self.init_from.strip():     # an empty shell variable: not a fresh start
            raise invalid("TrainConfig.init_from", self.init_from, "a run folder or checkpoint, or none (start "
                          "from fresh weights)")

    def unused(self) -> list[str]:
        """What this valid config asks for but a run of it never reaches: stages that start at or after the last
        step, a warmup longer than the run, an AdamW that never steps (``adam_every`` > ``steps``), Muon keys
        without Muon (muon_beta2 without NorMuon), weight decay multipliers without weight decay, a BEMA burn-in as
        long as the run (one message each; ``train`` and ``compare`` warn with them)."""
        notes = []
        late = [list(stage) for stage in self.stages if stage[0] >= self.steps]
        if late:
            notes.append(f"train.stages {late} start at or after train.steps={self.steps} (steps count from 0): "
                         "never used")
        if self.warmup_steps > self.steps:
            notes.append(f"train.warmup_steps={self.warmup_steps} > train.steps={self.steps}: the learning rate "
                         f"only reaches {self.steps / self.warmup_steps:.2g} x train.lr")
        if self.adam_every > self.steps:
            notes.append(f"train.adam_every={self.adam_every} > train.steps={self.steps}: AdamW never steps (it steps "
                         "where (step + 1) % adam_every == 0)")
        muon_set = [f"train.{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                    if f.name.startswith("muon_") and f.name not in MUON_PATTERNS
                    and getattr(self, f.name) != getattr(DEFAULT_TRAIN, f.name)]
        if muon_set and self.optimizer not in MUON_OPTIMIZERS:
            notes.append(f"{', '.join(muon_set)}: no effect with train.optimizer='{self.optimizer}' (Muon's keys, "
                         f"read only with {' or '.join(MUON_OPTIMIZERS)})")
        elif self.optimizer == "muon" and self.muon_beta2 != DEFAULT_TRAIN.muon_beta2:
            notes.append(f"train.muon_beta2={self.muon_beta2!r}: no effect with train.optimizer='muon' (NorMuon's "
                         "second moment, read only with normuon)")
        if self.weight_decay_mul and self.weight_decay == 0:
            notes.append("train.weight_decay_mul: no effect with train.weight_decay=0 (it multiplies AdamW's weight "
                         "decay)")
        if self.bema.enabled and self.bema.tau >= self.steps:
            notes.append(f"train.bema.tau={self.bema.tau} >= train.steps={self.steps}: BEMA never starts (no BEMA "
                         "weights are evaluated or saved)")
        return notes


#: every key at its default, for `TrainConfig.unused`
DEFAULT_TRAIN = TrainConfig()


@documented
@dataclass
class RunConfig:
    """A whole run: ``model``, ``train``, ``data``, an optional ``name`` and the settings of `lengthgen compare`
    (``compare``: its variants, bases, seeds and evaluation, checked by `lengthgen.experiments.compare`)."""

    model: GPTConfig = option(GPTConfig(), "the model")
    train: TrainConfig = option(TrainConfig(), "optimization, schedule, evaluation and checkpoints")
    data: DataConfig = option(DataConfig(), "the training data")
    name: str = option("", "the run's name, a plain folder name: lengthgen train's default folder is runs/<name>")
    compare: dict[str, Any] = option({}, "lengthgen compare's experiment (variants, bases, pretrain_steps, seeds, "
                                     "eval_lengths, eval_tokens, metric, needle_depths, needle_samples, workers); "
                                     "checked but not used by lengthgen train")

    def __post_init__(self) -> None:
        check(self)
        if self.name and not folder_name(self.name):     # lengthgen train's default folder is runs/<name>
            raise invalid("RunConfig.name", self.name, f"{FOLDER_NAME}, or '' for none")
        if self.tokens_per_step < max(self.lengths()):
            key = "tokens_per_step" if self.train.tokens_per_step is not None else "batch_size"
            raise ConfigError(f"RunConfig.train.{key}={getattr(self.train, key)}: {self.tokens_per_step} tokens per "
                              f"step hold no sequence of the longest training length ({max(self.lengths())}: "
                              f"data.length and train.stages); set train.tokens_per_step to at least "
                              f"{max(self.lengths())}", f"RunConfig.train.{key}")

    def unused(self, lengths: list[int]) -> list[str]:
        """`TrainConfig.unused`, `GPTConfig.unused`, sliding windows that hide no key at ``lengths`` (those the
        command trains and evaluates at; `GPTConfig.idle_windows`), document masking on a task (its sequences
        are one document each), the lm head's z-loss and logit soft-cap with a task's regress or classify
        head, and training lengths that do not divide the tokens per step (their steps train fewer)."""
        notes = self.train.unused() + self.model.unused() + self.model.idle_windows(lengths)
        tokens = self.tokens_per_step
        uneven = [f"{tokens // length} x {length} = {tokens // length * length}" for length in self.lengths()
                  if tokens % length]
        if uneven:
            key = "train.batch_size x data.length" if self.train.tokens_per_step is None else "train.tokens_per_step"
            notes.append(f"{key} = {tokens} tokens per step is not a multiple of every training length: steps train "
                         f"{', '.join(uneven)} tokens (batch = tokens_per_step // length), not {tokens}")
        head = self.model.head or (task_class(self.data.task).head if self.data.kind == "task" else "lm")
        for key in ("z_loss", "logit_cap"):
            if head != "lm" and getattr(self.model, key):
                notes.append(f"model.{key}={getattr(self.model, key)} has no effect with the {head} head (of "
                             f"data.task='{self.data.task}'): it applies to an lm head's logits only")
        masking = sorted({"model.attention" if spec is self.model.attention else "model.layer_attention"
                          for spec in self.model.layer_specs() if spec.doc_masking})
        if self.data.kind == "task" and masking:
            notes.append(f"{' and '.join(f'{key}.doc_masking=True' for key in masking)} has no effect on "
                         f"data.kind='task' ({self.data.task}): a task's sequences are one document each")
        return notes

    # -- derived -------------------------------------------------------------------------------------
    def length_at(self, step: int) -> int:
        """The context length at ``step`` (the last stage started at or before it, else data.length)."""
        length = self.data.length
        for start, stage_length in self.train.stages:
            if start <= step:
                length = stage_length
        return length

    def stage_start(self, step: int) -> int:
        """The first step of the stage ``step`` is in (0 before any stage starts)."""
        return max((start for start, _ in self.train.stages if start <= step), default=0)

    @property
    def tokens_per_step(self) -> int:
        return self.train.tokens_per_step or self.train.batch_size * self.data.length

    def batch_size_at(self, step: int) -> int:
        """Sequences per step: tokens_per_step // length (at least one: checked when the config is made)."""
        return self.tokens_per_step // self.length_at(step)

    def lengths(self) -> list[int]:
        """The lengths trained at: data.length (unless a stage starts at step 0) and each stage's."""
        first = [] if any(start == 0 for start, _ in self.train.stages) else [self.data.length]
        return sorted({*first, *(s[1] for s in self.train.stages)})

    # -- (de)serialization ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        """A run from a (TOML/JSON) dict; errors name the key as written in the file (``train.lr``)."""
        try:
            return build(cls, data)
        except ConfigError as err:
            raise err.under("") from None

    def override(self, *assignments: str) -> "RunConfig":
        """A copy with ``key=value`` assignments applied in order (see the module docstring), checked once all
        are applied: ``model.dim=6`` then ``model.heads=3`` is valid in either order, and a preset set by one
        (``model.attention=l2``) is the table that a later key changes (`set_key`)."""
        return self.changed(parse_assignment(assignment) for assignment in assignments)

    def changed(self, changes: Iterable[tuple[str | tuple[str, ...], Any]]) -> "RunConfig":
        """A copy with ``(key, value)`` changes (a dotted key or its parts) applied in order by `set_key`, checked
        once at the end (`override`; a nested change table through `lengthgen.config.leaves`)."""
        data = self.to_dict()
        for key, value in changes:
            data = set_key(data, key, value, RunConfig)
        return RunConfig.from_dict(data)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A `RunConfig` from a TOML (or JSON, e.g. a run's ``config.json``) file plus ``key=value`` overrides."""
    if path is None:
        cfg = RunConfig()
    elif str(path).endswith(".json"):
        try:
            data = json.loads(read_config_text(path))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: invalid JSON: {err}") from None
        if isinstance(data, dict) and {"schema", "kind"} <= data.keys():       # eval.results' files
            raise ConfigError(f"{path} is a lengthgen results file ({data['kind']}), not a config; a run's config is "
                              "the config.json in its folder")
        if isinstance(data, dict) and "model_type" in data:            # transformers' config.json
            raise ConfigError(f"{path} is a Hugging Face model's config (model_type {data['model_type']}), not a run "
                              "config; a run's config is the config.json in its run folder")
        cfg = RunConfig.from_dict(data)
    else:
        cfg = RunConfig.from_dict(load_toml(path))
    return cfg.override(*overrides)


def save_config(cfg: RunConfig, directory: str | Path) -> Path:
    """Write the resolved config as ``config.json`` in ``directory``."""
    return atomic_write_text(Path(directory) / "config.json", cfg.to_json())


__all__ = ["BemaConfig", "MUON_OPTIMIZERS", "RunConfig", "TrainConfig", "load_config", "save_config"]
