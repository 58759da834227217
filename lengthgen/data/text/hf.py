"""Hugging Face ``datasets`` corpora (optional dependency, imported only when used)."""

from __future__ import annotations

from typing import Iterator

from lengthgen.config import check_value
from lengthgen.data.text.corpus import Corpus, CorpusError, Split, split_of
from lengthgen.optional import require


class HFCorpus(Corpus):
    """A Hugging Face ``datasets`` dataset read with ``load_dataset(dataset, config, split=hf_split,
    streaming=streaming)``; documents are ``example[text_field]``. ``hf_split`` defaults to
    ``train`` for split ``train``/``all`` and ``validation`` for ``val``; one given is what the run trains on, so
    split ``val`` is then refused (ValueError: no held-out text). With ``val_fraction`` every split reads
    ``hf_split`` (default ``train``) and holds out the examples whose index hashes below it (`split_of`), as file
    corpora do: held-out text for a dataset with one split (FineWeb-Edu). Streams are long: bound
    them with ``max_documents`` / ``max_tokens`` when tokenizing. Contacts the Hub unless the
    dataset is in the local HF cache (``HF_DATASETS_OFFLINE=1`` to forbid)."""

    def __init__(self, dataset: str, config: str | None = None, split: str = "train", *,
                 text_field: str = "text", hf_split: str | None = None, streaming: bool = True,
                 val_fraction: float | None = None):
        require("datasets", f"corpus 'hf:{dataset}'", "datasets (or pip install 'lengthgen[data]')")
        if not dataset:
            raise ValueError("hf corpus: empty dataset name; use 'hf:<dataset>[:config]'")
        self.dataset, self.config = dataset, config
        self.split = check_value("HFCorpus.split", split, Split)
        self.val_fraction = check_value("HFCorpus.val_fraction", val_fraction, float | None, ge=0, le=1)
        if val_fraction is None and hf_split is not None and split == "val":    # the training text: none held out
            raise ValueError(f"hf_split={hf_split!r} names the split the run trains on, so it has no validation "
                             "text of its own (val_fraction holds out part of it)")
        own = {"train": "train", "val": "validation", "all": "train"}[split]      # the dataset's own splits
        self.hf_split = hf_split or ("train" if val_fraction is not None else own)
        self.text_field, self.streaming = text_field, streaming
        held_out = f"[{split}, val_fraction {val_fraction:g}]" if val_fraction is not None else ""
        self.name = f"hf:{dataset}{':' + config if config else ''}/{self.hf_split}{held_out}"
        self._seen = 0

    def documents(self) -> Iterator[str]:
        import datasets
        ds = datasets.load_dataset(self.dataset, self.config, split=self.hf_split,
                                   streaming=self.streaming)
        self._seen = 0
        for i, example in enumerate(ds):
            if self.val_fraction is not None and self.split != "all" and \
                    split_of(str(i), self.val_fraction) != self.split:
                continue
            if self.text_field not in example:
                raise CorpusError(f"{self.name}: example {i} has no {self.text_field!r} field "
                                  f"(found {sorted(example)[:10]}); set text_field=")
            text = example[self.text_field]
            if isinstance(text, str) and text.strip():
                self._seen += 1
                yield text

    def describe(self) -> str:
        return f"corpus {self.name}: {self._seen} non-empty documents"
