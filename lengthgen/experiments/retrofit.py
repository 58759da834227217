"""`lengthgen retrofit`: add a length-generalization mechanism to a trained model and finetune it briefly.

Seed 000 asks whether AVNorm (out-norm) can be added to an already-trained model: load the checkpoint into a
model with the new attention spec (``--set model.attention.out_norm=head_layer``), keep every existing weight,
initialize only the parameters the spec adds (a 2sigmoid gate starts at zero weight, i.e. the identity, so
the model starts exactly where it was), finetune ``steps`` steps with a fresh optimizer, and evaluate far beyond
the training length. Three variants separate the effect of the change from the effect of more training:

* ``before``: the checkpoint as it is;
* ``control``: finetuned from the checkpoint without the model change, with the same steps, optimizer,
  schedule, ``train.*`` overrides and data seeds as ``after``;
* ``after``: the retrofitted model, finetuned.

A finetuning that diverges counts, as in ``lengthgen compare``, as the worst value at every length.

The report folder has the layout of ``lengthgen compare`` (``results.json``, ``report.md``,
``extrapolation.png``, ``diagnostics.png``) plus the run folders ``finetune/`` (after) and ``control/``. Each
finetuning run is an ordinary `lengthgen.train.train` run with ``train.init_from`` set to the checkpoint, at the
original run's final training length (its ``train.stages`` are dropped), evaluated periodically only at the end
and checkpointed at the end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from lengthgen.config import MAX_SIZE, ConfigError, check_value, counted
from lengthgen.eval import Comparison, RunEval, eval_source, evaluate
from lengthgen.experiments.eval_run import checked_lengths
from lengthgen.experiments.jobs import evaluate_diverged, log_divergence
from lengthgen.model import GPT
from lengthgen.report import write_report
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train import NonFiniteLossError, load_run, train
from lengthgen.data.tasks.base import metric_directions
from lengthgen.train.config import RunConfig
from lengthgen.train.optim import build_optimizers
from lengthgen.train.run_folder import RunFolderError, check_fresh, load_newest, lock
from lengthgen.train.setup import autocast_dtype, device_type, resolve, run_threads
from lengthgen.train.weights import check_trained_data, load_initial_weights


def finetune_config(base: RunConfig, checkpoint: str | Path, steps: int, overrides: list[str] | tuple[str, ...] = ()
                    ) -> RunConfig:
    """The finetuning run's config: the checkpoint's config at its final training length, ``steps`` steps
    from the checkpoint's weights, then the user's ``overrides`` (which may change anything, e.g. the lr)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps={steps!r} is not valid; it must be an integer >= 1")
    train_length = max(base.lengths())
    defaults = [f"train.steps={steps}", f"data.length={train_length}", "train.stages=[]",
                f"train.warmup_steps={min(base.train.warmup_steps, steps // 10)}", "train.eval_every=0",
                "train.checkpoint_every=0"]
    plain, cfg = base.override(*defaults), base.override(*defaults, *overrides)
    by_key = {o.partition("=")[0].strip(): o for o in reversed(overrides)}     # each key's first --set
    table = " (a train table sets every train key; set them one by one, e.g. --set train.lr=1e-3)"
    for key, given in (("steps", "the finetuning steps are --steps"),
                       ("init_from", "the retrofit starts from its checkpoint argument")):
        if f"train.{key}" in by_key:
            raise ConfigError(f"--set {by_key[f'train.{key}']}: {given}")
        if getattr(cfg.train, key) != getattr(plain.train, key):           # set in a table, train={...}
            raise ConfigError(f"--set {by_key['train']}: {given}{table}" if "train" in by_key else
                              f"--set {overrides[0]}: {given}")
    return RunConfig(cfg.model, dataclasses.replace(cfg.train, init_from=str(checkpoint)), cfg.data,
                     f"{base.name or 'run'}-retrofit")


def run_retrofit(checkpoint: str | Path, out: str | Path, *, overrides: list[str] | tuple[str, ...] = (),
                 steps: int = 100, eval_lengths: list[int] | None = None, eval_tokens: int = 8192,
                 diagnostics: bool = True, progress: bool = True, overwrite: bool = False,
                 log: Callable[[str], None] = print) -> Comparison:
    """Retrofit ``checkpoint`` (a run folder or checkpoint) with the config ``overrides``, finetune it and the
    control ``steps`` steps, evaluate all three at ``eval_lengths`` (default: `checked_lengths`)
    with the one evaluator (seeded with the finetuning run's ``train.seed``, under its device and autocast) and
    write the report into ``out``, which must be empty (``overwrite``: emptied first). Returns the `Comparison`
    (variants ``before``, ``control``, ``after``)."""
    out = Path(out)
    ckpt, (base_cfg, before_model) = load_newest(checkpoint, load_run)
    if ckpt.resolve().is_relative_to(out.resolve()):
        raise RunFolderError(f"{out} holds the checkpoint {ckpt} that is retrofitted; choose another --out")
    cfg = finetune_config(base_cfg, ckpt, steps, overrides)
    if cfg.model == base_cfg.model:
        raise ConfigError("the --set keys leave the model as it is, so the retrofit would equal its control; set "
                          "a model key, e.g. --set model.attention.out_norm=head_layer")
    control_cfg = dataclasses.replace(cfg, model=base_cfg.model, name=f"{base_cfg.name or 'run'}-control")
    kind = device_type(cfg.train)
    # fail before any evaluation when the new config changes more than added attention parameters, or has
    # optimizer keys that do not apply to the control's or the retrofitted model
    torch.manual_seed(cfg.train.seed)
    retrofitted = GPT(cfg.model)
    added = load_initial_weights(retrofitted, ckpt)["added"]
    build_optimizers(retrofitted, cfg.train)
    build_optimizers(before_model, control_cfg.train)
    train_length = max(cfg.lengths())
    eval_tokens = check_value("eval_tokens", eval_tokens, int, ge=1, le=MAX_SIZE)
    cfg, source = resolve(cfg)      # the checkpoint's model must fit data.* overrides: vocabulary and head
    check_trained_data(ckpt, source)
    eval_lengths = checked_lengths(cfg, source, eval_lengths, "eval_lengths")
    evaluated_on = eval_source(cfg.data, source)
    def evaluate_model(model: torch.nn.Module) -> RunEval:
        with run_threads(cfg.train):
            return evaluate(model, evaluated_on, eval_lengths, tokens_per_length=eval_tokens, seed=cfg.train.seed,
                            autocast=autocast_dtype(cfg.train, kind), diagnostics=diagnostics,
                            forward_tokens=cfg.train.eval_batch_size * train_length)   # as compare's and eval's

    with lock(out):
        check_fresh(out, overwrite=overwrite, resumable=False, kind="retrofit")
        log(f"[before] evaluating {ckpt} at {', '.join(map(str, eval_lengths))}")
        state = ckpt_io.read_state(ckpt)
        history = state.get("history", [])
        before = dataclasses.replace(evaluate_model(before_model.to(kind)), config=base_cfg.to_dict(),
                                     seed=base_cfg.train.seed, run_dir=str(ckpt), train_tokens=state.get("tokens"),
                                     final_train_loss=history[-1] if history else None)
        control = _finetune("control", control_cfg, out / "control", evaluate_model, progress, log)
        log(f"[after] retrofitting with {', '.join(overrides) if overrides else 'the same config'}")
        after = _finetune("after", cfg, out / "finetune", evaluate_model, progress, log)
        name = getattr(source, "name", cfg.data.task)
        attention = {"before": base_cfg.model.attention, "control": base_cfg.model.attention,
                     "after": cfg.model.attention}
        results = Comparison(
            title=f"lengthgen retrofit: {name}", source=name, metric=source.metric,
            higher_is_better=source.higher_is_better, directions=metric_directions(source),
            train_length=train_length, eval_lengths=eval_lengths,
            config=cfg.to_dict(), provenance=after.provenance,
            specs={variant: spec.to_dict() for variant, spec in attention.items()},
            variants={"before": [before], "control": [control], "after": [after]},
            description=_description(ckpt, overrides, steps, train_length, added),
            retrofit={"checkpoint": str(ckpt), "overrides": list(overrides), "steps": steps,
                      "added_parameters": added, "finetune_run": str(out / "finetune"),
                      "control_run": str(out / "control")})
        results.save(out / "results.json")
        write_report(results, out)
    return results


def _finetune(name: str, cfg: RunConfig, run_dir: Path, evaluate_model: Callable[[torch.nn.Module], RunEval],
              progress: bool, log: Callable[[str], None]) -> RunEval:
    """Train ``cfg`` (a finetuning config) into ``run_dir`` and evaluate the result; a run whose training diverges
    is evaluated as compare's are (`jobs.evaluate_diverged`: the worst value at every length)."""
    log(f"[{name}] finetuning {counted(cfg.train.steps, 'step')} at length {max(cfg.lengths())}")
    try:
        trained = train(cfg, run_dir, progress=progress)
    except NonFiniteLossError as err:
        resolved = resolve(cfg)[0]
        return dataclasses.replace(evaluate_diverged(resolved, evaluate_model, log_divergence(err, name, log)),
                                   config=resolved.to_dict(), seed=cfg.train.seed, run_dir=str(run_dir))
    trainer = trained.trainer
    added = (trainer.initialized_from or {}).get("added", [])
    log(f"[{name}] new parameters ({len(added)}): {', '.join(added) if added else 'none'}; evaluating")
    return dataclasses.replace(evaluate_model(trained.model), config=trained.config.to_dict(), seed=cfg.train.seed,
                               run_dir=str(trained.run_dir), train_seconds=trainer.train_seconds,
                               train_tokens=trainer.tokens,
                               final_train_loss=trained.history[-1] if trained.history else None)


def _description(ckpt: Path, overrides, steps: int, train_length: int, added: list[str]) -> str:
    """The report's paragraph under the title: what was retrofitted and how it was finetuned."""
    code = lambda names: ", ".join(f"`{n}`" for n in names)  # noqa: E731
    return (f"Checkpoint `{ckpt}` (variant **before**), retrofitted with {code(overrides) or 'no config change'} "
            f"and finetuned {counted(steps, 'step')} at length {train_length} with a fresh optimizer (variant "
            f"**after**; run folder `finetune/`). Variant **control** is finetuned the same way from the same "
            f"checkpoint without the model change (run folder `control/`). Parameters added (kept at their "
            f"initialization when loading): {code(added) or 'none'}.")


__all__ = ["finetune_config", "run_retrofit"]
