"""Text corpora for language modelling, with the synthetic tasks' interface.

Quick start (no download: the default corpus is the running Python's standard library)::

    from lengthgen.data.text import make_text_data
    data = make_text_data("stdlib", "byte", split="train")        # a Task: head "lm", metric "loss"
    batch = data.sample(8, 1024, torch.Generator().manual_seed(0))  # Batch with doc_ids
    rows = long_documents("stdlib", "byte", min_length=16384, count=4, seed=0)   # (4, 16384)

Modules: ``tokenizer`` (byte / tiktoken / Hugging Face), ``corpora`` (stdlib, local files, ``.bin``
shards, HF datasets), ``shards`` (the modded-nanogpt ``.bin`` format), ``packing`` (token streams,
``TextData``, long-document rows, ``make_text_data``).
"""

from lengthgen.data.text.corpora import (BinCorpus, Corpus, CorpusError, FileCorpus, HFCorpus,
                                         StdlibCorpus, make_corpus, split_of, stdlib_files)
from lengthgen.data.text.packing import (TextData, TokenStream, default_cache_dir, long_document_rows,
                                         long_documents, make_text_data, pretokenize)
from lengthgen.data.text.shards import (BIN_MAGIC, BIN_VERSION, ShardFormatError, read_bin_header,
                                        read_bin_shard, write_bin_shard)
from lengthgen.data.text.tokenizer import (ByteTokenizer, HFTokenizer, ResourceUnavailableError,
                                           TiktokenTokenizer, Tokenizer, make_tokenizer)

__all__ = [
    "BIN_MAGIC", "BIN_VERSION", "BinCorpus", "ByteTokenizer", "Corpus", "CorpusError", "FileCorpus",
    "HFCorpus", "HFTokenizer", "ResourceUnavailableError", "ShardFormatError", "StdlibCorpus",
    "TextData", "TiktokenTokenizer", "TokenStream", "Tokenizer", "default_cache_dir",
    "long_document_rows", "long_documents", "make_corpus", "make_text_data", "make_tokenizer",
    "pretokenize", "read_bin_header", "read_bin_shard", "split_of", "stdlib_files", "write_bin_shard",
]
