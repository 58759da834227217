"""Tokenizers for language modelling: bytes (default, no dependencies), tiktoken and Hugging Face.

Every tokenizer has ``name``, ``vocab_size``, ``bos_id`` (prepended to each packed document),
``eos_id`` / ``pad_id`` (``None`` where the tokenizer has none), ``encode``, ``encode_array``,
``encode_batch`` and ``decode``, and a ``cache_key`` that changes whenever its ids would.

Nothing here downloads: tiktoken's BPE files must already be in its cache and a Hugging Face
tokenizer is read from a local ``tokenizer.json``; otherwise a ``ResourceUnavailableError`` says what
is missing and how to provide it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lengthgen.optional import require


class ResourceUnavailableError(FileNotFoundError):
    """A tokenizer's files or encodings are not available locally (and nothing is downloaded)."""


class Tokenizer:
    """Interface shared by the tokenizers."""

    name: str = ""
    vocab_size: int = 0
    bos_id: int = 0
    eos_id: int | None = None
    pad_id: int | None = None

    @property
    def cache_key(self) -> str:
        """A string that identifies the id mapping (used to key on-disk token caches)."""
        return self.name

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a 1-D integer array."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def _as_numpy(ids) -> np.ndarray:
    """A 1-D int64 array from a list, numpy array or torch tensor of ids."""
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)


def _to_int_list(ids: Iterable[int]) -> list[int]:
    return _as_numpy(ids).tolist()


def _scalar_values(text: str) -> str:
    """``text`` with each lone surrogate (JSON may escape one, ``"\\ud800"``; `tokenizers` refuses it) replaced by
    U+FFFD, as tiktoken's ``encode`` does."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS = 256, EOS = 257, PAD = 258 (``vocab_size`` 259).

    ``decode`` drops the special ids and decodes the bytes with ``errors="replace"``. Lone surrogates
    in the input are encoded with ``surrogatepass`` so that encoding never fails.
    """

    name = "byte"
    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_numpy(ids)
        ids = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
        return ids.tobytes().decode("utf-8", errors="replace")




# --------------------------------------------------------------------------------------------------
# tiktoken


def _tiktoken_cache_dir(tiktoken_load) -> str:
    """Where tiktoken looks for its cached BPE files (mirrors tiktoken.load.read_file_cached)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    default = getattr(tiktoken_load, "_default_cache_dir", None)
    if callable(default):
        return default()
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")   # tiktoken < 0.10


class _DownloadBlocked(Exception):
    def __init__(self, url: str):
        super().__init__(url)
        self.url = url


def _get_encoding_offline(tiktoken, encoding: str, allow_download: bool):
    """``tiktoken.get_encoding`` that raises instead of downloading a missing BPE file."""
    if allow_download:
        return tiktoken.get_encoding(encoding)
    load = getattr(tiktoken, "load", None)
    original = getattr(load, "read_file", None)
    if original is None:   # unknown tiktoken layout: cannot intercept the download; try and explain
        try:
            return tiktoken.get_encoding(encoding)
        except Exception as e:   # noqa: BLE001
            raise ResourceUnavailableError(
                f"TiktokenTokenizer({encoding!r}): could not load the encoding ({type(e).__name__}: "
                f"{e}). tiktoken downloads its BPE files on first use; run it once with network "
                f"access or copy the files into $TIKTOKEN_CACHE_DIR.") from e

    def read_file(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _DownloadBlocked(blobpath)
        return original(blobpath)

    load.read_file = read_file
    try:
        return tiktoken.get_encoding(encoding)
    except _DownloadBlocked as e:
        cache_dir = _tiktoken_cache_dir(load)
        cached = os.path.join(cache_dir, hashlib.sha1(e.url.encode()).hexdigest())
        raise ResourceUnavailableError(
            f"TiktokenTokenizer({encoding!r}): the BPE file {e.url} is not in tiktoken's local cache "
            f"(looked for {cached}) and lengthgen does not download it. Either run once with network "
            f"access: python -c \"import tiktoken; tiktoken.get_encoding({encoding!r})\", copy the "
            f"cached files into $TIKTOKEN_CACHE_DIR, or pass allow_download=True.") from None
    finally:
        load.read_file = original


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (default ``gpt2``, the modded-nanogpt tokenizer). BOS = EOS = the
    encoding's end-of-text token; text is encoded with ``encode_ordinary`` (special-token strings in
    the text are plain text). Needs ``pip install tiktoken`` and the BPE files in tiktoken's cache."""

    def __init__(self, encoding: str = "gpt2", *, allow_download: bool = False,
                 num_threads: int | None = None):
        tiktoken = require("tiktoken", f"TiktokenTokenizer({encoding!r})",
                           "tiktoken (or pip install 'lengthgen[data]')")
        known = list(tiktoken.list_encoding_names())
        if encoding not in known:
            raise ValueError(f"TiktokenTokenizer: unknown encoding {encoding!r}; tiktoken knows "
                             f"{', '.join(sorted(known))}")
        self._enc = _get_encoding_offline(tiktoken, encoding, allow_download)
        self.encoding = encoding
        self.name = f"tiktoken:{encoding}" if encoding != "gpt2" else "gpt2"
        self.vocab_size = int(self._enc.n_vocab)
        self.bos_id = self.eos_id = int(self._enc.eot_token)
        self.pad_id = None
        self.num_threads = num_threads or os.cpu_count() or 1

    @property
    def cache_key(self) -> str:
        return f"tiktoken:{self.encoding}"

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._enc.encode_ordinary_batch(list(texts), num_threads=self.num_threads)
        return [np.asarray(ids, dtype=np.int64) for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([i for i in _to_int_list(ids) if 0 <= i < self.vocab_size])


# --------------------------------------------------------------------------------------------------
# Hugging Face tokenizers

_BOS_CANDIDATES = ("<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>", "[CLS]")
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer read from a local ``tokenizer.json`` (or a directory
    holding one, e.g. from ``AutoTokenizer.save_pretrained``). Nothing is downloaded.

    BOS is ``bos_token`` if given, else the first of the usual names (``<|endoftext|>``, ``<s>``,
    ...) present in the vocabulary; if none is, a new id ``vocab_size`` is appended for it. A BOS the file adds as a
    token not marked special is marked special, so that its text in a document is text. Truncation and padding
    saved in the file are turned off: documents are encoded whole.
    """

    def __init__(self, path: str | os.PathLike, *, bos_token: str | None = None):
        tokenizers = require("tokenizers", f"HFTokenizer({str(path)!r})",
                             "tokenizers (or pip install 'lengthgen[hf]')")
        _HFTok = tokenizers.Tokenizer
        p = Path(path).expanduser()
        if p.is_dir():
            if not (p / "tokenizer.json").is_file():
                found = sorted(x.name for x in p.iterdir())[:20]
                raise ResourceUnavailableError(
                    f"HFTokenizer: directory {p} has no tokenizer.json (found: {found or 'nothing'}). "
                    f"Save a fast tokenizer there, e.g. AutoTokenizer.from_pretrained(name)"
                    f".save_pretrained('{p}') on a machine with network access; nothing is downloaded.")
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ResourceUnavailableError(
                f"HFTokenizer: tokenizer file {p} does not exist. Provide a local tokenizer.json (or a "
                f"directory with one), e.g. saved with AutoTokenizer.from_pretrained(name)"
                f".save_pretrained(dir); nothing is downloaded.")
        try:
            self._tok = _HFTok.from_file(str(p))
        except Exception as e:   # noqa: BLE001  (tokenizers raises a bare Exception on bad JSON)
            raise ValueError(f"HFTokenizer: could not read {p} as a tokenizers tokenizer.json: "
                             f"{type(e).__name__}: {e}") from e
        self.path = p
        # a document is encoded whole and unpadded, whatever truncation or padding the file was saved with
        self._tok.no_truncation()
        self._tok.no_padding()
        # a special token's text inside a document is text (tiktoken's encode_ordinary), so a BOS (<s>,
        # <|endoftext|>) marked special comes only where lengthgen puts one, at a document's start (an added token
        # not marked special still matches its text: `tokenizers` applies this to special tokens only)
        self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._base = max(vocab.values()) + 1 if vocab else 0
        self.name = f"hf:{p}"

        def find(candidates):
            for tok in candidates:
                if tok in vocab:
                    return vocab[tok]
            return None

        if bos_token is not None:
            if bos_token not in vocab:
                raise ValueError(f"HFTokenizer({str(p)!r}): bos_token {bos_token!r} is not in the "
                                 f"vocabulary")
            self.bos_id = vocab[bos_token]
        else:
            found = find(_BOS_CANDIDATES)
            self.bos_id = found if found is not None else self._base
        self.vocab_size = max(self._base, self.bos_id + 1)
        bos = self._tok.get_added_tokens_decoder().get(self.bos_id)
        if bos is not None and not bos.special:     # else its text in a document would be a BOS mid-document
            self._tok.add_special_tokens([tokenizers.AddedToken(bos.content, special=True)])
        self.eos_id = find(_EOS_CANDIDATES)
        self.pad_id = find(_PAD_CANDIDATES)

    @property
    def bos_added(self) -> bool:
        """Whether BOS is an id appended past the tokenizer's vocabulary (it names no BOS token)."""
        return self.bos_id >= self._base

    @property
    def cache_key(self) -> str:
        digest = hashlib.sha1(self.path.read_bytes()).hexdigest()[:16]
        return f"hf:{digest}:bos{self.bos_id}:ordinary:whole:bos-special"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(_scalar_values(text), add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch([_scalar_values(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in out]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([i for i in _to_int_list(ids) if 0 <= i < self._base],
                                skip_special_tokens=False)


# --------------------------------------------------------------------------------------------------

TOKENIZER_NAMES = ("byte", "gpt2", "tiktoken:<encoding>", "hf:<path to tokenizer.json or its directory>")


def make_tokenizer(name: str | Tokenizer = "byte", **options) -> Tokenizer:
    """``"byte"``, ``"gpt2"`` (= ``"tiktoken:gpt2"``; a bare ``"tiktoken"`` too, kept for configs that use it),
    ``"tiktoken:<encoding>"`` (e.g. ``"tiktoken:cl100k_base"``) or ``"hf:<path>"``.
    A ``Tokenizer`` instance is returned as is. ``options`` go to the tokenizer's constructor."""
    if isinstance(name, Tokenizer):
        return name
    if not isinstance(name, str):
        raise ValueError(f"tokenizer must be a name or a Tokenizer, got {name!r}; valid names: "
                         f"{', '.join(TOKENIZER_NAMES)}")
    if name == "byte":
        if options:
            raise ValueError(f"tokenizer 'byte' takes no options, got {sorted(options)}")
        return ByteTokenizer()
    if name in ("gpt2", "tiktoken"):
        return TiktokenTokenizer("gpt2", **options)
    if name.startswith("tiktoken:") and len(name) > len("tiktoken:"):
        return TiktokenTokenizer(name[len("tiktoken:"):], **options)
    if name.startswith("hf:") and len(name) > len("hf:"):
        return HFTokenizer(name[len("hf:"):], **options)
    raise ValueError(f"unknown tokenizer {name!r}; valid names: {', '.join(TOKENIZER_NAMES)}")
