"""Memory: what the host, or the process's cgroup, can still give (checked before a CPU evaluation that would not
fit, which Linux would otherwise end with a kill and no message), and recognizing an allocation failure: the CLI
reports it in one line, the benchmarks record the row as ``oom``."""

from __future__ import annotations

import os
import re
from pathlib import Path

_CPU_ALLOCATOR = re.compile(r"(?:can't allocate memory|not enough memory): you tried to allocate (\d+) bytes")
# where each cgroup version keeps a cgroup's limit, usage and (in memory.stat) its reclaimable file cache
_CGROUP_V2 = ("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_NO_LIMIT = 2**62        # cgroup v1 writes "no limit" as 2^63-1 rounded down to a page; v2 writes "max"


def available_memory(root: Path = Path("/")) -> tuple[int, str] | None:
    """The bytes this process can still get without swapping or being killed, and what bounds them: ``"host"``
    (Linux's ``MemAvailable``) or ``"cgroup"`` (a container's or a job's memory limit, `cgroup_headroom`, where that
    is smaller: the kernel kills the process at it, whatever the host has free). None where neither is known."""
    known = [(size, bound) for size, bound in ((_meminfo(root), "host"), (cgroup_headroom(root), "cgroup"))
             if size is not None]
    return min(known, default=None)


def cgroup_headroom(root: Path = Path("/")) -> int | None:
    """The bytes this process's memory cgroup (v1 or v2, as ``/proc/self/cgroup`` names it) and each of its
    ancestors still allow, the smallest: limit minus usage, the usage less its inactive file cache (page cache the
    kernel reclaims before it kills), as ``docker stats`` and the kubelet count it. A cgroup path that is not under
    the mount (a container sees its own cgroup as the mount's root) is read at the mount's root. None where no
    cgroup sets a limit."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except (OSError, ValueError):
        return None
    room = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers and "memory" not in controllers.split(","):
            continue
        mount, limit_file, usage_file, inactive = _CGROUP_V1 if controllers else _CGROUP_V2
        base = root / mount
        cgroup = Path(os.path.normpath(base / path.lstrip("/")))
        if not cgroup.is_dir() or base not in (cgroup, *cgroup.parents):
            cgroup = base
        while True:                     # the cgroup, then each ancestor up to the mount's root
            limit, usage = _number(cgroup / limit_file), _number(cgroup / usage_file)
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                room.append(max(0, limit - usage + (_stat(cgroup / "memory.stat", inactive) or 0)))
            if cgroup == base:
                break
            cgroup = cgroup.parent
    return min(room, default=None)


def _meminfo(root: Path) -> int | None:
    """Linux's ``MemAvailable``: what the host can still give without swapping."""
    found = _stat(root / "proc/meminfo", "MemAvailable:")
    return None if found is None else found * 1024


def _number(path: Path) -> int | None:
    """The integer a cgroup file holds; None where it is missing or says ``max``."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int | None:
    """The value of ``key`` in a ``key value [unit]`` file (``memory.stat``, ``/proc/meminfo``)."""
    try:
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == key:
                return int(words[1])
    except (OSError, ValueError):
        pass
    return None


def gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def out_of_memory(err: BaseException) -> str | None:
    """What an allocation failure tried, in a few words, or None when ``err`` is something else.

    Recognized: torch's ``OutOfMemoryError`` (CUDA's caching allocator), Python's MemoryError, the CPU allocator's
    RuntimeError ("can't allocate memory: you tried to allocate N bytes") and any other error whose text says
    "out of memory" (e.g. ``CUDA error: out of memory`` from a kernel launch)."""
    text = str(err)
    if type(err).__name__ == "OutOfMemoryError" or isinstance(err, MemoryError):
        return text.split(". GPU")[0].strip() or type(err).__name__
    found = _CPU_ALLOCATOR.search(text)
    if found:
        return f"tried to allocate {int(found[1]) / 2**20:.0f} MiB"
    return text.strip().splitlines()[0] if "out of memory" in text.lower() else None


__all__ = ["available_memory", "cgroup_headroom", "gib", "out_of_memory"]
