"""Atomic, durable file writes: a temporary file in the target's folder, flushed to disk, then ``os.replace`` and
the folder flushed too; nothing partial is left, and a power loss after the call cannot lose the file. A whole
folder likewise (`atomic_write_folder`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)``, flush it to disk, then ``os.replace(tmp_path, path)`` and flush the folder; the
    temp file is removed on failure. Symbolic links are followed, as `atomic_write_folder` does: a link at ``path``
    stays and the file it names is written (made, if it names nothing); a link to nothing on the way makes the
    folder it names."""
    path = Path(path)
    if path.is_symlink():                   # os.replace would put a regular file in the link's place
        path = Path(os.path.realpath(path))
    Path(os.path.realpath(path.parent)).mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fsync(tmp)
        os.chmod(tmp, _creation_mode())   # open()'s permissions: mkstemp's (and safetensors') files are private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync(path.parent)
    return path


def fsync(path: str | Path) -> None:
    """Flush a file, or a folder's entries (renames into it), to disk. Folders are skipped where the platform
    cannot open them (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_folder(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_folder)`` on a new folder beside ``path``, then rename it to ``path``, which must be missing
    or empty (else `FileExistsError`: another process wrote there meanwhile); its files are flushed to disk first,
    and the temporary folder is removed on failure, so nothing partial is left. A symbolic link at ``path`` is
    followed: the folder it names is written (a rename would not replace the link), and the link stays."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_folders(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    held = os.open(tmp, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):      # held while written: no later write of ``path`` removes it
            fcntl.flock(held, fcntl.LOCK_EX)
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync(file)
                os.chmod(file, _creation_mode())  # open()'s permissions: safetensors' files are private
        os.chmod(tmp, _creation_mode(0o777))  # mkdir's permissions: mkdtemp's folder is private
        try:
            os.replace(tmp, path)
        except OSError as err:              # ENOTEMPTY / EEXIST: a folder with files
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise FileExistsError(f"{path} is not empty") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)
    fsync(path.parent)
    return path


def temporary(name: str = ".+") -> re.Pattern:
    """The name of an atomic write's temporary of a file or folder whose name matches ``name`` (a regex; default:
    any): tempfile's ``.NAME.``, 8 random characters, ``.tmp``."""
    return re.compile(rf"\.{name}\.[a-z0-9_]{{8}}\.tmp")


def _remove_stale_folders(path: Path) -> None:
    """Delete the temporary folders that killed `atomic_write_folder` calls of ``path`` left beside it: those of
    its name (`temporary`) that no live writer holds locked; anything else stays."""
    ours = temporary(re.escape(path.name))
    for tmp in path.parent.glob(".*.tmp"):
        if not ours.fullmatch(tmp.name) or tmp.is_symlink() or not tmp.is_dir():
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:                 # gone meanwhile, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:                 # a live writer's (or a file system without locks: cannot tell)
            continue
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


def _creation_mode(base: int = 0o666) -> int:
    """The permissions ``open(path, "w")`` (``base`` 0o666) or ``mkdir`` (0o777) gives: ``base`` less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return base & ~umask


def atomic_write_text(path: str | Path, text: str) -> Path:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return atomic_write(path, write)


def atomic_write_figure(fig: Any, path: str | Path, **options: Any) -> Path:
    """Save the matplotlib figure ``fig`` as ``path`` (in the format its suffix names, else PNG) by `atomic_write`;
    ``options`` go to ``fig.savefig`` (``dpi``, ``bbox_inches``)."""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=Path(path).suffix[1:] or "png", **options))
