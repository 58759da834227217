"""Command line: ``lengthgen <command> ...`` (also ``python -m lengthgen <command> ...``).

The top layer: each command parses its arguments and calls the layers below (`lengthgen.experiments`,
`lengthgen.train`, `lengthgen.report`): `training` (train, compare, retrofit), `analysis` (report, eval, needle,
export, sample, theory, config), `bench`, `common` (the registry, argument types, shared options). A subcommand is
one function decorated with `command`, whose docstring is its help and whose ``add_arguments`` callback declares
its options::

    def _eval_args(p): p.add_argument("run")
    @command("eval", _eval_args)
    def eval_command(args) -> int: ...
"""

from __future__ import annotations

import argparse
import errno
import inspect
import os
import sys
import warnings
from pathlib import Path

from lengthgen.cli import training  # noqa: F401, I001 - registers train, compare, retrofit (listed first)
from lengthgen.cli import analysis  # noqa: F401 - registers report, eval, needle, export, sample, theory, config
from lengthgen.cli import bench  # noqa: F401 - registers bench
from lengthgen.cli.common import COMMANDS, CONFIG_HELP, SEEDS_HELP, CommandError, Parser, check_writable
from lengthgen.__main__ import STARTING
from lengthgen.memory import out_of_memory


def build_parser() -> argparse.ArgumentParser:
    from lengthgen.version import __version__

    parser = Parser(prog="lengthgen", description="Length generalization of attention.",
                    epilog=f"{CONFIG_HELP}\n{SEEDS_HELP}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lengthgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_arguments, handler) in COMMANDS.items():
        # the first paragraph, which a docstring may wrap over lines
        help_text = " ".join(inspect.cleandoc(handler.__doc__).split("\n\n")[0].split()) if handler.__doc__ else None
        p = sub.add_parser(name, help=help_text, description=inspect.cleandoc(handler.__doc__ or ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(handler=handler, parser=p)
    return parser


#: how a command that trains (or writes a report) goes on after an interruption
_AGAIN = {"train": " (the run continues from its last checkpoint with --resume)",
          "train-fresh": " (no checkpoint was written yet: --resume starts it again from step 0)",
          "compare": " (the comparison continues with --resume: finished runs are reused)",
          "retrofit": " (retrofit has no --resume: run it again with --overwrite)",
          "report": " (the results it reads are intact: run it again to write the whole report)"}


#: options whose empty value ('' from an empty shell variable) would silently mean their default; what to give
_NOT_EMPTY = {"out": "a path", "config": "a config file or a name in configs/", "variants": "comma-separated names",
              "bases": "comma-separated names", "corpus": "a corpus", "tokenizer": "a tokenizer"}


#: the commands whose --out is a file (a results JSON); every other command's --out is a folder
_FILE_OUT = ("eval", "bench")


def _again(args: argparse.Namespace) -> str:
    """How the interrupted or failed command goes on (`_AGAIN`); nothing when its --out folder was not made."""
    out = getattr(args, "out", None)
    if out and not os.path.isdir(out):
        return ""
    if args.command == "train" and out:
        from lengthgen.train.checkpoint import complete_checkpoints
        if not complete_checkpoints(out):
            return _AGAIN["train-fresh"]
    return _AGAIN.get(args.command, "")


def main(argv: list[str] | None = None) -> int:
    """The command line (the ``lengthgen`` script and ``python -m lengthgen`` run it through `lengthgen.__main__`,
    which first guards its imports against Ctrl-C). User errors (arguments, configs, results files, run folders,
    checkpoints, missing optional packages, paths that are files where folders belong or the reverse) exit with
    status 2 and a one-line message, a diverged run (non-finite loss) with status 1 and one line, Ctrl-C with 130
    and one line, running out of memory or disk space with status 1 and one line (``error: [l2 seed 0] ...`` when
    it came from a comparison's run); run folder and config warnings are one line too. Under torchrun a line that
    every rank would print alike is printed by rank 0 alone (`distributed.reported_by_rank0`); the process group is
    left at the end."""
    try:
        from lengthgen.config import ConfigError, ConfigWarning
        from lengthgen.eval import ResultsError
        from lengthgen.model.gpt import NonFiniteLogitsError
        from lengthgen.optional import MissingPackageError
        from lengthgen.train import NonFiniteLossError, distributed
        from lengthgen.train.checkpoint import CheckpointError
        from lengthgen.train.run_folder import RunFolderError, RunFolderWarning

        args, unknown = build_parser().parse_known_args(argv)
    except KeyboardInterrupt:       # before the command (the parser imports each command's options' choices)
        print(STARTING, file=sys.stderr)
        return 130
    if unknown:        # named by the command's own parser, which says `lengthgen train: error: ...`
        usage = args.parser.format_usage()
        hint = "; config keys are set with --set KEY=VALUE, e.g. --set train.steps=100" \
            if any(a.startswith("--") or "=" in a for a in unknown) and "--set" in usage else ""
        if any(a.endswith((".toml", ".json")) for a in unknown) and "--config" in usage:
            hint = "; a config file is given with --config FILE (-c FILE)"
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    for option, give in _NOT_EMPTY.items():     # an empty shell variable: not the current folder, nor the default
        if getattr(args, option, None) == "":
            args.parser.error(f"argument --{option}: '' is empty; give {give}")
    with warnings.catch_warnings():
        show = warnings.showwarning

        def one_line(message, category, *rest):
            if not issubclass(category, (RunFolderWarning, ConfigWarning)):
                return show(message, category, *rest)
            print(f"lengthgen {args.command}: warning: {message}", file=sys.stderr)

        warnings.showwarning = one_line

        def report(err: BaseException, message: str) -> None:
            run = getattr(err, "run_label", None)       # the run of a comparison it came from (`Runner.run`)
            if run is not None and message.startswith("error: "):
                message = f"error: [{run}] {message.removeprefix('error: ')}"
            if not distributed.reported_by_rank0(err):
                print(f"lengthgen {args.command}: {message}", file=sys.stderr)
            elif not isinstance(err, KeyboardInterrupt):    # (torchrun stops every rank on Ctrl-C)
                distributed.leave_report()

        try:
            world = distributed.env_world()[1]
            if world > 1 and args.command != "train":   # each rank would run the whole command
                raise CommandError(f"{args.command} runs in one process, not under torchrun (WORLD_SIZE={world}): "
                                   "only train trains across processes; run it without torchrun (WORLD_SIZE unset)")
            if getattr(args, "out", None):      # found now, not when the work is done
                check_writable(Path(args.out), folder=args.command not in _FILE_OUT,
                               default=args.out == args.parser.get_default("out"))
            return args.handler(args)
        except (CommandError, ConfigError, ResultsError, RunFolderError, CheckpointError, MissingPackageError,
                FileNotFoundError) as err:
            report(err, f"error: {err}")
            return 2
        except (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError) as err:  # bad --out paths
            report(err, f"error: {err.filename}: {err.strerror.lower()}")
            return 2
        except (NonFiniteLossError, NonFiniteLogitsError) as err:   # diverged: not bad input, no traceback either
            report(err, f"error: {err}")
            return 1
        except KeyboardInterrupt as err:        # Ctrl-C: checkpoints on disk are intact (atomic writes)
            report(err, f"interrupted{_again(args)}")
            return 130
        except (MemoryError, RuntimeError) as err:
            what = out_of_memory(err)
            lost = distributed.lost_peer(err) if what is None else None
            if lost is not None:        # torchrun stops the others and names the rank that stopped first
                distributed.leave_report()
                report(err, f"error: another rank stopped ({lost}); it prints its own error, and torchrun names "
                            f"it{_again(args)}")
                return 1
            if what is None:
                raise
            report(err, f"error: out of memory ({what}); use shorter lengths, fewer tokens or a smaller "
                        f"batch{_again(args)}")
            return 1
        except BrokenPipeError:                 # `lengthgen config show | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except OSError as err:                  # a full disk: files are written atomically, the last ones stand
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {err.filename}" if err.filename else ""
            report(err, f"error: {os.strerror(err.errno).lower()}{where}; free some space{_again(args)}")
            return 1
        finally:
            distributed.cleanup()


__all__ = ["COMMANDS", "CommandError", "build_parser", "main"]
