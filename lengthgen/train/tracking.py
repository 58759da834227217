"""What a run records about itself and where its numbers go besides ``metrics.jsonl`` (rank 0 only).

* ``run.json`` in the run folder: the parameter count and, for every start (a resume is a new start), the step
  it started at and its `lengthgen.eval.Provenance` (lengthgen version, git commit, torch version, device,
  date);
* the header printed at the start (`run_header`): model size, attention spec, data, steps, tokens per step,
  device and dtype, versions;
* TensorBoard events in ``tb/`` (``tensorboard --logdir runs``): every logged number, with the header and
  the resolved config as text;
* Weights & Biases when ``train.wandb`` names a project: the same numbers and the config; a resumed run
  continues its W&B run (its id is kept in ``run.json``). ``WANDB_MODE=offline`` logs without a network
  (``wandb sync`` uploads later).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lengthgen.atomic import atomic_write_text
from lengthgen.attention import FIELDS, PRESETS, AttentionSpec
from lengthgen.config import ConfigError, counted, toml_value
from lengthgen.eval import Provenance
from lengthgen.model.config import final_norm_note
from lengthgen.train.config import MUON_OPTIMIZERS, RunConfig
from lengthgen.train.run_folder import RunFolderError


def import_wandb(project: str) -> Any:
    """The ``wandb`` module; a one-line `ConfigError` with the install command when it is missing."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"train.wandb={project!r} needs the wandb package: pip install wandb "
                          "(or pip install 'lengthgen[wandb]')", "train.wandb") from None
    return wandb


def record_start(run_dir: Path, step: int, parameters: int, provenance: Provenance) -> dict[str, Any]:
    """Add this start (its step and provenance) to ``run_dir/run.json``; returns the file's content.
    `RunFolderError` names a damaged run.json (left as it is)."""
    path = Path(run_dir) / "run.json"
    try:
        info = json.loads(path.read_text()) if path.exists() else {"starts": []}
        if not (isinstance(info, dict) and isinstance(info.get("starts"), list)):
            raise ValueError("not a run record: a table with a list of starts")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunFolderError(f"{path} is unreadable ({err}); it records each start of the run (versions, "
                             "device): repair it, or move it away to start a new record") from None
    info["parameters"] = parameters
    info["starts"].append({"step": step, **dataclasses.asdict(provenance)})
    atomic_write_text(path, json.dumps(info, indent=1))
    return info


def spec_changes(spec: AttentionSpec) -> str:
    """The fields of ``spec`` that differ from the baseline preset, as ``field=value, ...``."""
    base = PRESETS["baseline"]
    return ", ".join(f"{f}={toml_value(getattr(spec, f))}" for f in FIELDS if getattr(spec, f) != getattr(base, f))


def attention_text(cfg: RunConfig) -> str:
    """The attention spec as its preset name (when it is one) and its fields that differ from baseline."""
    spec = cfg.model.attention
    name = next((n for n, preset in PRESETS.items() if preset == spec), "custom")
    text = f"{name} ({spec_changes(spec) or 'no change'} from baseline)"
    return text + ("; per-layer rules in model.layer_attention" if cfg.model.layer_attention is not None else "")


def text_size(cfg: RunConfig, source: Any) -> str:
    """`` (train split N documents, T tokens)`` of text data's token stream; '' for tasks."""
    if cfg.data.kind != "text" or not hasattr(source, "stream"):
        return ""
    stream = source.stream
    return (f" ({cfg.data.text.get('split', 'train')} split {counted(stream.num_documents, 'document')}, "
            f"{stream.num_tokens:,} tokens)")


def run_header(cfg: RunConfig, run_dir: Path, *, parameters: int, dtype: str, world: int, start: int,
               provenance: Provenance, data_size: str = "") -> str:
    """The lines printed when a run starts: what is trained on what (``data_size``: `text_size`), how long, where
    and with which versions."""
    m, t, d = cfg.model, cfg.train, cfg.data
    data = f"task {d.task} {toml_value(d.task_kwargs) if d.task_kwargs else ''}" if d.kind == "task" else \
        f"text {toml_value(d.text)}{data_size}"
    stages = "; stages " + ", ".join(f"{length} from step {s}" for s, length in t.stages) if t.stages else ""
    evals = ("evaluated at " + ", ".join(map(str, t.eval_lengths or [d.length]))) if t.eval_batches else \
        "no evaluation while training"
    every = f" every {t.adam_every} steps" if t.adam_every > 1 else ""
    optimizer = f"{t.optimizer} lr {t.muon_lr:g} (adamw lr {t.lr:g}{every} for the rest)" \
        if t.optimizer in MUON_OPTIMIZERS else f"{t.optimizer} lr {t.lr:g}{every}"
    resumed = f"; resuming at step {start}" if start else ""
    ranks = f" x {world} ranks" if world > 1 else ""
    commit = f" (git {provenance.git_commit[:10]})" if provenance.git_commit else ""
    trackers = "metrics.jsonl, TensorBoard tb/" + (f", W&B project {t.wandb}" if t.wandb else "")
    return "\n".join([
        f"run {run_dir}: {t.steps} steps x {cfg.tokens_per_step} tokens (length {cfg.length_at(0)}, batch "
        f"{cfg.batch_size_at(0)}{stages}){resumed}",
        f"  model: {parameters / 1e6:.2f}M parameters, {counted(m.layers, 'layer')} x {m.dim} wide, "
        f"{counted(m.heads, 'head')}, {m.norm} norm {m.norm_placement}"
        f"{final_norm_note(m.norm_placement, m.final_norm)}, {m.head} head",
        f"  attention: {attention_text(cfg)}",
        f"  data: {data.rstrip()}; {evals}",
        f"  optimizer: {optimizer}, {t.schedule} schedule, warmup {t.warmup_steps}; seed {t.seed}",
        f"  device: {provenance.device}{ranks}, {dtype}; lengthgen {provenance.lengthgen}{commit}, "
        f"torch {provenance.torch}",
        f"  logging: every {t.log_every} steps to {trackers}"])


class Trackers:
    """TensorBoard (always) and W&B (when ``train.wandb`` is set) for one run: `log` numbers, `close` at the end."""

    def __init__(self, run_dir: Path, cfg: RunConfig, start: int, header: str, info: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops the events after its checkpoint, which it logs again (as metrics.jsonl does); one
        # restarted at step 0 (no checkpoint yet) drops every step of the sessions before it
        self.tensorboard = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start + 1)
        self.tensorboard.add_text("run", _markdown(header), start)
        self.tensorboard.add_text("config", _markdown(cfg.to_json()), start)
        self.wandb = None
        if cfg.train.wandb:
            wandb = import_wandb(cfg.train.wandb)
            try:
                self.wandb = wandb.init(project=cfg.train.wandb, name=Path(run_dir).name, dir=str(run_dir),
                                        id=info.get("wandb_id"), resume="allow", config={**cfg.to_dict(), "run": info})
            except wandb.errors.UsageError as err:      # e.g. no API key: log in, or WANDB_MODE=offline
                self.tensorboard.close()
                raise ConfigError(f"train.wandb={cfg.train.wandb!r}: W&B refused to start ({err}); run wandb login, "
                                  "or set WANDB_MODE=offline to log without an account", "train.wandb") from None
            if info.get("wandb_id") != self.wandb.id:   # kept for a resume
                info["wandb_id"] = self.wandb.id
                atomic_write_text(Path(run_dir) / "run.json", json.dumps(info, indent=1))

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _markdown(text: str) -> str:
    """Preformatted text for TensorBoard's markdown text panel."""
    return "\n".join("    " + line for line in text.splitlines())


__all__ = ["Trackers", "attention_text", "import_wandb", "record_start", "run_header", "spec_changes", "text_size"]
