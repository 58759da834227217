"""Command line: ``lengthgen <command> ...`` (also ``python -m lengthgen <command> ...``).

Each subcommand is one function decorated with `command`, whose docstring is its help and whose
``add_arguments`` callback declares its options. Add ``eval``, ``compare``, ``report``, ``bench``, ``theory``
or ``retrofit`` the same way::

    def _eval_args(p): p.add_argument("run")
    @command("eval", _eval_args)
    def eval_command(args) -> int: ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

Handler = Callable[[argparse.Namespace], int]
#: name -> (add_arguments, handler)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler]] = {}


def command(name: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``handler(args) -> exit code`` as subcommand ``name``."""
    def register(handler: Handler) -> Handler:
        COMMANDS[name] = (add_arguments, handler)
        return handler
    return register


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set key=value`` (shared by commands that take a run config)."""
    p.add_argument("--config", "-c", help="TOML config (e.g. configs/counting.toml); defaults if omitted")
    p.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.attention=l2 --set train.steps=200 "
                        "(values are TOML literals, else strings)")


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", "-o", help="run folder (default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("train", _train_args)
def train_command(args: argparse.Namespace) -> int:
    """Train a model from a TOML config (+ --set overrides) into a run folder."""
    from lengthgen.config import load_config
    from lengthgen.train import train

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / (cfg.name or (Path(args.config).stem if args.config
                                                                        else "run"))
    result = train(cfg, out, progress=not args.no_progress, resume=args.resume)
    final = f"{result.history[-1]:.4g}" if result.history else "n/a"
    print(f"trained {result.step} steps; final loss {final}; run folder {result.run_dir}")
    for length, values in result.metrics.get("eval", {}).items():
        print(f"  eval at length {length}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lengthgen", description="Length generalization of attention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_arguments, handler) in COMMANDS.items():
        help_text = (handler.__doc__ or "").strip().splitlines()[0] if handler.__doc__ else None
        p = sub.add_parser(name, help=help_text, description=handler.__doc__)
        add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lengthgen`` script. Configuration errors exit with status 2 and a one-line message."""
    from lengthgen.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as err:
        print(f"lengthgen {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
