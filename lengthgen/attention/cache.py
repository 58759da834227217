"""`KVCache`: the keys and values a model has seen, so that decoding runs only the new positions.

Each `Attention` layer appends its new keys (after QK-norm and RoPE at their absolute positions) and values, then
attends with its new queries to every key it keeps: `attend`'s convention that queries are the last Lq of the Lk
keys. Everything else that depends on positions depends on differences only (distance terms t = i - j, the
sliding window, documents, the query-scaling count n_i), so a layer with a sliding window W keeps only its last
W - 1 keys (with the new one, the W its next query sees) and the output still equals recomputing the whole
sequence.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's cache: keys and values (B, Hkv, kept, D), their document ids (B, kept) or None, and ``seen``,
    the number of positions the layer has seen (the absolute position of its next query)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.doc_ids: torch.Tensor | None = None
        self.seen = 0
        self.owner: object | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the new positions' queries attend to: the kept keys, values and document ids, then the new ones.
        Changes nothing: `keep` stores them once the layer's forward has succeeded. Keys of another batch, head
        count, head size, dtype or device, or doc_ids not (batch, new positions), are a ValueError."""
        if doc_ids is not None and tuple(doc_ids.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(f"KVCache: doc_ids must be (batch, new positions) = {(k.shape[0], k.shape[2])}, got "
                             f"{tuple(doc_ids.shape)}")
        if self.k is None:
            return k, v, doc_ids
        if (doc_ids is None) != (self.doc_ids is None):
            raise ValueError("KVCache: give doc_ids with every chunk of positions or with none")
        have = (self.k.shape[:2], self.k.shape[3], self.k.dtype, self.k.device)
        got = (k.shape[:2], k.shape[3], k.dtype, k.device)
        if have != got:
            raise ValueError(f"KVCache: keys of (batch, heads), head size, dtype, device {got} after cached ones "
                             f"of {have}; start a new KVCache for each batch of sequences")
        k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return k, v, None if doc_ids is None else torch.cat([self.doc_ids, doc_ids], dim=1)

    def keep(self, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None, window: int | None) -> None:
        """Store what `extend` returned, its last ``window - 1`` positions (all without a window), and count the
        new ones in ``seen``."""
        self.seen += k.shape[2] - (0 if self.k is None else self.k.shape[2])
        first = 0 if window is None else max(0, k.shape[2] - (window - 1))
        self.k, self.v = k[:, :, first:], v[:, :, first:]
        self.doc_ids = None if doc_ids is None else doc_ids[:, first:]


class KVCache:
    """A model's cache: one `LayerCache` per attention layer, by the layer's ``layer_index`` (`layer`), and
    ``length``, the number of positions the model has seen (`lengthgen.model.GPT` advances it).

    Start a new one per batch of sequences; every sequence of the batch has the same positions (no padding). A
    forward that fails part-way leaves some layers extended and others not: ``broken`` is then set, and the cache
    refuses further use."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerCache] = {}
        self.length = 0
        self.broken = False

    def layer(self, index: int, owner: object | None = None) -> LayerCache:
        """The cache of layer ``index`` (a new, empty one the first time); ``owner``, the attention layer asking,
        must be the same each time (two layers with one ``layer_index`` would read each other's keys)."""
        if self.broken:
            raise ValueError("KVCache: a forward with this cache failed part-way; start a new KVCache")
        cache = self.layers.setdefault(index, LayerCache())
        if owner is not None:
            if cache.owner is not None and cache.owner is not owner:
                raise ValueError(f"KVCache: two attention layers use layer_index {index}; give each layer of a model "
                                 "its own layer_index")
            cache.owner = owner
        return cache


__all__ = ["KVCache", "LayerCache"]
