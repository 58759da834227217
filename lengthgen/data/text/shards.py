"""Token shards in the modded-nanogpt ``.bin`` format.

Layout: a header of 256 little-endian int32 (``[0]`` magic 20240520, ``[1]`` version 1, ``[2]`` the
token count, the rest zero), then the tokens as little-endian uint16. modded-nanogpt's GPT-2 shards
are one token stream with the end-of-text token (50256) before every document, cut into fixed-size
files, so a document may continue in the next shard: documents are recovered by splitting the shards'
joined stream on BOS (``BinCorpus``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lengthgen.atomic import atomic_write

BIN_MAGIC = 20240520
BIN_VERSION = 1
BIN_HEADER_INTS = 256
BIN_HEADER_BYTES = BIN_HEADER_INTS * 4


class ShardFormatError(ValueError):
    """A ``.bin`` token shard is malformed (the message names the file and what was wrong)."""


def write_bin_shard(path: str | os.PathLike, tokens) -> Path:
    """Write ``tokens`` (a 1-D sequence of ints in [0, 65535]: list, numpy array or tensor) as a
    modded-nanogpt shard. The file is written to a temporary name and renamed, so it is never seen
    half written. Returns the path."""
    path = Path(path)
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_bin_shard({str(path)!r}): tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"write_bin_shard({str(path)!r}): tokens must be integers, got dtype "
                         f"{arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 65535):
        raise ValueError(f"write_bin_shard({str(path)!r}): token ids must fit in uint16 [0, 65535], "
                         f"got range [{int(arr.min())}, {int(arr.max())}]")
    if arr.size >= 2**31:
        raise ValueError(f"write_bin_shard({str(path)!r}): {arr.size} tokens do not fit the int32 "
                         f"token count of the header")
    header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = BIN_MAGIC, BIN_VERSION, arr.size

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype("<u2", copy=False).tobytes())

    return atomic_write(path, write)


def read_bin_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"token shard {path} does not exist")
    if not path.is_file():
        raise ShardFormatError(f"token shard {path} is not a regular file")
    size = path.stat().st_size
    if size < BIN_HEADER_BYTES:
        raise ShardFormatError(f"token shard {path} is truncated: {size} bytes, shorter than the "
                               f"{BIN_HEADER_BYTES}-byte header")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(BIN_HEADER_BYTES), dtype="<i4")
    if header[0] != BIN_MAGIC:
        raise ShardFormatError(f"token shard {path} has bad magic number {int(header[0])} (expected "
                               f"{BIN_MAGIC}); it is not a modded-nanogpt .bin shard")
    if header[1] != BIN_VERSION:
        raise ShardFormatError(f"token shard {path} has unsupported version {int(header[1])} "
                               f"(expected {BIN_VERSION})")
    count = int(header[2])
    if count < 0:
        raise ShardFormatError(f"token shard {path} has a negative token count {count} in its header")
    payload = size - BIN_HEADER_BYTES
    if payload < 2 * count:
        raise ShardFormatError(f"token shard {path} is truncated: the header says {count} tokens "
                               f"({2 * count} bytes) but only {payload} bytes follow the header")
    if payload > 2 * count:
        raise ShardFormatError(f"token shard {path} has {payload - 2 * count} unexpected bytes after "
                               f"the {count} tokens its header announces")
    return count


def read_bin_shard(path: str | os.PathLike, *, mmap: bool = False) -> np.ndarray:
    """Read a shard's tokens as a 1-D uint16 array (memory-mapped, read-only, if ``mmap``).
    Raises ``FileNotFoundError`` or ``ShardFormatError`` naming the file and the problem."""
    count = read_bin_header(path)
    if mmap:
        if count == 0:
            return np.zeros(0, dtype=np.uint16)
        return np.memmap(path, dtype="<u2", mode="r", offset=BIN_HEADER_BYTES, shape=(count,))
    with open(path, "rb") as f:
        f.seek(BIN_HEADER_BYTES)
        return np.frombuffer(f.read(2 * count), dtype="<u2").astype(np.uint16)
