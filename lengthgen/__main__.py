"""``python -m lengthgen <command> ...`` (e.g. under torchrun) and the ``lengthgen`` script."""

import os
import signal
import sys

#: what Ctrl-C before the command starts prints (exit status 130)
STARTING = "lengthgen: interrupted while starting; nothing was written"


def _stop(signum, frame) -> None:
    print(STARTING, file=sys.stderr, flush=True)
    os._exit(130)


def main() -> int:
    """`lengthgen.cli.main`, which reports Ctrl-C in one line, with float32 denormals flushed to zero
    (`lengthgen.train.setup.flush_denormals`). While the command line is imported (torch, for
    seconds) Ctrl-C ends the process at once: a KeyboardInterrupt there is swallowed by torch's start (the command
    ran on) or aborts Triton's (a C++ terminate, core dumped); nothing is written yet. Once the command is over,
    Ctrl-C is ignored: it would interrupt the interpreter's exit (a traceback from an atexit callback)."""
    signal.signal(signal.SIGINT, _stop)
    try:
        from lengthgen.cli import main as run
        from lengthgen.train.setup import flush_denormals
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    flush_denormals()           # before torch starts its threads, which inherit it
    try:
        try:
            return run()
        finally:        # (also after argparse's error, a SystemExit) under torchrun, while the rank that reports
            distributed = sys.modules.get("lengthgen.train.distributed")     # this one's failure prints it
            if distributed is not None:
                distributed.linger()
    except KeyboardInterrupt:       # after the command's one line, or once its work is done and reported
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
