"""The results model: typed evaluation results, saved as JSON atomically and loaded back with clear errors.

* `LengthEval`: one evaluated length: per-position values in power-of-2 buckets, prefix means, the value "at
  length" (mean over positions ``[L/2, L)``), the ``mean`` over all positions, the task's chance level of each
  value, and optionally attention diagnostics.
* `RunEval`: one run's evaluation at several lengths, with the run's config, seeds, timings and `Provenance`
  (lengthgen version, git commit when available, torch version, device, date). A run folder's ``eval.json``.
* `Comparison`: runs of several variants on one source, headline metric and title (``results.json`` of
  ``lengthgen compare``; a retrofit is a comparison of ``before`` and ``after`` with its own title).
* `NeedleMap`: a retrieval map, a `NeedleCell` per (needle depth, context length) (``needle.json`` of
  ``lengthgen needle``; in a comparison, each run's ``RunEval.needle``).

Files hold ``{"schema": SCHEMA, "kind": "run" | "comparison" | "needle", ...}``; `RunEval.load`,
`Comparison.load` and `NeedleMap.load` raise `ResultsError` (a one-line message naming the file) for truncated,
foreign or other-schema files, for a value of the wrong type (naming its place) and for a comparison a report
cannot be made of.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import re
import subprocess
import types
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lengthgen.atomic import atomic_write_text
from lengthgen.config import differences
from lengthgen.version import __version__

#: version of the file format; files of another version are refused
SCHEMA = 1
#: evaluation lengths as multiples of the training length (compare, retrofit and ``lengthgen eval`` default)
MULTIPLES = (1, 2, 4, 8, 16)


class ResultsError(ValueError):
    """A results file that cannot be read: the message names the file and what is wrong with it."""


@dataclass
class Bucket:
    """Mean of a per-position value over positions ``[lo, hi)`` (0-based) and how many values it averages."""
    lo: int
    hi: int
    mean: float
    count: int


@dataclass
class Provenance:
    """Where and with what a result was computed."""
    lengthgen: str
    torch: str
    device: str
    date: str                      # ISO 8601, UTC
    git_commit: str | None = None  # of the lengthgen checkout, when it is one

    @classmethod
    def capture(cls, device: torch.device | str) -> "Provenance":
        device = torch.device(device)
        name = str(device)
        if device.type == "cuda":
            name += f" ({torch.cuda.get_device_name(device)})"
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(__version__, torch.__version__, name, now, _git_commit())


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    """HEAD of the git checkout lengthgen is imported from (None when it is not imported from one)."""
    package = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != package.parent:
        return None
    return lines[1]


@dataclass
class LengthEval:
    """One evaluated length. ``batch`` says what the ``batch_size`` sequences were (sampled sequences, long
    documents of a split). Value dicts map a name (``loss``, the source's metrics) to a number; per-sequence
    metrics (classify tasks) have no buckets. ``chance``: the source's chance level of a value (its trivial
    baseline, `lengthgen.data.tasks.Task.chance`) over the positions of ``at_length``, and ``chance_buckets``
    over each bucket; values without one (text, some metrics) are absent. ``undefined``: why a value is NaN, where
    the source says (Tomita's ROC AUC: one class at this length). ``diagnostics``: per layer, statistic ->
    buckets."""
    length: int
    batch_size: int
    batch: str
    at_length: dict[str, float]                # mean over positions [L/2, L); per-sequence: over the batch
    mean: dict[str, float]                     # mean over all positions [0, L)
    buckets: dict[str, list[Bucket]]
    prefix: dict[str, list[Bucket]]            # means over [0, P) for P = 1, 2, 4, ..., length
    diagnostics: list[dict[str, list[Bucket]]] = field(default_factory=list)
    chance: dict[str, float] = field(default_factory=dict)
    chance_buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    undefined: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LengthEval":
        rows = lambda named: {k: [Bucket(**b) for b in v] for k, v in named.items()}  # noqa: E731
        return cls(d["length"], d["batch_size"], d["batch"], d["at_length"], d["mean"], rows(d["buckets"]),
                   rows(d["prefix"]), [rows(layer) for layer in d.get("diagnostics", [])], d.get("chance", {}),
                   rows(d.get("chance_buckets", {})), d.get("undefined", {}))

    def value_text(self, name: str) -> str:
        """``name`` at length L as the terminal, the logs and the reports print it: 4 significant digits,
        ``undefined: why`` where the source says why it is NaN, else ``n/a``."""
        v = self.at_length.get(name, math.nan)
        if not math.isnan(v):
            return f"{v:.4g}"
        return f"undefined: {self.undefined[name]}" if name in self.undefined else "n/a"


@dataclass
class NeedleCell:
    """One cell of a retrieval map: ``samples`` sequences of ``length`` tokens with the needle(s) at ``depth``.
    Means over the sequences of each one's ``exact_match`` (fraction of its answers whose every token is the
    argmax: greedy decoding's exact match), ``token_accuracy`` (over its answer tokens) and ``answer_loss``
    (mean cross-entropy of its answer tokens, nats); ``chance``: each one's chance level where the source defines
    it."""
    depth: float
    length: int
    samples: int
    exact_match: float
    token_accuracy: float
    answer_loss: float
    chance: dict[str, float] = field(default_factory=dict)


@dataclass
class NeedleMap:
    """A retrieval map: a `NeedleCell` for every (depth, length) of ``depths`` x ``lengths`` (``cells`` ordered by
    length, then depth), ``needles`` needles per context, seeded with ``eval_seed``. ``source`` names the task or
    text; ``train_length`` marks the map (None: not known). ``config``, ``seed`` and ``run_dir`` describe the model
    (empty in a comparison, whose `RunEval` holds them)."""
    source: str
    needles: int
    depths: list[float]
    lengths: list[int]
    cells: list[NeedleCell]
    eval_seed: int
    provenance: Provenance
    train_length: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    run_dir: str | None = None
    eval_seconds: float | None = None
    bema: bool = False                                     # mapped with the run's BEMA weights (needle --bema)

    def grid(self, value: str) -> list[list[float]]:
        """``value`` (a `NeedleCell` field) by depth (rows) and length (columns)."""
        at = {(c.depth, c.length): getattr(c, value) for c in self.cells}
        return [[at[depth, length] for length in self.lengths] for depth in self.depths]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NeedleMap":
        d = dict(d)
        cells = [NeedleCell(**cell) for cell in d.pop("cells")]
        return cls(cells=cells, provenance=Provenance(**d.pop("provenance")), **d)

    def save(self, path: str | Path) -> Path:
        return _save(self, "needle", path)

    @classmethod
    def load(cls, path: str | Path) -> "NeedleMap":
        return _load(cls, "needle", path)


@dataclass
class RunEval:
    """One run's evaluation: a `LengthEval` per length (ascending) and what produced it."""
    lengths: list[LengthEval]
    eval_seed: int
    provenance: Provenance
    config: dict[str, Any] = field(default_factory=dict)   # the run's config (or the HF model and corpus)
    seed: int | None = None                                # the run's training seed (None: not a lengthgen run)
    run_dir: str | None = None
    bema: bool = False                                     # evaluated with the run's BEMA weights
    final_train_loss: float | None = None
    train_seconds: float | None = None
    eval_seconds: float | None = None
    parameters: int | None = None                          # the evaluated model's parameter count
    train_tokens: int | None = None                        # tokens the run trained on (None: not known)
    needle: NeedleMap | None = None                        # its retrieval map (compare.needle_depths)
    diverged: str | None = None     # why its training stopped (a non-finite loss): its values are the worst (+-inf)

    def at(self, length: int) -> LengthEval:
        """The evaluation at ``length`` (KeyError naming the evaluated lengths if there is none)."""
        for row in self.lengths:
            if row.length == length:
                return row
        raise KeyError(f"length {length} was not evaluated (evaluated: {[r.length for r in self.lengths]})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunEval":
        d = dict(d)
        lengths = [LengthEval.from_dict(row) for row in d.pop("lengths")]
        needle = d.pop("needle", None)
        return cls(lengths=lengths, provenance=Provenance(**d.pop("provenance")),
                   needle=None if needle is None else NeedleMap.from_dict(needle), **d)

    def save(self, path: str | Path) -> Path:
        return _save(self, "run", path)

    @classmethod
    def load(cls, path: str | Path) -> "RunEval":
        return _load(cls, "run", path)


@dataclass
class Comparison:
    """Variants (name -> one `RunEval` per seed) trained on one source at ``train_length`` and evaluated at
    ``eval_lengths``. ``metric`` is the headline; ``directions`` whether higher is better for each quantity
    whose direction the source states (`metric_directions`; empty in files written before it was kept);
    ``specs`` each variant's attention spec; ``config`` the shared config. ``title`` and ``description``
    (markdown) head the report; ``retrofit`` holds a retrofit's checkpoint, config changes, steps and added
    parameters."""
    title: str
    source: str
    metric: str
    higher_is_better: bool
    train_length: int
    eval_lengths: list[int]
    config: dict[str, Any]
    provenance: Provenance
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    variants: dict[str, list[RunEval]] = field(default_factory=dict)
    description: str = ""
    retrofit: dict[str, Any] | None = None
    directions: dict[str, bool] = field(default_factory=dict)

    def higher_is_better_for(self, name: str) -> bool | None:
        """Whether higher values of ``name`` are better (None: not recorded)."""
        return self.higher_is_better if name == self.metric else self.directions.get(name)

    def merge(self, other: "Comparison", name: str = "another comparison") -> None:
        """Add ``other``'s runs: new variants, and new seeds of a variant both hold. `ResultsError` (naming
        ``name`` and what differs) when the kind of experiment (a comparison, a retrofit, seed 000's protocol), the
        source, training length, eval lengths, metric or evaluated sequences (their number and kind at each length)
        differ, or when a variant both hold differs in its spec or its runs' configs (apart from ``train.seed``) or
        repeats a seed. Under seed 000's protocol (``retrofit`` with ``base_runs``) each seed starts from its own
        pretraining run: its ``train.init_from`` is the seed's too, and the protocol (pretraining and finetuning
        steps, bases) must match instead."""
        if _experiment(other.retrofit) != _experiment(self.retrofit):    # the report tells one protocol's story
            raise ResultsError(f"{name}: holds a {_experiment(other.retrofit)}, here a "
                               f"{_experiment(self.retrofit)}; cannot merge")
        for field_name in ("source", "train_length", "eval_lengths", "metric"):
            if getattr(other, field_name) != getattr(self, field_name):
                raise ResultsError(f"{name}: its {field_name} {getattr(other, field_name)!r} differs from "
                                   f"{getattr(self, field_name)!r}; cannot merge")
        per_seed = all(r is not None and "base_runs" in r for r in (self.retrofit, other.retrofit))
        if per_seed:
            found = differences(_protocol(self.retrofit), _protocol(other.retrofit), "retrofit")
            if found:
                key, a, b = found[0]
                raise ResultsError(f"{name}: ran another protocol ({key}: {a!r} here, {b!r} there); cannot merge")
        batches = {r.length: r for runs in self.variants.values() for r in runs[0].lengths}
        for row in (r for runs in other.variants.values() for run in runs for r in run.lengths):
            mine = batches.setdefault(row.length, row)
            if (mine.batch_size, _batch_kind(mine.batch)) != (row.batch_size, _batch_kind(row.batch)):
                raise ResultsError(f"{name}: evaluated at length {row.length} on {row.batch}, here on {mine.batch}; "
                                   "cannot merge evaluations of other text or of another number of sequences "
                                   "(compare --eval-tokens)")
        for variant, runs in other.variants.items():
            mine = self.variants.get(variant, [])
            found = differences(self.specs.get(variant), other.specs.get(variant), "spec") if mine else []
            found += [d for a in mine[:1] for b in runs
                      for d in differences(_unseeded(a.config, per_seed), _unseeded(b.config, per_seed))]
            if found:
                key, a, b = found[0]
                raise ResultsError(f"{name}: variant {variant!r} was run differently ({key}: {a!r} here, {b!r} "
                                   "there); cannot merge it under one name")
            repeated = sorted({a.seed for a in mine} & {b.seed for b in runs}, key=str)
            if repeated:
                raise ResultsError(f"{name}: variant {variant!r} holds seed(s) {repeated} in both; cannot merge")
        for variant, runs in other.variants.items():
            self.variants.setdefault(variant, []).extend(runs)
            self.specs.setdefault(variant, other.specs.get(variant, {}))
        if per_seed:
            base_runs = {**self.retrofit["base_runs"], **other.retrofit["base_runs"]}
            self.retrofit = {**self.retrofit, "base_runs": base_runs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Comparison":
        d = dict(d)
        variants = {name: [RunEval.from_dict(run) for run in runs] for name, runs in d.pop("variants").items()}
        return cls(variants=variants, provenance=Provenance(**d.pop("provenance")), **d)

    def save(self, path: str | Path) -> Path:
        return _save(self, "comparison", path)

    @classmethod
    def load(cls, path: str | Path) -> "Comparison":
        return _load(cls, "comparison", path)


def _batch_kind(description: str) -> str:
    """What an evaluation batch holds, from its description, whatever the wording of the version that wrote it:
    the split of its long documents ("val", "train"), else e.g. "sampled sequence" or "packed row" (singular: older
    versions wrote "1 sampled sequences")."""
    split = re.search(r"\((\w+) split", description)
    return split.group(1) if split else description.split(" ", 1)[-1].split(" (")[0].removesuffix("s")


def _unseeded(config: dict[str, Any], per_seed_init: bool = False) -> dict[str, Any]:
    """A run's config without ``train.seed`` (what differs between the seeds of one variant), and without
    ``train.init_from`` when each seed starts from its own pretraining run (``per_seed_init``)."""
    drop = {"seed", "init_from"} if per_seed_init else {"seed"}
    train = {k: v for k, v in config.get("train", {}).items() if k not in drop}
    return {**config, "train": train}


def _experiment(retrofit: dict[str, Any] | None) -> str:
    """What a comparison's ``retrofit`` record says it is: a retrofit (before, after, control), a comparison of
    variants finetuned from pretrained bases (seed 000's protocol) or a comparison."""
    if retrofit is None:
        return "comparison"
    return "comparison finetuned from pretrained bases" if "pretrain_steps" in retrofit else "retrofit"


def _protocol(retrofit: dict[str, Any]) -> dict[str, Any]:
    """Seed 000's protocol record without its per-seed pretraining runs (``base_runs``)."""
    return {k: v for k, v in retrofit.items() if k != "base_runs"}


def _save(obj: Any, kind: str, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps({"schema": SCHEMA, "kind": kind, **dataclasses.asdict(obj)},
                                              indent=1))


def _load(cls: Any, kind: str, path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ResultsError(f"{path}: not a lengthgen results file (truncated or not JSON: {err})") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise ResultsError(f"{path}: not a lengthgen results file (no schema version)")
    if data["schema"] != SCHEMA:
        raise ResultsError(f"{path}: results schema version {data['schema']!r}; this lengthgen reads "
                           f"version {SCHEMA}")
    if data.get("kind") != kind:
        raise ResultsError(f"{path}: holds a {data.get('kind')!r} result, expected a {kind!r} result")
    body = {k: v for k, v in data.items() if k not in ("schema", "kind")}
    problem = _mistyped(body, cls, "") or _incomplete(body, kind)
    if problem:
        raise ResultsError(f"{path}: malformed {kind} result ({problem})")
    return cls.from_dict(body)


_SCALARS = {str: (str,), bool: (bool,), int: (int,), float: (int, float)}


def _mistyped(value: Any, hint: Any, where: str) -> str | None:
    """What in ``value`` (read from JSON) does not fit ``hint`` (a result's field type), naming where; None if
    it fits. A number is not a bool, and may be NaN or infinite (a diverged run's loss)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (types.UnionType, typing.Union):
        arm = next(a for a in args if a is not type(None))
        return None if value is None else _mistyped(value, arm, where)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            return f"{where or 'the file'}: expected an object, got {value!r:.40}"
        fields, hints = _fields(hint)
        unknown = sorted(set(value) - set(fields))
        missing = [n for n, f in fields.items() if n not in value
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if unknown or missing:
            return f"{where or 'the file'}: " + ("unknown key " + repr(unknown[0]) if unknown
                                                  else "missing key " + repr(missing[0]))
        found = (_mistyped(value[n], hints[n], f"{where}.{n}".lstrip(".")) for n in fields if n in value)
        return next((p for p in found if p), None)
    if origin is list:
        if not isinstance(value, list):
            return f"{where}: expected a list, got {value!r:.40}"
        return next((p for i, v in enumerate(value) if (p := _mistyped(v, args[0], f"{where}[{i}]"))), None)
    if origin is dict:
        if not isinstance(value, dict):
            return f"{where}: expected an object, got {value!r:.40}"
        return next((p for k, v in value.items() if (p := _mistyped(v, args[1], f"{where}.{k}"))), None)
    if isinstance(value, _SCALARS[hint]) and not (hint is not bool and isinstance(value, bool)):
        return None
    return f"{where}: expected {'a number' if hint is float else hint.__name__}, got {value!r:.40}"


@functools.cache
def _fields(cls: Any) -> tuple[dict[str, dataclasses.Field], dict[str, Any]]:
    """A result dataclass's fields by name and their resolved type hints."""
    return {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)


def _incomplete(body: dict[str, Any], kind: str) -> str | None:
    """What a well-typed comparison lacks for a report: positive lengths, ascending, none repeated, a variant, a run
    per variant, no seed twice in a variant, every run's evaluation at each of ``eval_lengths`` (once) holding
    ``metric``; None if nothing."""
    if kind != "comparison":
        return None
    lengths, metric = body["eval_lengths"], body["metric"]
    if body["train_length"] < 1 or not lengths or min(lengths) < 1:
        return f"train_length {body['train_length']} and eval_lengths {lengths}: need positive lengths"
    if (repeated := _repeated(lengths)) is not None:
        return f"eval_lengths {lengths} repeat length {repeated}"
    if lengths != sorted(lengths):          # the report's longest length is the last
        return f"eval_lengths {lengths} are not in ascending order"
    if not body["variants"]:
        return "no variants"
    for name, runs in body["variants"].items():
        if not runs:
            return f"variant {name!r} has no runs"
        for i, run in enumerate(runs):
            first = next(j for j, other in enumerate(runs) if other.get("seed") == run.get("seed"))
            if first < i and run.get("seed") is not None:       # one run counted as two seeds
                return f"variants.{name}[{i}] repeats seed {run['seed']} of variants.{name}[{first}]"
            evaluated = {row["length"]: row["at_length"] for row in run["lengths"]}
            lacking = sorted(set(lengths) - set(evaluated))
            if lacking:
                return f"variants.{name}[{i}] was not evaluated at length {lacking[0]}"
            if (repeated := _repeated([row["length"] for row in run["lengths"]])) is not None:
                return f"variants.{name}[{i}] was evaluated twice at length {repeated}"
            if (without := next((n for n in lengths if metric not in evaluated[n]), None)) is not None:
                return (f"metric {metric!r} is not among the values of variants.{name}[{i}] at length {without}: "
                        f"{', '.join(evaluated[without])}")
    return None


def _repeated(values: list[int]) -> int | None:
    """The first of ``values`` that occurs more than once, else None."""
    return next((v for v, count in Counter(values).items() if count > 1), None)


__all__ = ["Bucket", "Comparison", "LengthEval", "MULTIPLES", "NeedleCell", "NeedleMap", "Provenance", "ResultsError",
           "RunEval", "SCHEMA"]
