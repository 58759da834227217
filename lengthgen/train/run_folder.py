"""The run folder: one writer at a time, and one rule for its files.

A run folder is what `lengthgen train` writes (``config.json``, ``metrics.jsonl``, ``latest.json``,
``checkpoints/``, ``eval.json``); compare, retrofit and report folders follow the same rules, and everything that
writes one (train, compare, retrofit, eval --out, report) holds its lock while it does.

* One writer: `lock` takes an exclusive ``fcntl.flock`` on the folder's ``.lengthgen.lock`` and writes the holder
  (pid, host, command, start) into it; a second writer gets `RunFolderError` naming the holder. flock rather than
  an ``O_EXCL`` file with a pid check: the kernel releases the lock when its process ends (``kill -9``
  included), so no lock is ever stale and no pid (perhaps reused, perhaps on another host) has to be judged alive.
  The file stays (deleting it would let two processes lock two different files). Under torchrun rank 0 holds it.
* No folder is written inside a run's ``checkpoints/`` (`outside_checkpoints`): the run would take it for one of
  its checkpoints, set it aside or rotate it away.
* Stale temporaries of an interrupted write (``checkpoints/step_N.tmp-*``, ``.NAME.*.tmp``) go when it is locked.
* Fresh or resume: a new run into a folder holding anything is refused (`check_fresh`) unless asked to overwrite,
  which deletes the files lengthgen writes first (and refuses a folder holding anything else).
* report, needle and theory replace their files (``report.md``, ...) only in a folder lengthgen wrote
  (`check_outputs`), and ``eval --out`` replaces only an earlier evaluation (`results_file`).
* Checkpoints are found by scanning: the newest complete ``checkpoints/step_N`` first, so a missing or damaged
  ``latest.json`` loses nothing. `load_newest` loads the newest one that reads back; a damaged one gives a
  `RunFolderWarning` naming the file, and a resuming writer keeps it aside as ``step_N.corrupt``.
* Metrics: on resume ``metrics.jsonl`` is cut back to the checkpoint's step (`cut_metrics`; a partial last line
  of an interrupted write goes too); its last evaluation up to there is the resumed run's (`last_evaluation`).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import warnings
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

from lengthgen.atomic import atomic_write_text, temporary
from lengthgen.config import ConfigError
from lengthgen.train.checkpoint import CHECKPOINTS, COMPLETE, CheckpointError, complete_checkpoints, saved_config
from lengthgen.train.config import RunConfig

LOCK = ".lengthgen.lock"
METRICS = "metrics.jsonl"
#: what lengthgen writes in its folders (run, compare, retrofit, report); overwriting deletes only these
WRITTEN = frozenset({"config.json", "run.json", METRICS, "latest.json", "checkpoints", "eval.json", "eval_bema.json",
                     "tb", "results.json", "report.md", "extrapolation.png", "diagnostics.png", "runs", "pretrain",
                     "finetune", "control", "needle.json", "needle.md", "needle.png", "wandb", "theory.json",
                     "theory.png"})
T = TypeVar("T")


class RunFolderError(Exception):
    """A folder that cannot be used as asked (in use, holding another run, no readable checkpoint); the message
    names the folder or file and what to do."""


class RunFolderWarning(UserWarning):
    """Something in a run folder was skipped or set aside (a damaged checkpoint); the message names it."""


class FolderLock:
    """The exclusive lock on a folder, held until `release` (or the process ends); a context manager, which
    removes the folder it ``created`` when an error ends it before anything else was written there."""

    def __init__(self, folder: Path, file: IO[str] | None, created: bool = False) -> None:
        self.folder, self._file, self.created = folder, file, created

    def release(self, failed: bool = False) -> None:
        """Release the lock; when ``failed`` (an error ends the command), first remove the folder if `lock` created
        it and nothing else was written there."""
        if failed and self._file is not None and self.created and [p.name for p in self.folder.iterdir()] == [LOCK]:
            (self.folder / LOCK).unlink()
            self.folder.resolve().rmdir()       # a symbolic link stays, as it was
        if self._file is not None:
            self._file.close()          # closing the file releases the flock
            self._file = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.release(failed=kind is not None)


def lock(folder: str | Path) -> FolderLock:
    """Lock ``folder`` (created if needed, where a symbolic link to nothing leads) for this process and remove its
    stale temporaries. `RunFolderError` names the holder when another process has it, a file there or on the way
    there, or a folder in a run's checkpoints (`outside_checkpoints`)."""
    folder = outside_checkpoints(folder)
    created = not folder.exists()
    try:
        folder.resolve().mkdir(parents=True, exist_ok=True)     # a symbolic link to nothing: the folder it names
    except (FileExistsError, NotADirectoryError):             # a file there or on the way
        file = next(p for p in (folder.resolve(), *folder.resolve().parents) if p.exists())
        raise RunFolderError(f"{folder}: {file} is a file, not a folder; choose another folder") from None
    file = os.fdopen(os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o666), "r+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = file.read()
        file.close()
        raise RunFolderError(f"{folder} is in use by another lengthgen process ({_holder(holder)}); wait for it "
                             "to end or choose another folder") from None
    except OSError as err:      # a file system without locks (some network mounts): go on unguarded
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        warnings.warn(f"{folder}: the file system cannot lock ({err.strerror}); a second writer would not be "
                      "refused", RunFolderWarning, stacklevel=2)
    file.truncate(0)
    file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(sys.argv),
                           "since": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
    file.flush()
    remove_temporaries(folder)
    return FolderLock(folder, file, created)


def outside_checkpoints(path: str | Path) -> Path:
    """``path``, a folder to write; `RunFolderError` when it is, or is inside, a run's ``checkpoints/`` (a run
    folder's: it holds the lock file), which the run rotates and sets aside as its own."""
    path = Path(path)
    inside = next((p for p in [path.resolve(), *path.resolve().parents]
                   if p.name == CHECKPOINTS and (p.parent / LOCK).exists()), None)
    if inside is not None:
        raise RunFolderError(f"{path} is inside {inside}, where the run {inside.parent} keeps and deletes its "
                             "checkpoints; choose a folder outside it")
    return path


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']} since {h['since']}: {h['command']}"
    except (ValueError, TypeError, KeyError):
        return "holder unknown"


#: an atomic write's temporary (`lengthgen.atomic`: tempfile's ``.NAME.``, 8 random characters, ``.tmp``)
_TEMPORARY = temporary()


def remove_temporaries(folder: Path) -> None:
    """Delete what an interrupted atomic write left: ``.NAME.XXXXXXXX.tmp`` files and ``checkpoints/step_N.tmp-*``
    (another program's hidden ``.tmp`` files in an --out folder are not lengthgen's to remove)."""
    written = [p for p in [*folder.glob(".*.tmp"), *folder.glob("checkpoints/.*.tmp")] if _TEMPORARY.fullmatch(p.name)]
    for path in [*written, *folder.glob("checkpoints/*.tmp-*")]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


#: what marks a folder as each kind of lengthgen output (`check_fresh` overwrites only its own kind)
KIND_MARKERS = {"training run": ("checkpoints", "config.json"), "comparison": ("runs", "pretrain"),
                "retrofit": ("finetune", "control")}


_SEED_RUN = re.compile(r".+-seed\d+")
#: what lengthgen writes inside a run's checkpoints/ (checkpoints, damaged ones set aside, temporaries) and tb/
_INSIDE = {"checkpoints": re.compile(r"step_\d+(\.corrupt.*|\.tmp-.*)?|\..*\.tmp"),
           "tb": re.compile(r"events\.out\.tfevents\..*")}


def results_file(path: str | Path) -> str | None:
    """The kind (``run``, ``comparison``, ``needle``) of the results file lengthgen wrote at ``path``, under a name
    of the user's choosing too (``lengthgen eval --out NAME.json``): JSON with the results model's ``schema`` and
    ``kind``; None for any other file."""
    path = Path(path)
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    kind = data.get("kind") if isinstance(data, dict) and "schema" in data else None
    return kind if kind in ("run", "comparison", "needle") else None


def enclosing_folder(path: str | Path) -> Path | None:
    """The nearest folder above ``path`` that lengthgen wrote (it holds the lock file); None when there is none."""
    return next((f for f in Path(path).resolve().parents if (f / LOCK).exists()), None)


def check_outputs(folder: str | Path, names: list[str], option: str = "") -> None:
    """`RunFolderError` when ``folder`` holds any of ``names`` (the files a command writes there) and is no folder
    lengthgen wrote: it has no lock file and none of them is a results file (`results_file`); they are the user's.
    Also when ``folder`` is inside a folder lengthgen wrote (its runs/, logs, ...: the owner's ``--overwrite``
    would refuse them) and is not a run folder itself (e.g. a comparison's run, whose own files needle writes).
    The messages name ``option`` (e.g. ``--out``) before the folder where it came from one."""
    folder = outside_checkpoints(folder)
    said = f"{option} {folder}" if option else str(folder)
    inside = enclosing_folder(folder)
    if inside is not None and not ((folder / LOCK).exists() and (folder / "config.json").is_file()):
        raise RunFolderError(f"{said} is inside the folder {inside} that lengthgen wrote (its runs, checkpoints, "
                             "logs); choose a folder outside it")
    held = [name for name in names if (folder / name).exists()]
    if held and not (folder / LOCK).exists() and not any(results_file(folder / name) for name in held):
        raise RunFolderError(f"{said} holds {_names(held)}, which lengthgen did not write (the folder has no {LOCK} "
                             "and no results file); choose another folder")


def not_written(folder: Path, where: str = "") -> list[str]:
    """What in ``folder`` lengthgen did not write (paths from ``folder``), which ``--overwrite`` would delete
    with it: names outside `WRITTEN` (but results files, `results_file`, and the temporaries of atomic writes that a
    kill interrupted), anything in ``checkpoints/`` but checkpoints and in ``tb/`` but event files, and in a
    comparison's ``runs/`` and ``pretrain/`` anything but its run folders (``NAME-seedN`` or ``BASE/NAME-seedN``,
    e.g. not ``lengthgen train``'s default ``runs/<config name>``), each checked the same way, as are a retrofit's
    ``finetune/`` and ``control/``."""
    found = []
    for child in sorted(folder.iterdir()):
        path = where + child.name
        if child.name == LOCK or _TEMPORARY.fullmatch(child.name):
            continue
        if child.name not in WRITTEN:
            if results_file(child) is None:
                found.append(path)
        elif child.name in _INSIDE and child.is_dir():
            found += [f"{path}/{g.name}" for g in sorted(child.iterdir()) if not _INSIDE[child.name].fullmatch(g.name)]
        elif child.name in ("finetune", "control") and child.is_dir():
            found += not_written(child, path + "/")
        elif child.name in ("runs", "pretrain") and child.is_dir():
            found += [p for run in sorted(child.iterdir()) for p in _seed_runs(run, f"{path}/{run.name}")]
    return found


def _seed_runs(entry: Path, path: str, in_base: bool = False) -> list[str]:
    """`not_written` of a base's folder of a comparison's run folders ``NAME-seedN`` (a base's name may end in
    ``-seedN`` too) or of one of them; else ``path``."""
    is_run = lambda p: p.is_dir() and _SEED_RUN.fullmatch(p.name)  # noqa: E731
    if not in_base and entry.is_dir() and any(is_run(r) for r in entry.iterdir()):
        return [p for r in sorted(entry.iterdir()) for p in _seed_runs(r, f"{path}/{r.name}", True)]
    if is_run(entry):
        return not_written(entry, path + "/")
    return [path]


def check_fresh(folder: str | Path, *, overwrite: bool = False, resumable: bool = True,
                kind: str = "training run", keep: str | Path | None = None, delete: bool = True) -> None:
    """A new ``kind`` of output (a key of `KIND_MARKERS`) may start in ``folder`` only if it holds nothing;
    ``overwrite`` first deletes what lengthgen wrote there (`clear`; with ``delete=False`` the caller clears it
    later). `RunFolderError` if it holds anything else, another kind of output, or ``keep`` (a checkpoint the new
    run starts from), or anything at all without ``overwrite``."""
    folder = Path(folder)
    held = sorted(p.name for p in folder.iterdir() if p.name != LOCK) if folder.is_dir() else []
    if held and not overwrite:
        check_kind(folder, kind, "--resume and --overwrite act only on")     # another kind: neither applies
        resume = "--resume to continue it, " if resumable else ""
        raise RunFolderError(f"{folder} already holds {_names(held)}; pass {resume}--overwrite to delete it and "
                             "start over, or choose another folder")
    foreign = not_written(folder) if held else []
    if foreign:
        raise RunFolderError(f"{folder} holds files lengthgen did not write ({_names(foreign)}); --overwrite "
                             "deletes only lengthgen's files: move them or choose another folder")
    check_kind(folder, kind, "--overwrite replaces only")
    if held and keep is not None and Path(keep).resolve().is_relative_to(folder.resolve()):
        raise RunFolderError(f"{folder} holds {keep} (train.init_from), which this run starts from; --overwrite "
                             "would delete it: choose another folder")
    if delete:
        clear(folder)


def clear(folder: str | Path) -> None:
    """Delete everything in ``folder`` but its lock file (what `check_fresh` let ``--overwrite`` delete)."""
    for path in Path(folder).iterdir():
        if path.name != LOCK:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def kinds_held(folder: str | Path) -> dict[str, list[str]]:
    """The kinds of output (`KIND_MARKERS`) that ``folder`` holds, each with the markers found."""
    folder = Path(folder)
    held = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    kinds = {kind: [name for name in markers if name in held] for kind, markers in KIND_MARKERS.items()}
    return {kind: found for kind, found in kinds.items() if found}


def check_kind(folder: str | Path, kind: str, action: str = "--resume continues only") -> None:
    """`RunFolderError` if ``folder`` holds another kind of output than ``kind`` (by `KIND_MARKERS`)."""
    for other, found in kinds_held(folder).items():
        if other != kind:
            raise RunFolderError(f"{folder} holds a {other} ({', '.join(found)}), not a {kind}; {action} a "
                                 f"{kind}: delete it yourself or choose another folder")


def _names(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _config_kind(config: Path) -> str:
    """What a folder without checkpoints is, by its ``config.json``: a run that wrote none yet, or a Hugging Face
    model folder (``lengthgen export``'s); nothing to say otherwise."""
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if isinstance(data, dict) and "model_type" in data:
        return "; it is a Hugging Face model folder, which eval --hf and needle --hf read"
    if isinstance(data, dict) and "train" in data:
        return ("; its run has written no checkpoint yet (one every train.checkpoint_every steps, or only at the "
                "end where that is 0)")
    return ""


def checkpoints_at(path: str | Path) -> tuple[list[Path], bool]:
    """(the checkpoints ``path`` names, newest first; whether it is a run folder): a checkpoint folder or a file in
    one names itself, a run folder its complete checkpoints. FileNotFoundError when there are none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run folder or checkpoint at {path}")
    if path.is_file():
        path = path.parent
    if COMPLETE.fullmatch(path.name) or (path / "state.json").exists():
        return [path], False
    found = complete_checkpoints(path)
    if not found:
        runs = {"comparison": f"whose runs are in {path / 'runs'}",
                "retrofit": f"whose finetuned run is {path / 'finetune'}"}
        kind = next((kind for kind in kinds_held(path) if kind in runs), None)
        where = f"; it holds a {kind}, {runs[kind]}" if kind else _config_kind(path / "config.json")
        raise FileNotFoundError(f"no checkpoint in {path} (expected checkpoints/step_N of a run folder, or a "
                                f"checkpoint folder){where}")
    return found, True


def load_newest(path: str | Path, load: Callable[[Path], T], *, set_aside: bool = False, tries: int = 3
                ) -> tuple[Path, T]:
    """``(checkpoint, load(checkpoint))`` for the newest checkpoint at ``path`` that ``load`` reads without a
    `CheckpointError`. Older ones are tried only for a run folder; each damaged newer one is named in a
    `RunFolderWarning` and, with ``set_aside`` (a writer resuming), renamed ``step_N.corrupt``. A checkpoint
    that vanishes while it is read was rotated away by the run's writer: the run folder is listed again (up to
    ``tries`` times)."""
    candidates, is_run = checkpoints_at(path)
    damaged: list[tuple[Path, CheckpointError]] = []
    rotated = False
    for ckpt in candidates:
        try:
            value = load(ckpt)
        except CheckpointError as err:
            if not is_run:
                raise
            if not ckpt.exists():
                rotated = True
            else:
                damaged.append((ckpt, err))
            continue
        for bad, err in damaged:
            kept = ""
            if set_aside:
                os.replace(bad, _free(bad.with_name(bad.name + ".corrupt")))
                kept = f"; kept aside as {bad.name}.corrupt"
            warnings.warn(f"{err}; using the older checkpoint {ckpt.name}{kept}", RunFolderWarning, stacklevel=2)
        return ckpt, value
    if rotated and tries > 1:
        return load_newest(path, load, set_aside=set_aside, tries=tries - 1)
    raise CheckpointError(f"no readable checkpoint in {path}: " + "; ".join(str(err) for _, err in damaged)
                          + ("; the others were removed while read (a run writing there rotates them)"
                             if rotated else ""))


def _free(path: Path) -> Path:
    """``path``, or ``path.2``, ``path.3``, ... : the first name not taken."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}.{n}")
    return free


def _metrics_to(folder: str | Path, step: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each line of ``metrics.jsonl`` that is a JSON entry logged at or before ``step``, with its entry."""
    path = Path(folder) / METRICS
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] <= step:
            yield line, entry


def cut_metrics(folder: str | Path, step: int) -> None:
    """Keep the entries of ``metrics.jsonl`` up to ``step`` (a resumed run logs the later ones again); lines that
    are not JSON entries (a partial last line) go too, and so does an ``extended`` entry at ``step`` itself: a
    session that resumed from this checkpoint logged it, and the resuming run logs its own extension again."""
    if (Path(folder) / METRICS).exists():
        kept = (line for line, entry in _metrics_to(folder, step) if "extended" not in entry or entry["step"] < step)
        atomic_write_text(Path(folder) / METRICS, "".join(line + "\n" for line in kept))


def last_evaluation(folder: str | Path, step: int) -> tuple[int | None, dict[str, Any]]:
    """The step and evaluation (``eval``, ``bema_eval``: length -> metric -> mean) that ``metrics.jsonl`` logged
    last at or before ``step``; (None, {}) when there is none."""
    at, found = None, {}
    for _, entry in _metrics_to(folder, step):
        if "eval" in entry:
            at, found = entry["step"], {k: entry[k] for k in ("eval", "bema_eval") if k in entry}
    return at, found


def saved_run_config(folder: str | Path) -> RunConfig | None:
    """The run config in the folder's ``config.json`` (None when there is none); `RunFolderError` names a
    damaged one."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return None
    try:
        return saved_config(json.loads(path.read_text()), path)
    except (ValueError, OSError) as err:      # CheckpointError is a ValueError
        if isinstance(err, ConfigError):      # its task does not import here (`saved_config`): the file is sound
            raise
        raise RunFolderError(f"{path} is unreadable ({err}); pass --overwrite to start over") from None


__all__ = ["FolderLock", "LOCK", "RunFolderError", "RunFolderWarning", "WRITTEN", "check_fresh", "check_outputs",
           "checkpoints_at", "clear", "cut_metrics", "enclosing_folder", "last_evaluation", "load_newest", "lock",
           "outside_checkpoints", "remove_temporaries", "results_file", "saved_run_config"]
