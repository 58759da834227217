"""The command line's shared parts: the command registry, argument types, the config and logging options."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from lengthgen.config import FLOAT32_MAX, MAX_SIZE


class CommandError(Exception):
    """A bad command-line argument; printed as a one-line error (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``lengthgen train: error: ...``), exit status 2."""

    def error(self, message: str):
        from lengthgen.train import distributed

        if distributed.reported_by_rank0(CommandError(message)):     # under torchrun: local rank 0 prints it
            distributed.leave_report()
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text: str, low: int, high: int, give: str, bounds: str = "") -> int:
    """``text`` as an integer in [``low``, ``high``], else argparse's one-line error saying to ``give`` one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give {give}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not valid; give {give}{bounds}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, MAX_SIZE, "a positive integer", f" up to {MAX_SIZE}")


def seed_int(text: str) -> int:
    """A seed as ``train.seed`` takes it: an integer from 0 to 2**63 - 1."""
    return _integer(text, 0, 2**63 - 1, "a seed from 0 to 2**63 - 1")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number >= 0") from None
    if not 0 <= value <= FLOAT32_MAX:       # floats fit float32, as config keys do (also refuses nan and inf)
        raise argparse.ArgumentTypeError(f"{text} is not valid; give a finite number >= 0, up to {FLOAT32_MAX:.3g}")
    return value


Handler = Callable[[argparse.Namespace], int]
#: name -> (add_arguments, handler)


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler]] = {}


def command(name: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``handler(args) -> exit code`` as subcommand ``name``."""
    def register(handler: Handler) -> Handler:
        COMMANDS[name] = (add_arguments, handler)
        return handler
    return register


CONFIG_HELP = "Every config key with its meaning and valid values: lengthgen config show [CONFIG] [--set ...]."


SEEDS_HELP = ("Seeds, the notes cited by number: 000 AVnorm (per-head output norm), 001 p-softmax (\"Attention\n"
              "Normalizes the Wrong Norm\"), 002 a note on normalization, 003 post-norm resharpens attention,\n"
              "004 long-context attention (sqrt(2 log n) logit scaling).")


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set key=value`` (shared by commands that take a run config)."""
    p.add_argument("--config", "-c", type=config_file, help="a TOML or JSON config file, or the name of one in "
                   "configs/ (counting for configs/counting.toml); defaults if omitted")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.attention=l2 --set train.steps=200 "
                        "(values are TOML literals, else strings; keys: lengthgen config show)")


def add_logging_arguments(p: argparse.ArgumentParser) -> None:
    """``--log-every``, ``--wandb`` and ``--no-progress`` (shared by the commands that train)."""
    p.add_argument("--log-every", type=int, metavar="N", help="log every N steps (sets train.log_every)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log to this Weights & Biases project (sets "
                   "train.wandb; needs pip install wandb; WANDB_MODE=offline works without a network)")
    p.add_argument("--no-progress", action="store_true",
                   help="plain log lines instead of a progress bar (the default when stdout is not a terminal)")


def config_file(text: str) -> str:
    """``--config`` (and ``config show``): a file, else ``configs/NAME.toml`` for a NAME without a suffix."""
    shipped = Path("configs") / f"{text}.toml"
    return str(shipped) if not Path(text).exists() and not Path(text).suffix and shipped.is_file() else text


def flag_overrides(args: argparse.Namespace, flags: dict[str, tuple[str, str | None]] | None = None) -> list[str]:
    """``args.overrides`` (``--set``) followed by the ``key=value`` that each given flag stands for: ``flags``
    (key -> (flag, TOML value or None when not given)) and ``--log-every`` / ``--wandb``. A key set both by
    ``--set`` and by its flag is a `CommandError` (one way to say each thing)."""
    from lengthgen.config import parse_assignment

    flags = dict(flags or {})
    flags["train.log_every"] = ("--log-every", None if args.log_every is None else str(args.log_every))
    flags["train.wandb"] = ("--wandb", None if args.wandb is None else json.dumps(args.wandb))
    given = {key: flag_value for key, flag_value in flags.items() if flag_value[1] is not None}
    for assignment in args.overrides:
        key = ".".join(part.strip() for part in parse_assignment(assignment)[0])
        if key in given:
            raise CommandError(f"--set {assignment} and {given[key][0]} both set {key}; give one of them")
    return list(args.overrides) + [f"{key}={value}" for key, (_, value) in given.items()]


def check_task_read(cfg, assignments: list[str]) -> None:
    """A `ConfigError` for ``--set data.task`` (or compare's ``--task``) on a text config: text never reads it, so
    the run would train on the corpus while the command line named a task."""
    from lengthgen.config import ConfigError, key_path, parse_assignment

    tasks = [value for key, value in map(parse_assignment, assignments) if key_path(key)[:2] == ("data", "task")]
    if tasks and cfg.data.kind == "text":
        raise ConfigError(f"data.task={tasks[-1]!r} is set, but data.kind='text' trains on the corpus in data.text "
                          "and does not read it: set data.kind=task (and data.text={}), or leave data.task out",
                          "data.task")


def warn_unused(cfg, lengths: list[int]) -> None:
    """A one-line warning (`ConfigWarning`) for each part of the run config the run never reaches at ``lengths``
    (those it trains and evaluates at; `RunConfig.unused`)."""
    from lengthgen.config import ConfigWarning

    for note in cfg.unused(lengths):
        warnings.warn(note, ConfigWarning, stacklevel=2)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 256,1024") from None
    if not values or min(values) < 1 or max(values) > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers up to {MAX_SIZE}, e.g. 256,1024")
    return values


def float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 0,0.5,1") from None


@contextlib.contextmanager
def no_transformers_bars():
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while a command that prints
    its own lines loads or saves a model (export, eval --hf, needle --hf); as they were after it. Nothing where
    transformers is not installed (the command names the missing package)."""
    try:
        from transformers.utils import logging
    except ImportError:
        logging = None
    shown = logging is not None and logging.is_progress_bar_enabled()
    if shown:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def report_written(out: Path, extra: str = "") -> str:
    """The last line of compare, retrofit and report: the report in ``out``, its plots and its results."""
    plots = ", ".join(sorted(path.name for path in out.glob("*.png")))
    return f"report: {out / 'report.md'} (plots {plots}; raw results.json{extra})"


def check_writable(path: Path, folder: bool = False, default: bool = False) -> None:
    """Refuse an --out where nothing can be written before the work, not after it: a file where a ``folder`` is
    written, a path under a file, or a read-only or forbidden folder (a file is created and removed in the nearest
    existing folder on the way to ``path``). A symbolic link to nothing is followed, as `lock` and export follow
    it: its target is checked; links in a loop are refused. A ``default`` path (no --out given) is named so."""
    said, hint = (f"{path} (the default --out)", " with --out") if default else (f"--out {path}", "")
    if folder and path.exists() and not path.is_dir():
        raise CommandError(f"{said} is a file; give a folder{hint}")
    under = f"; give another folder{hint}" if default else ""
    _refuse_under_file(path, said, under)
    try:
        path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CommandError(f"{said}: its symbolic links lead in a loop; give another path{hint}") from None
    written = path if folder else path.parent
    real = Path(os.path.realpath(written))
    if real != Path(os.path.abspath(written)):      # through a link (to nothing: what it names is made there)
        written = real
    nearest = next((p for p in (written, *written.parents) if p.exists()), Path("."))
    if not nearest.is_dir():
        raise CommandError(f"{said}: {nearest} is a file, not a folder{under}")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as err:
        raise CommandError(f"{said}: nothing can be written in {nearest} "
                           f"({(err.strerror or str(err)).lower()}); choose another path{hint}") from None


def writing(path: Path, source: str | None = None) -> contextlib.AbstractContextManager:
    """The lock of ``path``'s folder when lengthgen writes there (it has a lock file), else nothing; refuses
    what `refuse_out` refuses."""
    from lengthgen.train.run_folder import LOCK, lock

    refuse_out(path, source)
    return lock(path.parent) if (path.parent / LOCK).exists() else contextlib.nullcontext()


def _refuse_under_file(path: Path, said: str = "", hint: str = "") -> None:
    """`CommandError` for an --out under a file (found now, not when the work is done); the message names the
    path as ``said`` (default ``--out PATH``) and ends with ``hint``."""
    under_file = next((f for f in path.parents if f.exists() and not f.is_dir()), None)
    if under_file is not None:
        raise CommandError(f"{said or f'--out {path}'}: {under_file} is a file, not a folder{hint}")


def refuse_out(path: Path, source: str | None = None) -> None:
    """`CommandError` for an --out that is a folder, under a file, inside a lengthgen folder's subfolders
    (checkpoints, logs), a run's own file other than its evaluations, or an existing file of any folder but
    ``source`` (the evaluated run folder or checkpoint) in a folder lengthgen wrote."""
    from lengthgen.train.run_folder import LOCK, WRITTEN, enclosing_folder

    if path.is_dir():
        raise CommandError(f"--out {path} is a folder; give a file path")
    _refuse_under_file(path)
    if not (path.parent / LOCK).exists():
        inside = enclosing_folder(path)
        if inside is not None:          # e.g. a checkpoint's model.safetensors: resuming would find it damaged
            raise CommandError(f"--out {path} is inside the folder {inside} that lengthgen wrote (checkpoints, "
                               "logs); choose a file outside it, or directly in it")
        return
    if path.name in WRITTEN - {"eval.json", "eval_bema.json"}:
        raise CommandError(f"--out {path} would replace a file of the run; choose another file name")
    if path.exists() and (source is None or not Path(source).resolve().is_relative_to(path.parent.resolve())):
        raise CommandError(f"--out {path} is another run's {path.name}; choose another file name")
