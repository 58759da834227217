"""What a run resolves and checks before its first step: the config completed from its data source, the lengths
and DDP shares it can use, its device and its autocast dtype, and what a resumed run may change. Everything here
fails with `ConfigError`."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lengthgen.config import ConfigError, ConfigWarning, counted, differences, raised_in_user_code, to_plain
from lengthgen.data.config import make_source
from lengthgen.data.tasks.base import Task, check_batch, check_declared, contract_error
from lengthgen.eval.evaluate import check_row_fits
from lengthgen.train.config import RunConfig, load_config


def as_config(config: RunConfig | dict | str | Path) -> RunConfig:
    """A `RunConfig` from a copy of one (checked again, as `GPT` checks its `GPTConfig`: fields may have been set
    since it was made, and the caller's later changes do not reach the run), its dict or a TOML / JSON path;
    anything else is a `ConfigError`."""
    if isinstance(config, RunConfig):
        return RunConfig.from_dict(config.to_dict())
    if isinstance(config, dict):            # its paths (data.text.corpus, train.init_from) as strings
        return RunConfig.from_dict(to_plain(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a RunConfig, its dict or the path of a TOML or JSON file, got "
                          f"{type(config).__name__}")
    return load_config(config)


def fill_model_from_source(cfg: RunConfig, source: Any) -> RunConfig:
    """Set model.vocab_size / head / num_classes from the data source (errors if they contradict it, or, naming the
    source, if its own are not valid: those and, for a task, its other declared attributes, `check_declared`)."""
    if isinstance(source, Task):
        check_declared(source)
    model = cfg.model
    head = getattr(source, "head", "lm")
    name = getattr(source, "name", cfg.data.task)
    if model.head is not None and model.head != head:
        raise ConfigError(f"model.head={model.head!r} does not fit the data: {name!r} needs head {head!r}")
    own = {"head": head, "vocab_size": source.vocab_size}
    if head == "classify":
        own["num_classes"] = source.num_classes
    try:                                    # the source's own values first, before any comparison with the config's
        model.replace(**own)
    except ConfigError as err:
        field = err.key.partition(".")[2]
        if field not in own:
            raise err.under("model") from None
        _, _, why = str(err).partition(" is not valid")
        raise contract_error(source, f"{field}={own[field]!r}", f"is not valid{why.removesuffix(', or none')}"
                             " (the model takes it from the task: its class or data.task_kwargs)") from None
    changes = dict(own)
    if model.vocab_size is not None:
        if model.vocab_size < own["vocab_size"]:
            raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the data's vocabulary "
                              f"({own['vocab_size']}); leave it unset to take it from the data")
        changes["vocab_size"] = model.vocab_size
    if head == "classify" and model.num_classes not in (0, own["num_classes"]):
        raise ConfigError(f"model.num_classes={model.num_classes} does not fit {name!r} ({own['num_classes']} classes)")
    try:
        return RunConfig(model.replace(**changes), cfg.train, cfg.data, cfg.name)
    except ConfigError as err:
        raise err.under("model") from None


def resolve(config: RunConfig | dict | str | Path) -> tuple[RunConfig, Any]:
    """(the config completed from its data source, the source), every length checked: all a run's checks that
    need no device. Raises `ConfigError` only."""
    cfg = as_config(config)
    source = make_source(cfg.data)
    cfg = fill_model_from_source(cfg, source)
    check_lengths(cfg, source)
    return cfg, source


def check_lengths(cfg: RunConfig, source: Any) -> None:
    """Every training and eval length must be one the data can generate and the memory hold (`check_length`)."""
    for key, lengths in (("data.length", [cfg.data.length]), ("train.stages", [s[1] for s in cfg.train.stages]),
                         ("train.eval_lengths", cfg.train.eval_lengths)):
        for length in lengths:
            check_length(source, key, length, cfg)


def check_length(source: Any, key: str, length: int, cfg: RunConfig | None = None) -> None:
    """``length`` must be within the source's ``max_length`` and sample (one sequence is drawn); else a
    `ConfigError` naming ``key``; the sequence must keep the Batch contract (`check_batch`). With
    ``cfg``, first `check_memory`."""
    max_length = getattr(source, "max_length", None)
    if max_length is not None and length > max_length:
        raise ConfigError(f"{key}: length {length} exceeds the data's maximum length {max_length}", key)
    if cfg is not None:
        check_memory(cfg, key, length)
    try:
        with warnings.catch_warnings():     # a probe: what the length's own batches say, they say when drawn
            warnings.simplefilter("ignore")
            batch = source.sample(1, length, torch.Generator().manual_seed(0))
    except ValueError as err:
        raise ConfigError(f"{key}: length {length}: {err}{raised_in_user_code(err)}", key) from None
    check_batch(source, batch, 1, length)


def check_world(cfg: RunConfig, world: int) -> None:
    """Under torchrun every step's global batch must split into ``world`` equal shares of >= grad_accum rows;
    FSDP2 (``train.parallel = "fsdp"``) shards the weights, which BEMA and QK-clip would need whole."""
    tc = cfg.train
    if tc.parallel == "fsdp":
        for key, on in (("train.bema.enabled", tc.bema.enabled), ("train.qk_clip", tc.qk_clip is not None)):
            if on:
                raise ConfigError(f"{key} does not work with train.parallel='fsdp' (it rescales or copies whole "
                                  "weights, which FSDP2 splits across ranks); use train.parallel='ddp'")
    for step in sorted({0, *(s[0] for s in tc.stages)}):
        batch = cfg.batch_size_at(step)
        if batch % world or batch // world < cfg.train.grad_accum:
            raise ConfigError(f"train: the batch of {batch} sequences at length {cfg.length_at(step)} does not "
                              f"split into {world} equal shares of at least train.grad_accum="
                              f"{tc.grad_accum} sequences (WORLD_SIZE={world}); change "
                              "train.batch_size / train.tokens_per_step or train.grad_accum")


def split_batch_notes(cfg: RunConfig, world: int) -> list[str]:
    """What differs from one full-batch pass when the step's batch is split into ``train.grad_accum`` micro-batches
    or ``world`` ranks (every other computation matches it to float error), and FSDP2 asked of one process."""
    notes = []
    if cfg.model.norm == "batch" and (cfg.train.grad_accum > 1 or world > 1):
        notes.append(f"model.norm='batch' normalizes each micro-batch (train.grad_accum={cfg.train.grad_accum}) and "
                     f"each rank ({world}) with its own statistics: losses and gradients differ from one pass over "
                     "the whole batch (no SyncBatchNorm)")
    if cfg.model.dropout > 0 and world > 1:
        notes.append(f"model.dropout={cfg.model.dropout}: every rank draws the same dropout masks (one seed)")
    if cfg.train.parallel == "fsdp" and world == 1:
        notes.append("train.parallel='fsdp' has no effect in one process (WORLD_SIZE=1): nothing is sharded; launch "
                     "with torchrun --nproc_per_node=N to shard across N ranks")
    return notes


def world_change_note(cfg: RunConfig, saved: int | None, world: int) -> str | None:
    """What resuming on ``world`` ranks a checkpoint written on ``saved`` (None: not recorded) changes beyond float
    rounding (another reduction order): batch norm's per-rank statistics and dropout's per-rank masks
    (`split_batch_notes`); None when nothing does."""
    if saved is None or saved == world:
        return None
    what = [text for text, on in (("model.norm='batch' (statistics per rank)", cfg.model.norm == "batch"),
                                  (f"model.dropout={cfg.model.dropout} (the same masks on every rank)",
                                   cfg.model.dropout > 0)) if on]
    if not what:
        return None
    again = f"under torchrun --nproc_per_node={saved}" if saved > 1 else "in one process"
    return (f"the checkpoint was written on {counted(saved, 'rank')}, this run has {counted(world, 'rank')}: with "
            f"{' and '.join(what)} the steps from here differ from an uninterrupted run's; resume {again} to continue "
            "it exactly")


def check_backend(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> None:
    """`ConfigError` when ``model.attention_backend`` (not ``auto``) cannot train a layer's attention on
    ``device``: found before the run folder is touched, not at the first step."""
    from lengthgen.attention import backends

    dtype = autocast_dtype(cfg.train, device.type) or torch.float32
    for attn in model.attentions:
        if attn.backend == "auto":
            continue
        # a one-row query: what backends check (device, dtype, head_dim) does not depend on the length
        q = torch.empty(1, attn.heads, 1, attn.head_dim, device=device, dtype=dtype)
        reason = backends.unsupported(attn.backend, attn.spec, q, True)
        if reason is not None:
            raise ConfigError(f"model.attention_backend={attn.backend!r} cannot train layer {attn.layer_index}'s "
                              f"attention on {device.type}: {reason}; use 'auto' (the fastest that can) or "
                              "another backend", "model.attention_backend")


#: keys a resumed run may change: they leave its training trajectory as it is (evaluation, checkpoints, logging,
#: speed; other threads or compile change the float rounding, so a bit-exact resume keeps them); every other
#: difference between a checkpoint's config and the resumed run's is refused
MAY_CHANGE_ON_RESUME = frozenset({
    "name", "train.eval_every", "train.eval_lengths", "train.eval_batches", "train.eval_batch_size",
    "train.checkpoint_every", "train.keep_checkpoints", "train.log_every", "train.compile", "train.threads"})


#: where a text corpus is read from: a resume may change them when the checkpoint's token digests say that the
#: training and evaluation data are the same (a corpus copied or moved, the cache switched on)
DATA_LOCATION = frozenset({"data.text.corpus", "data.text.val_corpus", "data.text.root", "data.text.cache",
                           "data.text.cache_dir"})


def check_resume(old: RunConfig, now: RunConfig, where: Path, *, step: int, extend: bool = False,
                 same_data: bool = False) -> dict[str, Any] | None:
    """Refuse (`ConfigError` naming every key) to resume at ``step`` from the config ``old`` (``where``'s) with
    ``now`` when they differ outside `MAY_CHANGE_ON_RESUME` (``train.init_from`` counts as changed only when it
    names another file); ``extend`` lets ``train.steps`` grow past ``step``; ``same_data`` (the checkpoint's
    token digests are the data's) lets the `DATA_LOCATION` keys change.
    Returns the ``metrics.jsonl`` entry recording such an extension (None: none)."""
    allowed = MAY_CHANGE_ON_RESUME | ({"train.steps"} if extend else set()) | (DATA_LOCATION if same_data else set())
    same_file = lambda a, b: Path(a).resolve() == Path(b).resolve()  # noqa: E731
    changed = [f"{key}: {where.name} {a!r}, now {b!r}" for key, a, b in differences(old.to_dict(), now.to_dict())
               if key not in allowed and not (key == "train.init_from" and a and b and same_file(a, b))]
    if changed:
        hint = " (--extend changes train.steps)" if any(d.startswith("train.steps:") for d in changed) else ""
        raise ConfigError(f"cannot resume {where.parent}: {'; '.join(changed)}{hint}; these set the training "
                          "trajectory: resume with the same values, or start over with --overwrite or another --out")
    if old.train.steps == now.train.steps:
        return None
    if now.train.steps <= step:
        raise ConfigError(f"train.steps={now.train.steps}: --extend needs more steps than the checkpoint's {step}",
                          "train.steps")
    return {"step": step, "extended": {"train.steps": [old.train.steps, now.train.steps]}}


def check_memory(cfg: RunConfig, key: str, length: int) -> None:
    """On the CPU (`inference_device`), one evaluation forward pass of ``cfg.model`` over one sequence of ``length``
    must fit the available memory (`lengthgen.eval.evaluate.check_row_fits`); else a `ConfigError` naming ``key``."""
    device = inference_device(cfg.train)
    check_row_fits(key, cfg.model, device, length, autocast_dtype(cfg.train, device))


def device_type(train: Any) -> str:
    """``"cuda"`` or ``"cpu"`` from ``train.device`` (``auto``: CUDA when available)."""
    if train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but CUDA is not available")
    return train.device


def inference_device(train: Any) -> str:
    """The device a run is evaluated or sampled on: `device_type`, or the CPU where it asks for CUDA and there is
    none here."""
    return "cpu" if train.device == "cuda" and not torch.cuda.is_available() else device_type(train)


def for_inference(model: torch.nn.Module, train: Any) -> tuple[torch.nn.Module, str]:
    """A loaded run's model on the device it is evaluated or sampled on, and that device: ``train.device``, or the
    CPU when it asks for CUDA and there is none here; a layer whose recorded ``model.attention_backend`` cannot
    run there falls back to ``auto`` (`fall_back_backends`). Both warn (`ConfigWarning`)."""
    kind = inference_device(train)
    if train.device == "cuda" and kind == "cpu":
        warnings.warn("the run trained with train.device='cuda'; CUDA is not available here, so it runs on the CPU",
                      ConfigWarning, stacklevel=2)
    fall_back_backends(model, kind, autocast_dtype(train, kind) or torch.float32)
    return model.to(kind), kind


def fall_back_backends(model: torch.nn.Module, kind: str, dtype: torch.dtype) -> None:
    """Each layer of ``model`` whose ``attention_backend`` cannot run on device ``kind`` at ``dtype`` (e.g. triton
    without CUDA) falls back to ``auto``, which matches the same dense oracle; a `ConfigWarning` names them."""
    from lengthgen.attention import backends

    failing: dict[str, list[int]] = {}
    for attn in model.attentions:
        q = torch.empty(1, attn.heads, 1, attn.head_dim, device=kind, dtype=dtype)
        reason = None if attn.backend == "auto" else backends.unsupported(attn.backend, attn.spec, q, False)
        if reason is not None:
            failing.setdefault(f"model.attention_backend={attn.backend!r} cannot run on {kind} ({reason})",
                               []).append(attn.layer_index)
            attn.backend = "auto"
    for reason, layers in failing.items():
        warnings.warn(f"{reason}; layers {', '.join(map(str, layers))} use 'auto', which matches the same dense "
                      "oracle", ConfigWarning, stacklevel=3)


def flush_denormals(on: bool = True) -> None:
    """Flush float32 denormals (magnitudes below 1.2e-38) to zero on CPU (`torch.set_flush_denormal`), as the
    ``lengthgen`` command does from its start and compare's worker processes with it. An attention weight
    exp(s - max) that small adds nothing at float32 precision, but Intel CPUs compute on denormals in slow
    microcode, and ALiBi's far keys (bias -m_h t) land there: on an Intel Xeon its training step at 4096 tokens took
    3.3x the baseline's, 1.4x with them flushed (log-bias 1.3x either way; AMD EPYC 1.1x without). Threads started
    before keep their own setting: call it before torch's first parallel work."""
    torch.set_flush_denormal(on)


def denormals_flushed() -> bool:
    """Whether this thread flushes float32 denormals to zero (`flush_denormals`)."""
    return torch.tensor(1e-39).item() == 0.0


@contextlib.contextmanager
def run_threads(train: Any) -> Iterator[None]:
    """torch's CPU threads set to ``train.threads`` (0: left as they are) inside, the caller's again after: what
    training, compare's, retrofit's, eval's and needle's evaluations run under."""
    saved = torch.get_num_threads()
    if train.threads:
        torch.set_num_threads(train.threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def autocast_dtype(train: Any, device_type: str) -> torch.dtype | None:
    """The dtype training and evaluation autocast to: bfloat16 when ``train.dtype`` says so, or by default
    (``auto``) on CUDA; None (float32) otherwise."""
    if train.dtype == "bfloat16" or (train.dtype == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


__all__ = ["DATA_LOCATION", "MAY_CHANGE_ON_RESUME", "as_config", "autocast_dtype", "check_length", "check_lengths",
           "check_memory", "check_resume", "check_world", "device_type", "fall_back_backends", "fill_model_from_source",
           "for_inference", "inference_device", "resolve", "run_threads", "world_change_note"]
