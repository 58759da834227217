"""Memory: what the host can still give (checked before a CPU evaluation that would not fit, which Linux would
otherwise end with a kill and no message), and recognizing an allocation failure: the CLI reports it in one line,
the benchmarks record the row as ``oom``."""

from __future__ import annotations

import re

_CPU_ALLOCATOR = re.compile(r"(?:can't allocate memory|not enough memory): you tried to allocate (\d+) bytes")


def available_memory() -> int | None:
    """The bytes the host can still give without swapping (Linux's ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
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


__all__ = ["available_memory", "gib", "out_of_memory"]
