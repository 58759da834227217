"""The task interface: every synthetic task samples batches at any length from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lengthgen.config import ConfigError, invalid


def check_generator(key: str, generator: torch.Generator) -> torch.Generator:
    """``generator`` if it is a torch.Generator (its device is the batch's); else a `ConfigError` naming ``key``."""
    if not isinstance(generator, torch.Generator):
        raise invalid(key, generator, "a torch.Generator, e.g. torch.Generator().manual_seed(0)")
    return generator


@dataclass
class Batch:
    """One batch of a task.

    tokens:    (B, L) long, model input.
    targets:   (B, L) long for ``lm`` heads, (B, L) float for ``regress``, (B,) long for ``classify``.
    loss_mask: (B, L) bool, positions that count in the loss (for ``classify``: all True).
    doc_ids:   optional (B, L) long, document ids for document masking.
    extra:     task-specific tensors the metrics need (e.g. legal-next-token masks).
    position_extras: the names of the extras with a position axis (B, L, ...), cut by `positions`.
    start:     the position of column 0 in the sampled sequences (nonzero for a `positions` cut).
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    position_extras: tuple[str, ...] = ()
    start: int = 0

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, tokens=move(self.tokens), targets=move(self.targets), loss_mask=move(self.loss_mask),
                       doc_ids=move(self.doc_ids), extra={k: move(v) for k, v in self.extra.items()})

    def rows(self, lo: int, hi: int) -> "Batch":
        """Sequences ``lo:hi`` (every per-sequence tensor cut along the batch axis; other extras kept)."""
        total = self.tokens.shape[0]
        cut = lambda t: None if t is None else t[lo:hi]  # noqa: E731
        return replace(self, tokens=cut(self.tokens), targets=cut(self.targets), loss_mask=cut(self.loss_mask),
                       doc_ids=cut(self.doc_ids), extra={k: cut(v) if torch.is_tensor(v) and v.shape[:1] == (total,)
                                                         else v for k, v in self.extra.items()})

    def positions(self, lo: int, hi: int) -> "Batch":
        """Positions ``lo:hi`` of every sequence: tokens, loss mask, document ids, per-position targets and the
        ``position_extras`` cut along the position axis; ``start`` moves by ``lo``; the rest is kept."""
        cut = lambda t: None if t is None else t[:, lo:hi]  # noqa: E731
        per_position = self.targets.shape[:2] == self.tokens.shape
        return replace(self, tokens=cut(self.tokens), targets=cut(self.targets) if per_position else self.targets,
                       loss_mask=cut(self.loss_mask), doc_ids=cut(self.doc_ids), start=self.start + lo,
                       extra={k: cut(v) if k in self.position_extras else v for k, v in self.extra.items()})


def _is_integer(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


#: each field of a Batch by head: (shape in words, dtype in words, dtype test); B rows, L positions
_CONTRACT = {
    "tokens": ("(B, L)", "long", lambda t: t.dtype in (torch.long, torch.int32)),
    "targets": ("(B, L)", "long", lambda t: t.dtype == torch.long),
    "loss_mask": ("(B, L)", "bool", lambda t: t.dtype == torch.bool),
    "doc_ids": ("(B, L)", "long", _is_integer),
}
_TARGETS = {"regress": ("(B, L)", "float", lambda t: t.dtype.is_floating_point or _is_integer(t)),
            "classify": ("(B,)", "long", lambda t: t.dtype == torch.long)}


def check_batch(source, batch, rows: int, length: int, fewer: bool = False) -> None:
    """``batch``, drawn by ``source.sample(rows, length, generator)``, must keep the `Batch` contract for the
    source's head (shapes, dtypes, token ids in [0, vocab_size)); else a `contract_error`, before a step trips over
    it deep in the model. ``fewer``: it may hold fewer rows (at least one), as an evaluation's long documents do."""
    call = f"sample({rows}, {length}, generator)"
    if not isinstance(batch, Batch):
        raise contract_error(source, call, f"returned a {type(batch).__name__}, not a lengthgen.data.tasks.Batch")
    if fewer and torch.is_tensor(batch.tokens) and batch.tokens.dim() == 2 and 1 <= batch.tokens.shape[0] <= rows:
        rows = batch.tokens.shape[0]
    head = getattr(source, "head", "lm")
    for name, (shape, dtype, fits) in {**_CONTRACT, "targets": _TARGETS.get(head, _CONTRACT["targets"])}.items():
        t = getattr(batch, name)
        if t is None and name == "doc_ids":
            continue
        want = (rows,) if shape == "(B,)" else (rows, length)
        if not torch.is_tensor(t) or tuple(t.shape) != want or not fits(t):
            got = f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else f"a {type(t).__name__}"
            raise contract_error(source, call, f"returned {name} {got}; with head {head!r} it must be {shape} = "
                                 f"{want} {dtype} (B sequences of length L: the Batch contract, "
                                 "lengthgen/data/tasks/base.py)")
    vocab = getattr(source, "vocab_size", None)
    low, high = int(batch.tokens.min()), int(batch.tokens.max())
    if isinstance(vocab, int) and (low < 0 or high >= vocab):
        raise contract_error(source, call, f"returned token ids in [{low}, {high}]; they must be in [0, vocab_size) "
                             f"= [0, {vocab})")
    # the loss's cross-entropy reads every scored target as a class (an lm's: a token id)
    size, classes = {"lm": ("vocab_size", vocab), "classify": ("num_classes", getattr(source, "num_classes", None))
                     }.get(head, (None, None))
    scored = batch.targets[batch.loss_mask] if head == "lm" else batch.targets
    if isinstance(classes, int) and scored.numel():
        low, high = int(scored.min()), int(scored.max())
        if low < 0 or high >= classes:
            where = " where loss_mask is set" if head == "lm" else ""
            raise contract_error(source, call, f"returned targets in [{low}, {high}]{where}; they must be in "
                                 f"[0, {size}) = [0, {classes})")


def check_metrics(source, values, shape: torch.Size) -> None:
    """``values``, returned by ``source.metrics``, must map names to tensors of the loss's ``shape`` ((B, L) per
    position, (B,) for ``classify``); else a `contract_error`."""
    if not isinstance(values, dict):
        raise contract_error(source, "metrics(output, batch)", f"returned a {type(values).__name__}, not a dict of "
                             "tensors")
    for name, v in values.items():
        if not torch.is_tensor(v) or v.shape != shape:
            got = tuple(v.shape) if torch.is_tensor(v) else f"a {type(v).__name__}"
            raise contract_error(source, "metrics(output, batch)", f"returned {name} {got}; each metric must be "
                                 + ("(B,) = {}, one value per sequence" if len(shape) == 1 else
                                    "(B, L) = {}, per position").format(tuple(shape))
                                 + ", NaN where undefined (Task.metrics, lengthgen/data/tasks/base.py)")


#: a task's declared attributes that no model key checks: (test, what the value must be)
_DECLARED = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string (the task's title in reports)"),
    "metric": (lambda v: isinstance(v, str) and v != "", "a non-empty string, the headline: 'loss' or a key that "
               "metrics() returns"),
    "higher_is_better": (lambda v: isinstance(v, bool), "True or False"),
    "also_reported": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(b, bool)
                                                            for k, b in v.items()),
                      "a dict of metric name -> whether higher is better (True or False)"),
    "max_length": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                   "None (unbounded) or an integer >= 1"),
}


def check_declared(source) -> None:
    """A task's ``name``, ``metric``, ``higher_is_better``, ``also_reported`` and ``max_length`` must be of their
    kind (a researcher's own class may set anything); else a `contract_error` (a string "no" would read as True)."""
    for attribute, (fits, must) in _DECLARED.items():
        value = getattr(source, attribute)
        if not fits(value):
            raise contract_error(source, f"{attribute}={value!r}", f"is not valid; it must be {must} (Task, "
                                 "lengthgen/data/tasks/base.py)")


def contract_error(source, call: str, problem: str) -> ConfigError:
    """A `ConfigError` keyed data.task (``data`` for a source that is not a `Task`) naming the source's class, the
    ``call`` and its ``problem``."""
    cls, key = type(source), "data.task" if isinstance(source, Task) else "data"
    return ConfigError(f"{key}: {cls.__module__}.{cls.__qualname__}.{call} {problem}", key)


def metric_directions(source) -> dict[str, bool]:
    """Whether higher is better, for each quantity whose direction a source (a `Task`, or any object with
    ``metric`` and ``higher_is_better``) states: the loss, its headline metric and those it also reports."""
    return {"loss": False, getattr(source, "metric", "loss"): getattr(source, "higher_is_better", False),
            **getattr(source, "also_reported", {})}


class Task:
    """Base class. Subclasses set ``name``, ``vocab_size``, ``head`` (``lm | regress | classify``),
    ``num_classes`` (classify only), ``metric`` (the headline metric's name) and ``higher_is_better``."""

    name: str = ""
    vocab_size: int = 0
    head: str = "lm"
    num_classes: int = 0
    metric: str = "loss"
    #: other metrics a comparison may take as its headline (compare.metric), each with whether higher is better
    also_reported: dict[str, bool] = {}
    higher_is_better: bool = False
    max_length: int | None = None   # longest length the task can generate (None: unbounded)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def digest(self) -> str | None:
        """A digest of the data the task samples from, which a checkpoint keeps so that a resume on other data is
        refused; None for a task generated from the seed alone."""
        return None

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-position metrics, each (B, L) float with NaN where undefined, or per-sequence (B,) for
        ``classify`` tasks. ``output`` is the model head's output: (B, L, V) logits for ``lm``, (B, L)
        predictions for ``regress``, (B, C) logits for ``classify``."""
        raise NotImplementedError

    def batch_metrics(self, values: dict[str, torch.Tensor], batch: Batch) -> dict[str, float]:
        """Metrics of a whole evaluation batch (e.g. a ROC AUC) from ``values``, the batch's per-sequence and
        per-position values (``loss`` and `metrics`, on the CPU); none by default."""
        return {}

    def undefined(self, metric: str, batch: Batch) -> str | None:
        """Why ``metric`` is NaN over ``batch`` (a few words for reports), where the task knows; None by default."""
        return None

    def chance(self, metric: str, length: int) -> torch.Tensor | float | None:
        """The chance level of ``metric`` (``loss`` or a metric of `metrics`) at ``length``: the expected
        value of the best predictor that knows the task's format and each position but not the sampled
        tokens (the trivial baseline). A (length,) float64 tensor per position, NaN where the metric is
        undefined, or a float (the same at every position), for per-position metrics; a float for per-sequence
        ones; None where the task defines none."""
        return None
