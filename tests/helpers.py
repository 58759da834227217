"""Test helpers shared by the backend tests (imported as ``from helpers import ...``: pytest puts tests/ on the
path)."""

from __future__ import annotations

import torch


def make_docs(b: int, length: int, seed: int = 0, max_len: int = 9) -> torch.Tensor:
    """(b, length) increasing document ids in runs of random lengths 1..max_len (several documents per row)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < length:
            ids += [doc] * int(torch.randint(1, max_len + 1, (1,), generator=gen))
            doc += 1
        rows.append(ids[:length])
    return torch.tensor(rows)
