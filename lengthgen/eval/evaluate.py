"""The one evaluator: loss and metrics by position and by length, far beyond the training length.

`evaluate` runs a model the way nanoGPT's ``estimate_loss`` does, under the training context: on the device of
the model's parameters (every batch is moved there), under the training autocast dtype, in eval mode (the
previous mode is restored), without gradients. Every caller uses it: the trainer's periodic and final
evaluations, ``lengthgen compare``, ``lengthgen retrofit``, ``lengthgen eval`` and `lengthgen.hf.evaluate_hf`.

For each length L one batch of ``tokens_per_length // L`` sequences (at least one) is drawn and every per-position
quantity is averaged in power-of-2 position buckets (seed 000). NaN marks what is not scored (outside the loss mask,
or where a metric is undefined; the source's reason, where it gives one, in `LengthEval.undefined`). Where a scored
position's loss is NaN (the model's output was not finite), the loss and every metric whose direction the source
states take their worst value, +inf or -inf, with a warning, so that a failure is never left out of a mean. The
value "at length L" of a per-position quantity is its mean over positions ``[L//2, L)`` (0-based; the last bucket
only when L is a power of 2: at L = 100 it is ``[50, 100)``, the last bucket ``[64, 100)``): how the model does
at positions only that length reaches; its ``mean`` is over all positions ``[0, L)``.
Per-sequence metrics (classify tasks) are averaged over the batch; a task's `batch_metrics` (Tomita's ROC AUC) are
one value for the whole batch, kept like a per-sequence metric. A task's chance level of each quantity
(`lengthgen.data.tasks.Task.chance`) is averaged over the same positions and buckets.

Seeding rule (the only one for evaluation batches): the batch at length L for seed s is drawn from a
``torch.Generator`` seeded with ``step_seed(s, L, stream=EVAL_STREAM)``, i.e. numpy's ``SeedSequence([s, 1, L])``:
the per-(seed, index, stream) scheme of the training batches with the length as index and the evaluation
stream, so evaluation batches never coincide with training batches and do not depend on which other lengths are
evaluated. Callers pass the run's ``train.seed``, so a run's periodic evaluation, its ``eval.json``, compare and
retrofit see the same batches at the same length.

A model is evaluated through a ``measure(model, source, batch) -> {name: values}`` adapter: `measure_gpt` for
lengthgen models, `lengthgen.hf.measure_hf` for Hugging Face causal LMs.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from lengthgen.config import MAX_SIZE, ConfigError, check_value, counted, invalid
from lengthgen.data.config import step_generator
from lengthgen.data.tasks.base import Batch, check_batch, check_metrics, contract_error, metric_directions
from lengthgen.eval.buckets import bucket_means, prefix_means
from lengthgen.eval.diagnostics import STATS, model_diagnostics
from lengthgen.eval.results import Bucket, LengthEval, Provenance, RunEval
from lengthgen.memory import available_memory, gib
from lengthgen.model.config import GPTConfig
from lengthgen.model.gpt import forward_memory

#: the stream of evaluation batches in `step_seed` (training batches are stream 0)
EVAL_STREAM = 1

#: (model, source, batch on the model's device) -> name -> (B, L) per-position values (NaN where undefined)
#: or (B,) per-sequence values
Measure = Callable[[nn.Module, Any, Batch], dict[str, torch.Tensor]]


def eval_generator(seed: int, length: int) -> torch.Generator:
    """The generator of the evaluation batch at ``length`` (see the seeding rule above)."""
    return step_generator(seed, length, stream=EVAL_STREAM)


def measure_gpt(model: nn.Module, source: Any, batch: Batch) -> dict[str, torch.Tensor]:
    """A lengthgen `GPT`: ``loss`` is ``model.loss``'s unreduced loss (NaN outside the loss mask), then the
    source's own ``metrics``. An lm head's logits are taken a chunk of positions at a time (`GPT.logit_chunks`,
    each with its cut of the batch, `Batch.positions`), so a long evaluation never holds all (B, L, V) logits."""
    if model.head_kind != "lm":
        return _values(model, source, model(batch.tokens, doc_ids=batch.doc_ids), batch)
    x = model.features(batch.tokens, batch.doc_ids)
    parts = [_values(model, source, logits, batch.positions(lo, hi)) for lo, hi, logits in model.logit_chunks(x)]
    return {name: torch.cat([part[name] for part in parts], dim=1) for name in parts[0]}


def _values(model: nn.Module, source: Any, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
    """`measure_gpt`'s values of the model's ``output`` on ``batch``."""
    _, per_item = model.loss(output, batch)
    values = {"loss": per_item if per_item.dim() == 1 else per_item.masked_fill(~batch.loss_mask, math.nan)}
    if hasattr(source, "metrics"):
        metrics = source.metrics(output.float(), batch)
        check_metrics(source, metrics, per_item.shape)
        values.update(metrics)
    return values


def _at_length(values: torch.Tensor) -> float:
    """Mean over positions [L/2, L) (NaN ignored); the whole batch for per-sequence values."""
    return float(values.nanmean() if values.dim() == 1 else values[:, values.shape[-1] // 2:].nanmean())


def _chance(source: Any, values: dict[str, torch.Tensor], length: int
            ) -> tuple[dict[str, float], dict[str, list[Bucket]]]:
    """The source's chance level of each value at ``length`` over the positions of ``_at_length``, and by bucket
    for per-position values (a float: the same at every position; none for sources without ``chance``)."""
    chance = getattr(source, "chance", None)
    at_length, buckets = {}, {}
    for name, v in values.items():
        level = chance(name, length) if chance is not None else None
        if level is None:
            continue
        level = torch.as_tensor(level, dtype=torch.float64)
        if v.dim() == 2 and level.dim() == 0:       # one level at every position
            level = level.expand(length)
        if (level.shape != (length,)) if v.dim() == 2 else level.numel() != 1:
            raise contract_error(source, f"chance({name!r}, {length})", f"returned {tuple(level.shape)}; it must be "
                                 + (f"a float or a ({length},) tensor (per position)" if v.dim() == 2 else
                                    "a float (the metric is per sequence)") + ", or None (Task.chance)")
        if v.dim() == 1:
            at_length[name] = float(level)
        else:
            at_length[name], buckets[name] = _at_length(level[None]), bucket_means(level[None])
    return at_length, buckets


def rows_at_once(config: Any, device: str, rows: int, length: int, forward_tokens: int | None,
                 autocast: torch.dtype | None, row: int | None = None) -> int:
    """Rows per forward pass of a batch of ``rows`` sequences of ``length``: ``forward_tokens // length`` (None:
    all; at least one), and on the ``"cpu"`` no more than half the available memory holds (`available_memory`: the
    host's, or the cgroup's where less) at ``row`` bytes a row at least (default: `forward_memory` of a lengthgen
    model's `GPTConfig` ``config``; another model's unknown: unchecked). The values are the same row by row. A
    MemoryError naming the length, the memory it needs and the memory available (and the cgroup, where its limit is
    what bounds it) when not even one row fits beside the batch: Linux would kill the process instead, with no
    message."""
    step = rows if forward_tokens is None else max(1, forward_tokens // length)
    if row is None and isinstance(config, GPTConfig):
        row = forward_memory(config, length, 4 if autocast is None else 2)
    available = available_memory() if device == "cpu" and row is not None else None
    if row is None or available is None:
        return step
    free, bound = available
    batch = rows * length * 8           # token ids
    if batch + row > free:
        raise MemoryError(f"evaluating length {length} ({counted(rows, 'sequence')}) needs at least "
                          f"{gib(batch + row)} of memory, {gib(free)} available"
                          + (" under the cgroup (container) memory limit" if bound == "cgroup" else ""))
    return min(step, max(1, (free // 2 - batch) // row))


def check_row_fits(key: str, config: Any, device: str, length: int, autocast: torch.dtype | None = None,
                   row: int | None = None) -> None:
    """One sequence of ``length`` must fit (`rows_at_once` for one row); else a `ConfigError` naming ``key``, before
    anything runs."""
    try:
        rows_at_once(config, device, 1, length, None, autocast, row)
    except MemoryError as err:
        raise ConfigError(f"{key}: {err}", key) from None


def _measure(model, source, batch: Batch, device, context, measure: Measure, step: int) -> dict[str, torch.Tensor]:
    """``measure`` on the batch in forward passes of ``step`` rows."""
    rows = batch.tokens.shape[0]
    parts: list[dict[str, torch.Tensor]] = []
    for lo in range(0, rows, step):
        with context():
            values = measure(model, source, batch.rows(lo, lo + step).to(device))
        parts.append({name: v.detach().float().cpu() for name, v in values.items()})
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def _failed(values: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor | None:
    """Where a scored position's (or sequence's) loss is NaN: the model's output was not finite there. None when
    nothing failed (or no loss is measured)."""
    loss = values.get("loss")
    if loss is None:
        return None
    failed = loss.isnan() & (batch.loss_mask if loss.dim() == 2 else True)
    return failed if bool(failed.any()) else None


def _worst(source: Any) -> dict[str, float]:
    """The worst value of each quantity whose direction the source states: +inf for the loss and lower-is-better
    metrics, -inf for higher-is-better ones."""
    return {name: -math.inf if higher else math.inf for name, higher in metric_directions(source).items()}


def _evaluate_length(model: nn.Module, source: Any, length: int, *, batch_size: int, seed: int,
                     context: Callable[[], Any], measure: Measure, step: int, diagnostics: bool) -> LengthEval:
    """One length (see the module docstring): ``context()`` wraps every forward pass, of ``step`` rows each;
    diagnostics are taken on the first sequence. The model must already be in eval mode."""
    device = _device(model)
    batch = source.sample(batch_size, length, eval_generator(seed, length))
    check_batch(source, batch, batch_size, length, fewer=True)
    values = _measure(model, source, batch, device, context, measure, step)
    failed = _failed(values, batch)
    if hasattr(source, "batch_metrics"):
        values.update({name: torch.tensor([value]) for name, value in source.batch_metrics(values, batch).items()})
    missing = [name for name in metric_directions(source) if name not in values and name != "loss"]
    if missing:
        raise contract_error(source, "metrics(output, batch)", f"gave no {', '.join(missing)}, which the task states "
                             f"(metric, also_reported); it gave {', '.join(values)} (with batch_metrics)")
    if failed is not None:      # never left out of a mean as if unscored: the worst value there
        worst = _worst(source)
        warnings.warn(f"at length {length} the model's output is not finite at {int(failed.sum())} scored "
                      f"{'positions' if failed.dim() == 2 else 'sequences'}: {', '.join(sorted(worst))} count "
                      "as their worst value (+-inf) there", stacklevel=2)
        for name in set(values) & set(worst):
            v = values[name]
            values[name] = v.masked_fill(failed, worst[name]) if v.shape == failed.shape else torch.full_like(
                v, worst[name])          # a batch metric (ROC AUC) of a batch with a failed sequence
    per_position = {name: v for name, v in values.items() if v.dim() == 2}
    describe = getattr(source, "describe", None)
    chance, chance_buckets = _chance(source, values, length)
    at_length = {name: _at_length(v) for name, v in values.items()}
    why = getattr(source, "undefined", lambda name, batch: None)
    reasons = {name: why(name, batch) for name, v in at_length.items() if math.isnan(v)}
    result = LengthEval(
        length=length, batch_size=int(batch.tokens.shape[0]),
        batch=describe(batch_size, length) if describe else counted(batch.tokens.shape[0], "sampled sequence"),
        at_length=at_length, undefined={name: r for name, r in reasons.items() if r},
        mean={name: float(v.nanmean()) for name, v in values.items()},
        buckets={name: bucket_means(v) for name, v in per_position.items()},
        prefix={name: prefix_means(v) for name, v in per_position.items()}, chance=chance,
        chance_buckets=chance_buckets)
    if diagnostics:
        one = batch.rows(0, 1).to(device)
        with context():
            layers = model_diagnostics(model, lambda: measure(model, source, one))
        result.diagnostics = [{stat: bucket_means(layer[stat].mean(0)) for stat in STATS if stat in layer}
                              for layer in layers]
    return result


def sequences(tokens_per_length: int, length: int) -> int:
    """How many sequences `evaluate` draws at ``length`` for ``tokens_per_length`` tokens (at least one)."""
    return max(1, tokens_per_length // length)


@torch.no_grad()
def evaluate(model: nn.Module, source: Any, lengths: list[int], *, tokens_per_length: int = 8192, seed: int = 0,
             autocast: torch.dtype | None = None, forward_tokens: int | None = None, diagnostics: bool = True,
             measure: Measure = measure_gpt, memory: Callable[[nn.Module, int], int] | None = None) -> RunEval:
    """Evaluate ``model`` on ``source`` at every length (ascending), diagnostics at the longest.

    ``autocast``: the training autocast dtype (None: none). ``forward_tokens``: at most this many tokens per
    forward pass (None: each length's batch at once; on the CPU no more than fit, `rows_at_once`). ``memory(model,
    length)``: the bytes ``measure`` holds at least over one row of ``length``, for a model that is not lengthgen's
    (a lengthgen model's is `forward_memory`; None: unchecked). Returns a `RunEval` with the seed, timing, parameter
    count and provenance; callers fill in the run's config and seeds. A length below 1, or a bad
    ``tokens_per_length``, ``seed``, ``autocast`` or ``forward_tokens``, is a `ConfigError` naming it; a length
    whose one sequence cannot fit the CPU's available memory a MemoryError.
    """
    lengths = sorted(set(check_value("lengths", listed(lengths), list[int], ge=1, le=MAX_SIZE)))
    check_value("tokens_per_length", tokens_per_length, int, ge=1)
    check_value("seed", seed, int, ge=0)
    check_value("forward_tokens", forward_tokens, int | None, ge=1)
    if autocast not in (None, torch.float16, torch.bfloat16):
        raise invalid("autocast", autocast, "None, torch.float16 or torch.bfloat16")
    _check_fits(model, source, measure)
    limit = getattr(source, "max_length", None)
    for length in lengths:
        if limit is not None and length > limit:
            raise ValueError(f"{getattr(source, 'name', 'the source')!r} cannot generate length {length} "
                             f"(max_length {limit})")
    # rows per forward pass at each length, found before any runs: a length that cannot fit fails here
    steps = {n: model_rows_at_once(model, sequences(tokens_per_length, n), n, forward_tokens, autocast, memory)
             for n in lengths}
    device = _device(model)

    def context():
        return contextlib.nullcontext() if autocast is None else torch.autocast(device.type, dtype=autocast)

    start, was_training = time.perf_counter(), model.training
    model.eval()
    rows = []
    try:
        for length in lengths:
            rows.append(_evaluate_length(model, source, length, batch_size=sequences(tokens_per_length, length),
                                         seed=seed, context=context, measure=measure, step=steps[length],
                                         diagnostics=diagnostics and length == lengths[-1]))
    finally:
        model.train(was_training)
    return RunEval(rows, eval_seed=seed, provenance=Provenance.capture(device),
                   eval_seconds=round(time.perf_counter() - start, 2),
                   parameters=sum(p.numel() for p in model.parameters()))


def listed(values: Any) -> Any:
    """``values`` as a list when it is a list, tuple or range, else as it is, for `check_value` to name (``list(32)``
    would be a TypeError, ``list("32")`` two lengths)."""
    return list(values) if isinstance(values, (list, tuple, range)) else values


def _check_fits(model: nn.Module, source: Any, measure: Measure = measure_gpt) -> None:
    """A ValueError when ``model`` is no torch module, ``source`` has no ``sample``, another model than a lengthgen
    one (with a ``head_kind``) has no ``measure`` of its own, or a lengthgen model cannot run on ``source``: another
    head, or fewer token ids than the source uses (torch would fail deep inside the embedding, the loss or the
    metrics)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"evaluate: model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(source, "sample", None)):
        raise ValueError(f"evaluate: source must be a data source with sample(batch_size, length, generator) (a "
                         f"task: lengthgen.data.tasks.make_task(name)), got {type(source).__name__}")
    head = getattr(model, "head_kind", None)
    name = getattr(source, "name", "the source")
    if head is None and measure is measure_gpt:
        raise ValueError(f"evaluate: the model is a {type(model).__name__}, not a lengthgen GPT, which the default "
                         "measure (measure_gpt) reads; give measure=(model, source, batch) -> per-position values")
    if head is None:
        return
    needs = getattr(source, "head", "lm")
    if head != needs:
        raise ValueError(f"evaluate: the model's {head} head does not fit task {name!r}, which needs the {needs} head")
    vocab, used = getattr(getattr(model, "config", None), "vocab_size", None), getattr(source, "vocab_size", None)
    if vocab is not None and used is not None and vocab < used:
        raise ValueError(f"evaluate: the model embeds {vocab} token ids but task {name!r} uses {used}")


def model_rows_at_once(model: nn.Module, rows: int, length: int, forward_tokens: int | None,
                       autocast: torch.dtype | None, memory: Callable[[nn.Module, int], int] | None = None) -> int:
    """`rows_at_once` for ``model`` on its own device (its config, where lengthgen's, and ``memory``, as `evaluate`
    takes them): a MemoryError when not even one row of ``length`` fits."""
    return rows_at_once(getattr(model, "config", None), _device(model).type, rows, length, forward_tokens, autocast,
                        None if memory is None else memory(model, length))


def _device(model: nn.Module) -> torch.device:
    parameter = next(iter(model.parameters()), None)
    return torch.device("cpu") if parameter is None else parameter.device


__all__ = ["EVAL_STREAM", "Measure", "check_row_fits", "eval_generator", "evaluate", "measure_gpt",
           "model_rows_at_once", "rows_at_once", "sequences"]
