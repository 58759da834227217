"""`lengthgen retrofit`: add a length-generalization mechanism to a trained model and finetune it briefly.

Seed 000 asks whether AVNorm (out-norm) can be added to an already-trained model: load the checkpoint into a
model with the new attention spec (``--set model.attention.out_norm=head_layer``), keep every existing weight,
initialize only the parameters the spec adds (a 2sigmoid gate starts at zero weight, i.e. the identity, so
the model starts exactly where it was), finetune ``steps`` steps with a fresh optimizer, and evaluate before
and after far beyond the training length. The report folder has the layout of ``lengthgen compare``:
``results.json`` (variants ``before`` and ``after``), ``report.md``, ``extrapolation.png``,
``diagnostics.png``, plus ``finetune/`` (the finetuning run folder).

The finetuning run is an ordinary `lengthgen.train.train` run with ``train.init_from`` set to the checkpoint,
at the original run's final training length (its ``train.stages`` are dropped), evaluated periodically only at
the end and checkpointed at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lengthgen.config import ConfigError
from lengthgen.data.config import make_source
from lengthgen.model import GPT
from lengthgen.train import checkpoint as ckpt_io
from lengthgen.train import load_run, train
from lengthgen.train.config import RunConfig
from lengthgen.train.trainer import load_initial_weights
from lengthgen.train.position_eval import evaluate_by_position, position_eval_source

MULTIPLES = (1, 2, 4, 8, 16)


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
    cfg = base.override(*defaults, *overrides)
    return RunConfig(cfg.model, dataclasses.replace(cfg.train, init_from=str(checkpoint)), cfg.data,
                     f"{base.name or 'run'}-retrofit")


def _device_and_autocast(cfg: RunConfig) -> tuple[torch.device, Callable[[], Any]]:
    tc = cfg.train
    cuda = tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if cuda and tc.dtype in ("auto", "bfloat16"):
        return device, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    if tc.dtype == "bfloat16":
        return device, lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return device, contextlib.nullcontext


def run_retrofit(checkpoint: str | Path, out: str | Path, *, overrides: list[str] | tuple[str, ...] = (),
                 steps: int = 100, eval_lengths: list[int] | None = None, eval_tokens: int = 8192,
                 seed: int = 0, diagnostics: bool = True, progress: bool = True,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Retrofit ``checkpoint`` (a run folder or checkpoint) with the config ``overrides``, finetune ``steps``
    steps, evaluate before and after at ``eval_lengths`` (default the training length x 1, 2, 4, 8, 16) and
    write the report into ``out``. Returns the results dict (``variants``: ``before``, ``after``)."""
    out = Path(out)
    ckpt = ckpt_io.find_checkpoint(checkpoint)
    base_cfg, before_model = load_run(ckpt)
    cfg = finetune_config(base_cfg, ckpt, steps, overrides)
    device, autocast = _device_and_autocast(cfg)
    before_model.to(device)
    # fail before any evaluation when the new config changes more than added attention parameters
    torch.manual_seed(cfg.train.seed)
    load_initial_weights(GPT(cfg.model), ckpt)
    train_length = max(cfg.lengths())
    eval_lengths = sorted(set(eval_lengths or [train_length * m for m in MULTIPLES]))
    if (out / "finetune" / ckpt_io.LATEST).exists():
        raise FileExistsError(f"{out / 'finetune'} already holds a finetuning run; choose another --out")
    out.mkdir(parents=True, exist_ok=True)

    source = make_source(cfg.data)
    task = position_eval_source(cfg.data, source)

    def evaluate(model) -> tuple[list[dict], float]:
        start = time.perf_counter()
        rows = evaluate_by_position(model, task, eval_lengths, tokens_per_length=eval_tokens, seed=1000 + seed,
                                    device=device, autocast=autocast, diagnostics=diagnostics)
        return rows, round(time.perf_counter() - start, 2)

    log(f"[before] evaluating {ckpt} at {', '.join(map(str, eval_lengths))}")
    before_rows, before_eval_s = evaluate(before_model)
    log(f"[after] finetuning {steps} steps at length {train_length} with "
        f"{', '.join(overrides) if overrides else 'the same config'}")
    start = time.perf_counter()
    trained = train(cfg, out / "finetune", progress=progress)
    train_s = round(time.perf_counter() - start, 2)
    added = (trained.trainer.initialized_from or {}).get("added", []) if trained.trainer else []
    log(f"[after] new parameters ({len(added)}): {', '.join(added) if added else 'none'}")
    log(f"[after] evaluating at {', '.join(map(str, eval_lengths))}")
    after_rows, after_eval_s = evaluate(trained.model.to(device))

    before_history = json.loads((ckpt / "state.json").read_text()).get("history", [])
    results: dict[str, Any] = {
        "config": cfg.to_dict(), "task": getattr(source, "name", cfg.data.task), "metric": source.metric,
        "higher_is_better": source.higher_is_better, "train_length": train_length, "eval_lengths": eval_lengths,
        "specs": {"before": base_cfg.model.attention.to_dict(), "after": cfg.model.attention.to_dict()},
        "retrofit": {"checkpoint": str(ckpt), "overrides": list(overrides), "steps": steps, "added_parameters": added,
                     "finetune_run": str(out / "finetune")},
        "variants": {
            "before": [{"seed": seed, "final_train_loss": before_history[-1] if before_history else None,
                        "eval_seconds": before_eval_s, "evals": before_rows}],
            "after": [{"seed": seed, "final_train_loss": trained.history[-1] if trained.history else None,
                       "train_seconds": train_s, "eval_seconds": after_eval_s, "evals": after_rows}],
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    from lengthgen.report import write_report

    write_report(results, out)
    report = out / "report.md"
    title, _, rest = report.read_text().partition("\n")
    header = [f"# lengthgen retrofit: {results['task']}", "",
              f"Checkpoint `{ckpt}` (variant **before**), retrofitted with "
              f"{', '.join(f'`{o}`' for o in overrides) or 'no config change'} and finetuned {steps} steps at "
              f"length {train_length} with a fresh optimizer (variant **after**; run folder `finetune/`). "
              f"Parameters added (kept at their initialization when loading): "
              f"{', '.join(f'`{n}`' for n in added) or 'none'}.", ""]
    report.write_text("\n".join(header) + rest.replace("lengthgen compare", "lengthgen retrofit"))
    return results


__all__ = ["finetune_config", "run_retrofit"]
