"""Text data: tokenizers, corpora, .bin shards, packing with doc_ids, long documents. Offline, fast."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
import warnings

import numpy as np
import pytest
import torch

from lengthgen.config import ConfigError
from lengthgen.data.config import DataConfig, make_source
from lengthgen.eval.sources import eval_source
from lengthgen.data.tasks.base import Batch, Task
from lengthgen.data.text import (BIN_MAGIC, BinCorpus, ByteTokenizer, CorpusError, FileCorpus,
                                 HFTokenizer, ResourceUnavailableError, ShardFormatError,
                                 StdlibCorpus, TextData, TiktokenTokenizer, TokenStream,
                                 long_documents, make_corpus, make_text_data, make_tokenizer,
                                 pretokenize, read_bin_shard, split_of, write_bin_shard)

from lengthgen.data.text.corpus import stat_fingerprint
from lengthgen.data.text.packing import _cache_path

BYTE = ByteTokenizer()
BOS = BYTE.bos_id
#: what `LongDocuments.describe` says of packed rows (no document is that long)
JOINED = ("a row joins documents, so a position's context spans earlier documents, or under document masking only "
          "its own")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def write_docs(tmp_path, docs: list[str], name: str = "docs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------
# tokenizers


@pytest.mark.parametrize("text", ["", "hello world", "héllo wörld ✓ 𝄞 日本語\n\ttabs", "\x00\xff"])
def test_byte_tokenizer_round_trip(text):
    ids = BYTE.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert BYTE.decode(ids) == text
    assert BYTE.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert BYTE.decode(np.asarray(ids)) == text
    assert np.array_equal(BYTE.encode_array(text), np.asarray(ids, dtype=np.uint8))


def test_byte_tokenizer_specials():
    assert (BYTE.vocab_size, BYTE.bos_id, BYTE.eos_id, BYTE.pad_id) == (259, 256, 257, 258)
    assert BYTE.decode([BOS, 104, 105, BYTE.eos_id, BYTE.pad_id]) == "hi"
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)


def test_make_tokenizer_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'bpe'.*byte.*gpt2.*tiktoken.*hf:"):
        make_tokenizer("bpe")


def test_tiktoken_not_installed_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)   # makes `import tiktoken` fail
    with pytest.raises(ImportError, match=r"TiktokenTokenizer\('gpt2'\).*pip install tiktoken"):
        make_tokenizer("gpt2")


def test_tiktoken_missing_bpe_files_give_clear_error_instead_of_download(monkeypatch, tmp_path):
    """A stand-in tiktoken whose BPE file is not cached: the download is intercepted."""
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
    fetched = []

    def read_file(blobpath):           # tiktoken.load.read_file: the network fetch
        fetched.append(blobpath)
        raise AssertionError("would download")

    load = types.SimpleNamespace(read_file=read_file)
    load.read_file_cached = lambda blobpath: load.read_file(blobpath)   # cache miss
    fake = types.SimpleNamespace(load=load, list_encoding_names=lambda: ["gpt2", "cl100k_base"],
                                 get_encoding=lambda name: load.read_file_cached(url))
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ResourceUnavailableError, match=r"TiktokenTokenizer\('gpt2'\).*vocab\.bpe.*"
                                                       r"not in tiktoken's local cache") as e:
        TiktokenTokenizer("gpt2")
    assert str(tmp_path) in str(e.value)
    assert fetched == [] and load.read_file is read_file          # restored, never called
    with pytest.raises(ValueError, match=r"unknown encoding 'nope'.*cl100k_base"):
        TiktokenTokenizer("nope")


def test_hf_tokenizer_missing_files_give_clear_errors(tmp_path):
    with pytest.raises(ResourceUnavailableError, match=r"missing\.json does not exist.*tokenizer\.json"):
        make_tokenizer(f"hf:{tmp_path / 'missing.json'}")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ResourceUnavailableError, match=r"has no tokenizer\.json.*vocab\.json"):
        HFTokenizer(tmp_path)
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("not json")
    with pytest.raises(ValueError, match=r"could not read .*tokenizer\.json"):
        HFTokenizer(bad.parent)


def test_hf_tokenizer_not_installed_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"HFTokenizer.*pip install tokenizers"):
        HFTokenizer(tmp_path)


def _tiny_hf_tokenizer(path):
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def foo(x):\n    return x + 1\n"] * 20, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trip_and_cached_stream(tmp_path):
    _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = make_tokenizer(f"hf:{tmp_path}")
    assert tok.bos_id == 0 and tok.vocab_size > 256
    text = "def bar(y):\n    return y * 2  # ü\n"
    assert tok.decode(tok.encode(text)) == text
    docs = write_docs(tmp_path, ["def a(): pass\n", "x = 1\n", "print('hi')\n"])
    cache = tmp_path / "cache"
    d1 = make_text_data(str(docs), tok, split="all", cache_dir=cache)       # auto: caches non-byte
    assert len(list(cache.glob("*.npz"))) == 1
    d2 = make_text_data(str(docs), tok, split="all", cache_dir=cache)
    assert np.array_equal(d1.stream.tokens, d2.stream.tokens)
    assert np.array_equal(d1.stream.starts, d2.stream.starts)
    assert tok.decode(d1.stream.document(1)) == "x = 1\n"
    # a special token's text inside a document is ordinary text: no BOS in the middle of a document
    inside = tok.encode("a <|endoftext|> b")
    assert tok.bos_id not in inside and tok.decode(inside) == "a <|endoftext|> b"


def test_an_hf_bos_not_marked_special_never_comes_from_text(tmp_path):
    """A BOS that the tokenizer.json adds as a token not marked special (``<s>`` with ``special: false``) matched its
    text inside documents: a BOS id mid-document, where doc_ids did not change (they count the stream's document
    starts), unlike the BOS-delimited documents the model is later run on."""
    tk = pytest.importorskip("tokenizers")
    path = _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    raw = tk.Tokenizer.from_file(str(path))
    raw.add_tokens([tk.AddedToken("<s>", special=False)])
    raw.save(str(path))
    tok = make_tokenizer(f"hf:{path}", bos_token="<s>")
    assert tok.bos_id == raw.token_to_id("<s>") and tok.vocab_size == tok.bos_id + 1
    inside = tok.encode("a <s> b")
    assert tok.bos_id not in inside and tok.decode(inside) == "a <s> b"
    docs = write_docs(tmp_path, ["x <s> y " * 4, "z"])
    data = make_text_data(str(docs), tok, split="all", cache=False)
    assert np.count_nonzero(data.stream.tokens == tok.bos_id) == data.stream.num_documents == 2


def test_a_bos_id_that_document_text_encodes_to_is_refused(tmp_path):
    """A BOS that is an ordinary word of the vocabulary (no added token to mark special) came from a document's
    text: a BOS mid-document where doc_ids, which count the stream's document starts, did not change."""
    tk = pytest.importorskip("tokenizers")
    raw = tk.Tokenizer(tk.models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = make_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert tok.bos_id == 0 and tok.encode("a <s> b") == [1, 0, 2]
    docs = write_docs(tmp_path, ["a b", "a <s> b"])
    with pytest.raises(CorpusError, match=r"document 1 encodes to the BOS id 0 of tokenizer 'hf:.*bos_token="):
        make_text_data(str(docs), tok, split="all", cache=False)
    # a token cache written before this was refused holds the BOS mid-document: it is rebuilt, and refused
    stale = _cache_path(make_corpus(str(docs), "all"), tok, tmp_path / "cache", None, None)
    TokenStream(np.array([0, 1, 2, 0, 1, 0, 2], dtype=np.uint16), np.array([0, 3]), 4, 0).save(stale)
    with pytest.raises(CorpusError, match="document 1 encodes to the BOS id 0"):
        make_text_data(str(docs), tok, split="all", cache_dir=tmp_path / "cache")


def test_an_hf_tokenizer_reads_a_lone_surrogate_as_tiktoken_does(tmp_path):
    """JSON may escape a lone surrogate ("\\ud800", common in scraped text): the byte tokenizer encodes it and
    tiktoken replaces it by U+FFFD, but an hf: tokenizer failed the whole corpus with "data.text: TextEncodeInput
    must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]", naming neither file nor document."""
    _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = make_tokenizer(f"hf:{tmp_path}")
    (tmp_path / "docs.jsonl").write_text('{"text": "a \\ud800 b"}\n{"text": "x = 1"}\n')
    data = make_text_data(str(tmp_path / "docs.jsonl"), tok, split="all", cache=False)
    assert [tok.decode(data.stream.document(i)) for i in range(2)] == ["a \ufffd b", "x = 1"]
    assert tok.encode("a \ud800 b") == tok.encode("a \ufffd b")


def test_hf_tokenizer_ignores_the_truncation_and_padding_saved_in_its_file(tmp_path):
    # a tokenizer.json may carry truncation / padding settings (saved after enable_truncation, as some Hub files
    # do): documents would be cut to that many tokens, silently, and short ones padded
    path = _tiny_hf_tokenizer(tmp_path / "tokenizer.json")
    saved = json.loads(path.read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    path.write_text(json.dumps(saved))
    tok = make_tokenizer(f"hf:{path}")
    text = "def foo(x):\n    return x + 1\n" * 3
    assert tok.decode(tok.encode(text)) == text
    assert [tok.decode(ids) for ids in tok.encode_batch([text, "x"])] == [text, "x"]

# ------------------------------------------------------------------------------------------------
# .bin shards


@pytest.mark.parametrize("tokens", [[], [0, 1, 65535, 50256], np.arange(1000) % 50257,
                                    torch.tensor([5, 6, 7])])
def test_bin_shard_round_trip(tmp_path, tokens):
    path = write_bin_shard(tmp_path / "s.bin", tokens)
    expected = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
    for mmap in (False, True):
        out = read_bin_shard(path, mmap=mmap)
        assert out.dtype == np.uint16 and np.array_equal(out, expected)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [BIN_MAGIC, 1, len(expected)] and not header[3:].any()
    assert path.stat().st_size == 1024 + 2 * len(expected)


def test_bin_shard_corruptions_give_clear_errors(tmp_path):
    good = write_bin_shard(tmp_path / "good.bin", np.arange(100)).read_bytes()

    def corrupt(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return p

    header = np.frombuffer(good[:1024], dtype="<i4").copy()
    bad_magic, bad_version = header.copy(), header.copy()
    bad_magic[0], bad_version[1] = 12345, 7
    cases = {
        "magic.bin": (bad_magic.tobytes() + good[1024:], r"bad magic number 12345"),
        "version.bin": (bad_version.tobytes() + good[1024:], r"unsupported version 7"),
        "short_header.bin": (good[:100], r"truncated: 100 bytes, shorter than the 1024-byte header"),
        "short_tokens.bin": (good[:-10], r"truncated: the header says 100 tokens \(200 bytes\) but only "
                                         r"190 bytes"),
        "trailing.bin": (good + b"xx", r"2 unexpected bytes after the 100 tokens"),
    }
    for name, (data, pattern) in cases.items():
        p = corrupt(name, data)
        with pytest.raises(ShardFormatError, match=pattern) as e:
            read_bin_shard(p)
        assert name in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"nope\.bin does not exist"):
        read_bin_shard(tmp_path / "nope.bin")
    with pytest.raises(ValueError, match=r"must fit in uint16"):
        write_bin_shard(tmp_path / "big.bin", [70000])


def test_bin_corpus_splits_documents_at_bos(tmp_path):
    docs = ["first doc", "second", "third one here"]
    flat = [t for d in docs for t in [BOS] + BYTE.encode(d)]
    write_bin_shard(tmp_path / "a_000.bin", flat[:12])
    write_bin_shard(tmp_path / "a_001.bin", flat[12:])
    data = make_text_data(f"bin:{tmp_path}/a_*.bin", "byte", split="all")
    got = [BYTE.decode(data.stream.document(i)) for i in range(data.stream.num_documents)]
    assert got == ["first doc", "second", "third one here"]   # "second" runs on into a_001.bin
    write_bin_shard(tmp_path / "gpt2.bin", [50256, 1000])
    with pytest.raises(CorpusError, match=r"gpt2\.bin holds token id 50256, outside the vocabulary "
                                          r"\(259 ids\) of tokenizer 'byte'"):
        make_text_data(f"bin:{tmp_path / 'gpt2.bin'}", "byte", split="all")


LONG_DOC = "a document long enough to span three shards"
SHARD_DOCS = ["one", LONG_DOC, "", "two"]          # "": two BOS in a row, an empty document (skipped)


@pytest.mark.parametrize("prefix", ["", "tail"])
@pytest.mark.parametrize("cuts", [[10], [10, 20, 20, 30], [5], [4], [4, 5], [49], [48, 49], [0, 0]],
                         ids=["in-doc", "3-shard-doc-and-empty-shard", "ends-at-bos", "starts-with-bos",
                              "bos-only-shard", "between-two-bos", "empty-doc-bos-only-shard", "empty-shards"])
def test_bin_documents_run_across_shard_boundaries(tmp_path, cuts, prefix):
    """modded-nanogpt cuts one token stream into shards: the documents are those of the joined stream,
    wherever the cuts fall (``cuts``: after the prefix; BOS at 0, 4, 48, 49). ``prefix``: the first shard
    starts mid-document; its head is a document too."""
    flat = BYTE.encode(prefix) + [t for d in SHARD_DOCS for t in [BOS] + BYTE.encode(d)]
    cuts = [len(prefix) + c for c in cuts]
    assert [i - len(prefix) for i, t in enumerate(flat) if t == BOS] == [0, 4, 48, 49]
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(flat)])):
        write_bin_shard(tmp_path / f"s_{i:03d}.bin", flat[a:b])
    expected = [d for d in [prefix, *SHARD_DOCS] if d]
    assert [BYTE.decode(d) for d in BinCorpus(tmp_path, bos_id=BOS)] == expected
    train, val = (list(map(BYTE.decode, BinCorpus(tmp_path, s, bos_id=BOS, val_fraction=0.5)))
                  for s in ("train", "val"))
    assert sorted(train + val) == sorted(expected)
    data = make_text_data(f"bin:{tmp_path}", "byte", split="all", cache=False)
    assert data.stream.num_documents == len(expected)
    row = long_documents(data, min_length=len(LONG_DOC), count=1)[0]
    assert BYTE.decode(row[1:].tolist()) == LONG_DOC[:-1]


def test_bin_shards_join_in_the_order_of_the_numbers_in_their_names(tmp_path):
    """Unpadded shard numbers joined by name (train_1, train_10, train_2) cut a document across shards into pieces
    of others; a run whose checkpoint recorded the digest of that order is refused on resume (its digest differs),
    and a cache of it is not reused (its fingerprint differs)."""
    flat = [t for d in ["first", "second document", "third"] for t in [BOS] + BYTE.encode(d)]
    for n, (a, b) in zip([1, 2, 10], [(0, 10), (10, 18), (18, len(flat))]):
        write_bin_shard(tmp_path / f"train_{n}.bin", flat[a:b])
    corpus = BinCorpus(tmp_path, bos_id=BOS)
    assert [key for key, _ in corpus.files] == ["train_1.bin", "train_2.bin", "train_10.bin"]
    assert [BYTE.decode(d) for d in corpus] == ["first", "second document", "third"]
    by_name = BinCorpus(tmp_path, bos_id=BOS)
    by_name.files = sorted(by_name.files)                    # the order before: by name
    assert by_name.fingerprint() != corpus.fingerprint()
    assert TextData(pretokenize(by_name, BYTE, cache=False)).digest() != \
        TextData(pretokenize(corpus, BYTE, cache=False)).digest()


def test_bin_cache_written_before_documents_crossed_shards_is_not_reused(tmp_path):
    """Caches of streams split shard by shard (the older, wrong split) must miss: the fingerprint changed."""
    write_bin_shard(tmp_path / "s.bin", [BOS, 1, 2])
    corpus = BinCorpus(tmp_path, bos_id=BOS)
    per_shard = stat_fingerprint(["bin", "all", repr(0.05), repr(BOS)], corpus.files)
    assert corpus.fingerprint() != per_shard


# ------------------------------------------------------------------------------------------------
# local corpora


def test_txt_one_document_per_file_and_separator(tmp_path):
    (tmp_path / "b.txt").write_text("beta", encoding="utf-8")
    (tmp_path / "a.txt").write_text("alpha<|sep|>gamma<|sep|>  ", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored")
    assert list(FileCorpus(tmp_path)) == ["alpha<|sep|>gamma<|sep|>  ", "beta"]
    assert list(FileCorpus(tmp_path, separator="<|sep|>")) == ["alpha", "gamma", "beta"]
    assert list(make_corpus(str(tmp_path / "*.txt"), "all")) == list(FileCorpus(tmp_path))
    assert list(make_corpus(str(tmp_path / "b.txt"), "all")) == ["beta"]


def test_a_directory_corpus_reads_its_linked_folders(tmp_path):
    """A folder corpus searched recursively skipped a subfolder that is a symbolic link (os.walk does not follow
    them), without a word, while the glob of the same folder read it; a link back up the tree is read once."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "linked.txt").write_text("linked document")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "own.txt").write_text("own document")
    (tmp_path / "corpus" / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere" / "up").symlink_to(tmp_path / "corpus", target_is_directory=True)   # a cycle
    folder = FileCorpus(tmp_path / "corpus")
    assert [key for key, _ in folder.files] == ["more/linked.txt", "own.txt"]
    assert list(folder) == ["linked document", "own document"]


def test_jsonl_loading_and_errors(tmp_path):
    path = write_docs(tmp_path, ["one", "two ü"])
    assert list(FileCorpus(path)) == ["one", "two ü"]
    other = tmp_path / "other.jsonl"
    other.write_text('{"content": "x"}\n\n{"content": "y"}\n')
    assert list(FileCorpus(other, text_field="content")) == ["x", "y"]
    with pytest.raises(CorpusError, match=r"other\.jsonl:1: no 'text' field \(found \['content'\]\)"):
        list(FileCorpus(other))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2: invalid JSON"):
        list(FileCorpus(broken))


def test_jsonl_lines_end_only_at_newlines(tmp_path):
    # JSON Lines ends a record at \n only: U+2028, U+2029 and U+0085 stay raw inside strings (json.dumps with
    # ensure_ascii=False writes them so), and str.splitlines would cut the record there; \r\n endings also work
    texts = ["para\u2028graph\u2029end", "next\x85line", "crlf"]
    path = tmp_path / "raw.jsonl"
    path.write_bytes("".join(json.dumps({"text": t}, ensure_ascii=False) + "\r\n" for t in texts).encode())
    assert list(FileCorpus(path)) == texts
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a\u2028b"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2: invalid JSON"):
        list(FileCorpus(broken))


def test_a_utf8_byte_order_mark_is_not_text(tmp_path):
    # a byte-order mark (Windows editors, PowerShell) opens the file, not its first document; errors still give
    # the byte's offset in the file
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfplain")
    assert list(FileCorpus(tmp_path / "bom.jsonl")) == ["one", "two"]
    assert list(FileCorpus(tmp_path / "bom.txt")) == ["plain"]
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfab\xff")
    with pytest.raises(CorpusError, match=r"bad\.txt is not valid UTF-8 \(byte 5: b'\\xff'\)"):
        list(FileCorpus(tmp_path / "bad.txt"))

def test_parquet_loading_or_clear_error(tmp_path):
    path = tmp_path / "docs.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match=r"docs\.parquet needs the 'pyarrow' package.*"
                                              r"pip install pyarrow"):
            FileCorpus(path)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["p one", "p two"], "n": [1, 2]}), path)
    assert list(FileCorpus(path)) == ["p one", "p two"]
    with pytest.raises(CorpusError, match=r"docs\.parquet has no column 'body'"):
        list(FileCorpus(path, text_field="body"))


def test_bad_missing_and_empty_sources_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.txt does not exist"):
        make_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"no files match the pattern"):
        make_corpus(str(tmp_path / "*.jsonl"))
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(CorpusError, match=r"data\.csv has unsupported extension '\.csv'"):
        make_corpus(str(tmp_path / "data.csv"))
    with pytest.raises(CorpusError, match=r"has no \.txt/\.jsonl/\.parquet files \(found \['\.csv'\]\)"):
        make_corpus(str(tmp_path))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(CorpusError, match=r"has no documents: .*1 files, 0 non-empty documents"):
        make_text_data(str(tmp_path / "blank.txt"), split="all")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt is not valid UTF-8"):
        list(make_corpus(str(tmp_path / "latin1.txt")))


def test_make_corpus_rejects_unknown_forms_and_options(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown corpus 'wikitext'.*stdlib.*bin:.*hf:"):
        make_corpus("wikitext")
    with pytest.raises(ConfigError, match=r"^corpus\.separator is not a valid key \(corpus 'stdlib'\); valid keys: "
                                          r"include_tests, root, val_fraction$"):
        make_corpus("stdlib", separator="\n")
    # through a config: the key under data.text, make_text_data's own keys listed first
    with pytest.raises(ConfigError, match=r"^data\.text\.bos_align is not a valid key \(corpus 'stdlib'\); valid keys: "
                                          r"corpus, tokenizer, .*bos_aligned, .* and, for a stdlib corpus, "):
        make_source(DataConfig(kind="text", text={"bos_align": True}))
    # a flag is a bool: the string "false" would have turned BOS alignment on
    with pytest.raises(ConfigError, match=r"^data\.text\.bos_aligned='false' is not valid; it must be true or false$"):
        make_source(DataConfig(kind="text", text={"bos_aligned": "false"}))
    # verbose likewise; a cache folder that is no path failed with "data.text: expected str, bytes or os.PathLike
    # object, not int"; cache's choices are written as TOML writes them
    with pytest.raises(ConfigError, match=r"^data\.text\.verbose='false' is not valid; it must be true or false$"):
        make_source(DataConfig(kind="text", text={"verbose": "false"}))
    with pytest.raises(ConfigError, match=r"^data\.text\.cache_dir=5 is not valid; it must be a string, or none$"):
        make_source(DataConfig(kind="text", text={"cache": True, "cache_dir": 5}))
    with pytest.raises(ConfigError, match=r"^data\.text\.cache='yes' is not valid; it must be one of true, false, "
                                          r"auto$"):
        make_source(DataConfig(kind="text", text={"cache": "yes"}))
    with pytest.raises(ConfigError, match=r"StdlibCorpus\.split='test' is not valid; it must be one of train, val"):
        make_corpus("stdlib", "test")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"'hf:wikitext' needs .*'datasets'.*pip install datasets"):
        make_corpus("hf:wikitext:wikitext-103-raw-v1")
    with pytest.raises(ValueError, match=r"pass max_documents= or max_tokens="):
        make_text_data("hf:wikitext")


def test_hash_split_is_stable_and_disjoint(tmp_path):
    docs = [f"document number {i}" for i in range(400)]
    path = write_docs(tmp_path, docs)
    train = list(FileCorpus(path, "train", val_fraction=0.25))
    val = list(FileCorpus(path, "val", val_fraction=0.25))
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 50 < len(val) < 150
    assert val == list(FileCorpus(path, "val", val_fraction=0.25))
    assert split_of("a/b.py", 0.05) == split_of("a/b.py", 0.05)


def test_a_file_named_twice_in_a_list_of_sources_is_one_document(tmp_path):
    """A list naming a directory and a file inside it keyed that file twice ("sub/f1.txt" and "f1.txt"): its
    document was read twice and each copy drawn apart, so some fell in both train and val."""
    (tmp_path / "sub").mkdir()
    files = [tmp_path / "sub" / f"f{i}.txt" for i in range(40)]
    for i, f in enumerate(files):
        f.write_text(f"document {i}")
    source = [str(tmp_path), *map(str, files)]
    train, val = (list(FileCorpus(source, split, val_fraction=0.3)) for split in ("train", "val"))
    assert sorted(train + val) == sorted(f"document {i}" for i in range(40))
    assert FileCorpus(source).files == FileCorpus(str(tmp_path)).files      # the key the directory gives


def test_val_corpus_is_the_val_split_and_the_corpus_all_of_train(tmp_path):
    """Seed 000 trains on fineweb_train_*.bin and evaluates on fineweb_val_*.bin: with ``val_corpus`` the
    evaluation reads that corpus, not a hash split of the training files."""
    train_docs = [f"train document {i} " * 8 for i in range(40)]
    val_docs = [f"val document {i} " * 40 for i in range(6)]
    train_path, val_path = write_docs(tmp_path, train_docs, "train.jsonl"), write_docs(tmp_path, val_docs, "val.jsonl")
    both = {"corpus": str(train_path), "val_corpus": str(val_path), "cache": False}
    assert make_text_data(**both).stream.num_documents == 40                        # all of corpus, no split
    assert make_text_data(**both, split="val").stream.num_documents == 6
    with pytest.raises(ValueError, match="split='all' never reads val_corpus"):
        make_text_data(**both, split="all")
    with pytest.raises(ValueError, match="a Hugging Face dataset has its own validation split"):
        make_text_data(**{**both, "val_corpus": "hf:some/dataset"}, split="val")
    cfg = DataConfig(kind="text", text=both)
    rows = eval_source(cfg, make_source(cfg)).sample(2, 256, gen(0)).tokens
    assert all(BYTE.decode(row[1:].tolist()).startswith("val document") for row in rows)
    with pytest.raises(ValueError, match="make_text_data.split='dev' is not valid"):
        make_text_data(**both, split="dev")
    # a val_corpus that cannot be read is an error before training, not an evaluation of the training text
    from lengthgen.config import ConfigError
    from lengthgen.train import Trainer
    (tmp_path / "empty").mkdir()
    bad = DataConfig(kind="text", text={**both, "val_corpus": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match=r"data.text.val_corpus: corpus .*empty.* has no .txt"):
        eval_source(bad, make_source(bad))
    config = {"data": {"kind": "text", "text": bad.text, "length": 16}, "train": {"steps": 1, "batch_size": 2},
              "model": {"dim": 16, "layers": 1, "heads": 2}}
    with pytest.raises(ConfigError, match="data.text.val_corpus"):
        Trainer(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_val_corpus_inside_the_training_corpus_is_refused(tmp_path):
    """A val_corpus whose files the corpus also names (a directory holding both, as FineWeb's train and val shards
    often are) was trained on, yet evaluated as "long documents (val split)": now an error naming a shared file."""
    write_docs(tmp_path, [f"train document {i} " * 8 for i in range(20)], "train.jsonl")
    val = write_docs(tmp_path, [f"val document {i} " * 40 for i in range(4)], "val.jsonl")
    for split in ("train", "val"):
        with pytest.raises(ValueError, match=r"val_corpus .*val.jsonl.* shares 1 file with corpus"):
            make_text_data(str(tmp_path), "byte", split, val_corpus=str(val), cache=False)
    with pytest.raises(ValueError, match=r"shares \d+ files with corpus 'stdlib'"):
        make_text_data("stdlib", "byte", val_corpus="stdlib")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_bin_shard(shards / "fineweb_train_000001.bin", [BOS, 1, 2, BOS, 3])
    write_bin_shard(shards / "fineweb_val_000000.bin", [BOS, 4, 5])
    cfg = DataConfig(kind="text", text={"corpus": f"bin:{shards}", "cache": False,
                                        "val_corpus": f"bin:{shards}/fineweb_val_*.bin"})
    with pytest.raises(ConfigError, match=r"data.text: val_corpus .* shares 1 file"):
        make_source(cfg)
    apart = {"corpus": f"bin:{shards}/fineweb_train_*.bin", "val_corpus": f"bin:{shards}/fineweb_val_*.bin"}
    assert make_text_data(**apart, cache=False).stream.num_documents == 2
    assert make_text_data(**apart, split="val", cache=False).stream.num_documents == 1


def test_packed_rows_beyond_every_document_are_held_out_text(tmp_path):
    """Where no document is as long as an evaluation length the rows are packed documents: of the validation
    text when there is one (the training text would be scored as if unseen), and the description names the split."""
    train_path = write_docs(tmp_path, [f"train document {i} " * 8 for i in range(40)], "train.jsonl")
    val_path = write_docs(tmp_path, [f"val document {i} " * 40 for i in range(6)], "val.jsonl")
    cfg = DataConfig(kind="text", text={"corpus": str(train_path), "val_corpus": str(val_path), "cache": False})
    source = eval_source(cfg, make_source(cfg))
    rows = source.sample(2, 2048, gen(0)).tokens
    text = BYTE.decode(rows.flatten().tolist())
    assert "val document" in text and "train document" not in text
    assert source.describe(2, 2048) == (f"2 packed rows of the val split (no document of 2048 tokens: {JOINED})")
    alone = DataConfig(kind="text", text={"corpus": str(train_path), "split": "all", "cache": False})
    assert eval_source(alone, make_source(alone)).describe(2, 2048) == (
        f"2 packed rows of the all split, which the run trained on (no document of 2048 tokens: {JOINED})")

def test_a_run_trained_on_the_val_split_is_warned_and_labelled_when_evaluated(tmp_path, capsys):
    """data.text.split='val' trains on the validation text: `lengthgen eval` said "long documents (val split)" as
    if held out, with no warning; now one warning line, and eval.json's batches say the run trained on them."""
    from lengthgen.cli import main
    from lengthgen.eval import RunEval
    from lengthgen.train import train
    from lengthgen.train.config import RunConfig

    path = write_docs(tmp_path, [f"document {i} " * 8 for i in range(40)])
    text = {"corpus": str(path), "tokenizer": "byte", "split": "val", "val_fraction": 0.5, "cache": False}
    cfg = RunConfig.from_dict({"data": {"kind": "text", "text": text, "length": 16},
                               "model": {"dim": 16, "layers": 1, "heads": 2},
                               "train": {"steps": 1, "batch_size": 2, "eval_batches": 0}})
    with pytest.warns(UserWarning, match="trains on the validation split"):
        train(cfg, tmp_path / "run", progress=False)
    assert main(["eval", str(tmp_path / "run"), "--lengths", "16", "--tokens", "16",
                 "--out", str(tmp_path / "eval.json")]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        "lengthgen eval: warning: the run trains on the validation split (data.text.split='val'): long documents "
        "are evaluated on the text it trained on"]
    batch = RunEval.load(tmp_path / "eval.json").lengths[0].batch
    assert batch == "1 long document (val split, which the run trained on)"


def test_evaluating_a_run_on_text_it_may_have_trained_on_is_warned(tmp_path, capsys):
    """The split is drawn from each document's key (file and index), so after the corpus files changed (renamed
    here; or how lengthgen orders, splits or tokenizes them) the 'val split' holds documents the run trained on.
    Resume refuses such a change (the checkpoint keeps the training tokens' digest), but `lengthgen eval` and
    `lengthgen needle` and `lengthgen retrofit` read the new split and called it held out, without a word; now one
    warning line each."""
    import hashlib

    from lengthgen.cli import main
    from lengthgen.train import train
    from lengthgen.train.config import RunConfig

    (tmp_path / "corpus").mkdir()
    docs = [f"document {i} " * 8 for i in range(40)]
    path = write_docs(tmp_path / "corpus", docs, "a.jsonl")
    text = {"corpus": str(tmp_path / "corpus"), "tokenizer": "byte", "val_fraction": 0.5, "cache": False}
    cfg = RunConfig.from_dict({"data": {"kind": "text", "text": text, "length": 16},
                               "model": {"dim": 16, "layers": 1, "heads": 2},
                               "train": {"steps": 1, "batch_size": 2, "eval_batches": 0}})
    train(cfg, tmp_path / "run", progress=False)
    path.rename(tmp_path / "corpus" / "b.jsonl")

    def held_out(name):      # the split rule written out: sha1 of "<file>#<index>" below the fraction
        return {i for i in range(len(docs)) if int.from_bytes(
            hashlib.sha1(f"{name}#{i}".encode()).digest()[:8], "big") / 2.0**64 < 0.5}
    assert held_out("b.jsonl") - held_out("a.jsonl")      # val documents now that the run trained on
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--lengths", "16", "--tokens", "16",
                 "--out", str(tmp_path / "eval.json")]) == 0
    assert main(["needle", str(tmp_path / "run"), "--lengths", "128", "--depths", "0.5", "--samples", "1",
                 "--out", str(tmp_path / "needle")]) == 0
    assert main(["retrofit", str(tmp_path / "run"), "--set", "model.attention.out_norm=head_rms", "--steps", "1",
                 "--eval-lengths", "16", "--eval-tokens", "16", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 3 and all(re.fullmatch(
        rf"lengthgen (eval|needle|retrofit): warning: {re.escape(str(tmp_path / 'run'))}(/checkpoints/\w+)? was "
        r"trained on other text than "
        r"data\.text reads here \(token digest \w{12}, now \w{12}: the corpus files changed, or how this lengthgen "
        r"orders, splits or tokenizes them\): documents it trained on may be evaluated as held out", line)
        for line in warned), warned


# ------------------------------------------------------------------------------------------------
# stdlib corpus


def test_stdlib_corpus_is_nonempty_and_split_is_stable_and_disjoint():
    train, val, full = StdlibCorpus("train"), StdlibCorpus("val"), StdlibCorpus("all")
    t, v, a = ([rel for rel, _ in c.files()] for c in (train, val, full))
    assert len(a) > 100 and len(v) > 0
    assert not set(t) & set(v) and sorted(t + v) == a
    assert 0.01 < len(v) / len(a) < 0.12
    assert t == [rel for rel, _ in StdlibCorpus("train").files()]      # stable
    assert not any(part in ("site-packages", "test", "tests") for rel in a for part in rel.split("/"))
    assert "os.py" in a and "json/__init__.py" in a
    doc = next(iter(val))
    assert isinstance(doc, str) and doc.strip()
    # near-copies fall on one side: every codec table, and paths that differ only in digits
    side = dict.fromkeys(t, "train") | dict.fromkeys(v, "val")
    assert len({side[rel] for rel in a if rel.startswith("encodings/")}) == 1
    assert side["encodings/cp437.py"] == side["encodings/cp862.py"] == side["encodings/koi8_r.py"]
    families: dict[str, set[str]] = {}
    for rel in a:
        families.setdefault(re.sub(r"\d+", "#", rel), set()).add(side[rel])
    assert all(len(sides) == 1 for sides in families.values())


def test_stdlib_text_data_val_split_samples():
    data = make_text_data("stdlib", "byte", split="val")
    assert data.stream.num_documents > 0 and data.stream.num_tokens > 10_000
    batch = data.sample(2, 256, gen(0))
    assert batch.tokens.shape == (2, 256) and int(batch.tokens.max()) < 259
    with pytest.raises(ConfigError, match=r"^TextData.generator=0 is not valid; it must be a torch.Generator"):
        data.sample(2, 256, 0)      # was "'int' object has no attribute 'device'"


# ------------------------------------------------------------------------------------------------
# packing


@pytest.fixture
def small_data(tmp_path):
    docs = [("doc %d " % i) * (3 + 7 * (i % 5)) for i in range(30)]
    return make_text_data(str(write_docs(tmp_path, docs)), "byte", split="all"), docs


def test_text_data_has_the_task_interface(small_data):
    data, _ = small_data
    assert isinstance(data, Task) and isinstance(data, TextData)
    assert (data.head, data.metric, data.higher_is_better, data.max_length) == ("lm", "loss", False,
                                                                               None)
    assert data.vocab_size == 259 and data.name


@pytest.mark.parametrize("bos_aligned", [False, True])
def test_packing_targets_doc_ids_and_determinism(small_data, bos_aligned):
    data, docs = small_data
    data.bos_aligned = bos_aligned
    stream = data.stream
    assert stream.num_documents == len(docs)
    assert [BYTE.decode(stream.document(i)) for i in range(len(docs))] == docs
    assert (stream.tokens[stream.starts] == BOS).all() and (stream.tokens == BOS).sum() == len(docs)
    length = 150
    batch = data.sample(16, length, gen(3))
    assert isinstance(batch, Batch)
    assert batch.tokens.shape == batch.targets.shape == batch.loss_mask.shape == batch.doc_ids.shape
    assert batch.tokens.dtype == batch.targets.dtype == batch.doc_ids.dtype == torch.long
    assert batch.loss_mask.all()
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])          # next tokens
    flat = torch.from_numpy(stream.tokens.astype(np.int64))
    cyclic = torch.cat([flat, flat])
    for row, tgt in zip(batch.tokens, batch.targets):                        # a window of the stream
        starts = [s for s in range(stream.num_tokens) if torch.equal(cyclic[s:s + length], row)]
        assert starts and cyclic[starts[0] + length] == tgt[-1]
    assert (batch.doc_ids[:, 0] == 0).all()
    changes = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
    assert torch.equal(changes, batch.tokens[:, 1:] == BOS)                  # exactly at BOS
    assert ((batch.doc_ids[:, 1:] - batch.doc_ids[:, :-1]) <= 1).all()
    if bos_aligned:
        assert (batch.tokens[:, 0] == BOS).all()
    again = data.sample(16, length, gen(3))
    for a, b in zip((batch.tokens, batch.targets, batch.doc_ids), (again.tokens, again.targets,
                                                                   again.doc_ids)):
        assert torch.equal(a, b)
    assert not torch.equal(batch.tokens, data.sample(16, length, gen(4)).tokens)


def test_packing_rows_longer_than_the_stream_wrap_around(small_data):
    data, _ = small_data
    length = data.stream.num_tokens + 17
    with pytest.warns(UserWarning, match=rf"rows of {length} tokens hold more than all {data.stream.num_tokens} "
                                         "tokens of the text: it repeats within each row"):
        batch = data.sample(1, length, gen(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.sample(1, data.stream.num_tokens - 1, gen(0))                   # L + 1 tokens: the whole text once
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    assert torch.equal(batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1], batch.tokens[:, 1:] == BOS)


def test_metrics_per_position_loss(small_data):
    data, _ = small_data
    batch = data.sample(3, 20, gen(0))
    batch.loss_mask[:, :5] = False
    logits = torch.randn(3, 20, data.vocab_size, generator=gen(1))
    loss = data.metrics(logits, batch)["loss"]
    assert loss.shape == (3, 20) and loss[:, :5].isnan().all()
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.targets,
                                                 reduction="none")
    torch.testing.assert_close(loss[:, 5:], expected[:, 5:])


# ------------------------------------------------------------------------------------------------
# long documents and the token cache


def test_long_documents_rows_and_errors(tmp_path):
    lengths = [10, 50, 100, 200, 61, 59]
    docs = ["".join(chr(97 + (i + j) % 26) for j in range(n)) for i, n in enumerate(lengths)]
    path = write_docs(tmp_path, docs)
    rows = long_documents(str(path), "byte", min_length=60, count=3, seed=0, split="all")
    assert rows.shape == (3, 60) and rows.dtype == torch.long
    assert (rows[:, 0] == BOS).all()
    texts = [BYTE.decode(r[1:]) for r in rows]
    long_docs = [d for d in docs if len(d) >= 60]
    assert len(set(texts)) == 3 and all(any(d.startswith(t) for d in long_docs) for t in texts)
    assert torch.equal(rows, long_documents(str(path), "byte", 60, 3, seed=0, split="all"))
    with pytest.raises(CorpusError, match=r"need 4 documents of at least 60 tokens .* found 3 .*the "
                                          r"longest has 200 tokens"):
        long_documents(str(path), "byte", min_length=60, count=4, split="all")
    data = make_text_data(str(path), "byte", split="all")
    batch = data.long_batch(100, 2, seed=1)
    assert batch.tokens.shape == (2, 100) and (batch.doc_ids == 0).all()
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:]) and (batch.targets != BOS).all()
    assert torch.equal(data.long_documents(60, 3, seed=0), rows)


def test_long_documents_from_stdlib():
    rows = long_documents("stdlib", "byte", min_length=4096, count=2, seed=0, split="val")
    assert rows.shape == (2, 4096) and (rows[:, 0] == BOS).all() and (rows[:, 1:] < 256).all()


def test_pretokenize_cache_round_trip(tmp_path, monkeypatch):
    corpus = FileCorpus(write_docs(tmp_path, ["aaa", "bb", "c"]))
    first = pretokenize(corpus, BYTE, cache=True, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    monkeypatch.setattr(FileCorpus, "documents", lambda self: (_ for _ in ()).throw(AssertionError))
    second = pretokenize(corpus, BYTE, cache=True, cache_dir=tmp_path / "cache")
    assert isinstance(second, TokenStream) and second.name == first.name
    assert np.array_equal(first.tokens, second.tokens) and np.array_equal(first.starts, second.starts)


def test_hf_corpus_with_a_stand_in_datasets_module(monkeypatch):
    """The HF path without network: a stand-in ``datasets`` module."""
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": "alpha"}, {"text": " "}, {"text": "beta"}, {"text": "gamma"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    data = make_text_data("hf:org/name:cfg", "byte", split="val", max_documents=2)
    assert calls == [("org/name", "cfg", "validation", True)]
    assert [BYTE.decode(data.stream.document(i)) for i in range(2)] == ["alpha", "beta"]
    with pytest.raises(CorpusError, match=r"example 0 has no 'body' field \(found \['text'\]\)"):
        make_text_data("hf:org/name", "byte", max_tokens=10, text_field="body")
    # hf_split names the training text: its val split would be the same documents, so it is refused, and a run's
    # long documents come from its training text, labelled as such, with a warning
    with pytest.raises(ValueError, match=r"hf_split='train' names the split the run trains on"):
        make_text_data("hf:org/name", "byte", split="val", max_documents=2, hf_split="train")
    cfg = DataConfig(kind="text", text={"corpus": "hf:org/name", "hf_split": "train", "max_documents": 3})
    with pytest.warns(UserWarning, match="no validation split to read: long documents are evaluated on the text"):
        source = eval_source(cfg, make_source(cfg))
    assert source.describe(1, 4) == "1 long document (train split, which the run trained on)"
    # val_fraction holds out examples of the one split by a hash of their index: disjoint, together all of it
    calls.clear()
    parts = {split: make_text_data("hf:org/name", "byte", split=split, max_documents=3, hf_split="train",
                                   val_fraction=0.5) for split in ("train", "val", "all")}
    texts = {split: {BYTE.decode(d.stream.document(i)) for i in range(d.stream.num_documents)}
             for split, d in parts.items()}
    assert texts["train"] and texts["val"] and not texts["train"] & texts["val"]
    assert texts["train"] | texts["val"] == texts["all"] == {"alpha", "beta", "gamma"}
    assert {call[2] for call in calls} == {"train"}


def test_the_start_line_says_how_much_text_the_run_has(tmp_path, capsys):
    """train on text said only 'data: text {corpus = ...}' at the start (the counts needed data.text.verbose):
    the data line now gives the documents and tokens of the training split (the validation text is read at the
    first evaluation)."""
    from lengthgen.cli import main

    train_path = write_docs(tmp_path, [f"train document {i} " * 8 for i in range(40)], "train.jsonl")
    tiny = ["model.dim=16", "model.layers=1", "model.heads=2", "train.steps=1", "data.length=16", "data.kind='text'"]

    def data_line(text: str) -> str:
        args = [a for o in [*tiny, f"data.text={text}"] for a in ("--set", o)]
        assert main(["train", *args, "--out", str(tmp_path / "run"), "--overwrite", "--no-progress"]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  data: "))

    split = make_text_data(corpus=str(train_path), cache=False).stream
    assert data_line(f'{{corpus = "{train_path}", cache = false}}').endswith(
        f"(train split {split.num_documents} documents, {split.num_tokens:,} tokens); evaluated at 16")
