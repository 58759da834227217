"""Run configuration: `RunConfig` = `GPTConfig` (``model``) + `TrainConfig` (``train``) + `DataConfig` (``data``).

TOML files (``configs/*.toml``) have the sections ``[model]``, ``[train]`` (with ``[train.bema]``) and ``[data]``
(with ``[data.task_kwargs]``); ``name`` may sit at the top. Overrides ``a.b.c=value`` (CLI ``--set``) parse
``value`` as a TOML literal and fall back to a plain string: ``train.steps=200``, ``model.attention=l2``
(a preset), ``model.attention.out_norm=head_rms`` (one field), ``train.stages=[[0, 32], [100, 64]]``,
``model.logit_cap=none`` (None). Every unknown key, bad choice or bad type raises `ConfigError` naming the
full key and the valid keys or choices, before anything is trained.

Python 3.10 has no ``tomllib``: install ``tomli`` there (it is used as a drop-in fallback).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

from lengthgen.attention import FIELDS as SPEC_FIELDS
from lengthgen.attention import AttentionSpec, resolve_spec
from lengthgen.model.config import GPTConfig


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the full key."""


SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
DATA_KINDS = ("task", "text")
MUON_ADJUST = ("original", "match_rms_adamw")


def _bad(key: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not valid; {what}")


def _int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, value, f"it must be an integer >= {minimum}")


def _num(key: str, value: Any, minimum: float, maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum \
            or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise _bad(key, value, f"it must be a number {rng}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _bad(key, value, f"choose one of {', '.join(choices)}")


@dataclass
class BemaConfig:
    """BEMA (Block et al. 2025): see `lengthgen.train.bema`."""

    enabled: bool = False
    kappa: float = 0.5     # EMA power: beta_t = (1 + gamma t)^-kappa
    eta: float = 0.2       # bias-correction power: alpha_t = (1 + gamma t)^-eta
    rho: int = 10          # lag: t = max(step - tau + rho, 1)
    gamma: float = 1.0
    tau: int = 0           # burn-in: before step tau, theta_bema = theta

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise _bad("train.bema.enabled", self.enabled, "it must be true or false")
        for name in ("kappa", "eta", "gamma"):
            _num(f"train.bema.{name}", getattr(self, name), 0)
        _int("train.bema.rho", self.rho, 0)
        _int("train.bema.tau", self.tau, 0)


@dataclass
class TrainConfig:
    """Optimization, schedule, batch and bookkeeping of a run."""

    steps: int = 1000
    lr: float = 1e-3                 # AdamW learning rate (peak)
    schedule: str = "cosine"         # cosine (warmup + cosine) | wsd (warmup, constant, linear cooldown) | constant
    warmup_steps: int = 0
    cooldown_frac: float = 0.2       # wsd: fraction of the steps in the linear cooldown
    min_lr_ratio: float = 0.0        # final lr / peak lr (cosine and wsd)
    optimizer: str = "adamw"         # adamw | muon (Muon for 2-D hidden weights, AdamW for the rest)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0        # AdamW, on 2-D weights only (not norms, biases, scalars)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_adjust_lr: str = "original"  # original | match_rms_adamw (torch.optim.Muon's adjust_lr_fn)
    qk_clip: float | None = None     # QK-clip threshold tau (Kimi K2); None disables
    grad_clip: float = 1.0           # max global grad norm; 0 disables
    grad_accum: int = 1              # micro-batches per step
    batch_size: int = 32             # sequences per step at data.length (when tokens_per_step is None)
    tokens_per_step: int | None = None  # constant tokens per step: batch = tokens_per_step // length
    stages: list[list[int]] = field(default_factory=list)  # [[step, length], ...]: staged context length
    bema: BemaConfig = field(default_factory=BemaConfig)
    seed: int = 0
    eval_every: int = 0              # 0: evaluate at the end only
    eval_lengths: list[int] = field(default_factory=list)  # default [data.length]
    eval_batches: int = 2
    eval_batch_size: int = 16
    checkpoint_every: int = 0        # 0: checkpoint at the end only
    keep_checkpoints: int = 2
    log_every: int = 1
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto (bf16 autocast on CUDA, float32 on CPU) | float32 | bfloat16
    compile: bool = False            # torch.compile the model (CUDA only; ignored on CPU)
    threads: int = 0                 # CPU threads (torch.set_num_threads) while training; 0: torch's default
    init_from: str | None = None     # start from this run folder's / checkpoint's weights (fresh optimizer);
                                     # parameters the attention spec adds keep their init (lengthgen retrofit)

    def __post_init__(self) -> None:
        _int("train.steps", self.steps, 1)
        _num("train.lr", self.lr, 0)
        _choice("train.schedule", self.schedule, SCHEDULES)
        _int("train.warmup_steps", self.warmup_steps, 0)
        _num("train.cooldown_frac", self.cooldown_frac, 0, 1)
        _num("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas)):
            raise _bad("train.betas", self.betas, "it must be two numbers in [0, 1)")
        self.betas = [float(b) for b in self.betas]
        _num("train.eps", self.eps, 0)
        for name in ("weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "grad_clip"):
            _num(f"train.{name}", getattr(self, name), 0)
        _choice("train.muon_adjust_lr", self.muon_adjust_lr, MUON_ADJUST)
        if self.qk_clip is not None:
            _num("train.qk_clip", self.qk_clip, 1e-12)
        _int("train.grad_accum", self.grad_accum, 1)
        _int("train.batch_size", self.batch_size, 1)
        if self.tokens_per_step is not None:
            _int("train.tokens_per_step", self.tokens_per_step, 1)
        ok = isinstance(self.stages, (list, tuple)) and all(
            isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                for v in s) and s[0] >= 0 and s[1] >= 1
            for s in self.stages)
        steps = [s[0] for s in self.stages] if ok else []
        if not ok or steps != sorted(set(steps)):
            raise _bad("train.stages", self.stages, "it must be a list of [step, length] pairs with increasing "
                       "steps >= 0 and lengths >= 1, e.g. [[0, 32], [500, 64]]")
        self.stages = [list(s) for s in self.stages]
        if isinstance(self.bema, dict):
            self.bema = BemaConfig(**self.bema)
        _int("train.seed", self.seed, 0)
        _int("train.eval_every", self.eval_every, 0)
        if not (isinstance(self.eval_lengths, (list, tuple))
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.eval_lengths)):
            raise _bad("train.eval_lengths", self.eval_lengths, "it must be a list of lengths >= 1")
        self.eval_lengths = list(self.eval_lengths)
        _int("train.eval_batches", self.eval_batches, 0)
        _int("train.eval_batch_size", self.eval_batch_size, 1)
        _int("train.checkpoint_every", self.checkpoint_every, 0)
        _int("train.keep_checkpoints", self.keep_checkpoints, 1)
        _int("train.log_every", self.log_every, 1)
        _choice("train.device", self.device, DEVICES)
        _choice("train.dtype", self.dtype, DTYPES)
        if not isinstance(self.compile, bool):
            raise _bad("train.compile", self.compile, "it must be true or false")
        _int("train.threads", self.threads, 0)
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise _bad("train.init_from", self.init_from, "it must be a run folder or checkpoint path (or none)")


@dataclass
class DataConfig:
    """What the model trains on. ``kind="task"``: ``make_task(task, **task_kwargs)`` at ``length``.
    ``kind="text"``: the text-corpus module, with ``text`` as its keyword arguments (see `lengthgen.train.data`)."""

    kind: str = "task"               # task | text
    task: str = "counting"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    length: int = 64                 # training length (before any train.stages)
    text: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("data.kind", self.kind, DATA_KINDS)
        if not isinstance(self.task, str):
            raise _bad("data.task", self.task, "it must be a task name")
        for name in ("task_kwargs", "text"):
            if not isinstance(getattr(self, name), dict):
                raise _bad(f"data.{name}", getattr(self, name), "it must be a table of keyword arguments")
        _int("data.length", self.length, 1)


@dataclass
class RunConfig:
    """A whole run: ``model``, ``train``, ``data`` and an optional ``name``."""

    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    name: str = ""

    # -- derived -------------------------------------------------------------------------------------
    def length_at(self, step: int) -> int:
        """The context length at ``step`` (the last stage started at or before it, else data.length)."""
        length = self.data.length
        for start, stage_length in self.train.stages:
            if start <= step:
                length = stage_length
        return length

    @property
    def tokens_per_step(self) -> int:
        return self.train.tokens_per_step or self.train.batch_size * self.data.length

    def batch_size_at(self, step: int) -> int:
        """Sequences per step: tokens_per_step // length (at least 1)."""
        return max(1, self.tokens_per_step // self.length_at(step))

    def lengths(self) -> list[int]:
        return sorted({self.data.length, *(s[1] for s in self.train.stages)})

    # -- (de)serialization ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model.to_dict(),
                "train": dataclasses.asdict(self.train), "data": dataclasses.asdict(self.data)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return build(cls, data, "")

    def override(self, *assignments: str) -> "RunConfig":
        """A copy with ``key=value`` assignments applied in order (see the module docstring)."""
        cfg = self
        for assignment in assignments:
            key, sep, raw = assignment.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"override {assignment!r} is not valid; write key=value, e.g. train.steps=100")
            cfg = set_key(cfg, key.strip(), parse_value(raw.strip()))
        return cfg


# ---------------------------------------------------------------------------------------------------
# generic dataclass plumbing: typed coercion, building from dicts, setting one dotted key

_NONE_WORDS = ("none", "null")


def parse_value(raw: str) -> Any:
    """A TOML literal (``64``, ``1e-3``, ``true``, ``[[0, 32]]``, ``{window = 64}``, ``"x"``), else the string."""
    if tomllib is None:  # pragma: no cover
        raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package")
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except Exception:
        return raw


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check/convert ``value`` against a field's type hint; ConfigError naming ``key`` if it does not fit."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)):
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _coerce(key, value, rest[0])
        return value
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return build(hint, value, key + ".")
        raise _bad(key, value, f"it must be a table with keys {', '.join(f.name for f in dataclasses.fields(hint))}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _bad(key, value, "it must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(key, value, "it must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(key, value, "it must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise _bad(key, value, "it must be a string")
    if origin is list or hint is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise _bad(key, value, "it must be a list")
    if origin is dict or hint is dict:
        if isinstance(value, dict):
            return dict(value)
        raise _bad(key, value, "it must be a table")
    return value


def _construct(cls: type, kwargs: dict[str, Any], prefix: str) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = str(err)
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from a (TOML/JSON) dict, checking keys and types; ``prefix`` names the section."""
    if not isinstance(data, dict):
        raise _bad(prefix.rstrip(".") or "config", data, "it must be a table")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown config key {prefix + key!r}; valid keys"
                              f"{' under ' + repr(prefix.rstrip('.')) if prefix else ''}: {', '.join(names)}")
        kwargs[key] = _coerce(prefix + key, value, hints[key])
    return _construct(cls, kwargs, prefix)


def _set_spec_field(spec: AttentionSpec, field_name: str, value: Any, key: str) -> AttentionSpec:
    if field_name not in SPEC_FIELDS:
        raise ConfigError(f"unknown config key {key!r}; valid attention fields: {', '.join(SPEC_FIELDS)}")
    value = _coerce(key, value, _hints(AttentionSpec)[field_name])
    try:
        return spec.replace(**{field_name: value})
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def set_key(obj: Any, key: str, value: Any, _prefix: str = "") -> Any:
    """A copy of dataclass ``obj`` with the dotted ``key`` set to ``value`` (validated)."""
    head, _, rest = key.partition(".")
    full = _prefix + head
    if isinstance(obj, AttentionSpec):
        if rest:
            raise ConfigError(f"unknown config key {_prefix + key!r}; attention fields are not nested")
        return _set_spec_field(obj, head, value, full)
    if isinstance(obj, dict):
        new = dict(obj)
        new[head] = set_key(new.get(head, {}), rest, value, full + ".") if rest else value
        return new
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"unknown config key {_prefix + key!r}: {_prefix.rstrip('.')!r} has no sub-keys")
    names = [f.name for f in dataclasses.fields(obj)]
    if head not in names:
        where = f" under {_prefix.rstrip('.')!r}" if _prefix else ""
        raise ConfigError(f"unknown config key {full!r}; valid keys{where}: {', '.join(names)}")
    if rest:
        new_value = set_key(getattr(obj, head), rest, value, full + ".")
    elif isinstance(obj, GPTConfig) and head == "attention":
        try:
            new_value = resolve_spec(value)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{full}: {err}") from None
    else:
        new_value = _coerce(full, value, _hints(type(obj))[head])
    kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    kwargs[head] = new_value
    return _construct(type(obj), kwargs, _prefix)


# ---------------------------------------------------------------------------------------------------
# files


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    if tomllib is None:  # pragma: no cover
        raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package")
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A `RunConfig` from a TOML (or JSON, e.g. a run's ``config.json``) file plus ``key=value`` overrides."""
    if path is None:
        cfg = RunConfig()
    elif str(path).endswith(".json"):
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config file not found: {p}")
        cfg = RunConfig.from_dict(json.loads(p.read_text()))
    else:
        cfg = RunConfig.from_dict(load_toml(path))
    return cfg.override(*overrides)


def save_config(cfg: RunConfig, directory: str | Path) -> Path:
    """Write the resolved config as ``config.json`` in ``directory``."""
    from lengthgen.train.checkpoint import atomic_write_text

    path = Path(directory) / "config.json"
    atomic_write_text(path, cfg.to_json())
    return path


__all__ = ["BemaConfig", "ConfigError", "DataConfig", "RunConfig", "TrainConfig", "GPTConfig", "build",
           "load_config", "load_toml", "parse_value", "save_config", "set_key"]
