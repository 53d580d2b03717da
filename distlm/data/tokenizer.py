"""Tokenizers: GPT-2's (vendored files, fully offline) and byte-level BPEs trained on
the user's documents with Hugging Face ``tokenizers``; both encode with tiktoken.

Both treat ``<|endoftext|>`` inside text as ordinary characters: only ``eos_id``,
appended by ``prepare`` between documents, is the real end-of-text token. Otherwise
one stray string in a web page would forge a document boundary.
"""
from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

from distlm.data import DataError, read_regular_text

GPT2_DIR = Path(__file__).resolve().parent.parent / "assets" / "gpt2"
EOT = "<|endoftext|>"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Pinned: a damaged or swapped vocabulary would silently change every token id.
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
BPE_VOCAB_RANGE = (257, 1 << 20)  # at least the 256 byte tokens plus <|endoftext|>
_UINT32 = next(code for code in "ILQ" if array(code).itemsize == 4)
# Byte-level BPEs (GPT-2's and ByteLevel's) spell each byte as a printable character:
# bytes that print stand for themselves, the other 68 moved to U+0100 on, in order.
_PRINTABLE = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
_TO_LATIN1 = {0x100 + i: b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}


def _token_bytes(token: str) -> bytes:
    return token.translate(_TO_LATIN1).encode("latin-1")


class Tokenizer:
    """What ``prepare``, the trainer and ``generate`` use: a tiktoken encoding and its metadata.

    Attributes: ``name`` ("gpt2" or "bpe:N"), ``vocab_size``, ``eos_id``.
    """

    name: str
    vocab_size: int
    eos_id: int
    chunk_chars = 1 << 19  # piece size that ``prepare`` feeds to ``encode_packed``
    encoding = None  # tiktoken.Encoding

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[list[int]]:
        if num_threads == 1:
            return [self.encoding.encode_ordinary(t) for t in texts]
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads or 8)

    def encode_packed(self, texts: Sequence[str]) -> list[bytes]:
        """Each text's ids as little-endian ``dtype`` bytes, as shards hold them (one thread)."""
        to_numpy = getattr(self.encoding, "encode_to_numpy", None)  # tiktoken >= 0.8: skips the list
        if to_numpy is None:
            code = "H" if self.dtype == "uint16" else _UINT32
            return [_packed(array(code, ids)) for ids in self.encode_batch(texts, num_threads=1)]
        # Nothing allowed as special, so <|endoftext|> in text is text, as in encode().
        dtype = "<u2" if self.dtype == "uint16" else "<u4"
        return [to_numpy(t, disallowed_special=()).astype(dtype).tobytes() for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def fingerprint(self) -> str:
        """sha256 (hex) of what defines the token ids."""
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Write what ``load_tokenizer(self.name, directory)`` needs."""
        raise NotImplementedError

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def __repr__(self) -> str:
        return f"<Tokenizer {self.name} vocab={self.vocab_size} eos={self.eos_id}>"


def _gpt2_ranks(encoder_json: bytes) -> tuple[dict[bytes, int], int]:
    """encoder.json as tiktoken's merge ranks (token bytes -> id), and the id of <|endoftext|>.

    GPT-2's ids already are merge ranks (id = 256 + line of the merge in vocab.bpe);
    the pinned sha256 of both files stands in for re-deriving that at every start.
    """
    vocab = json.loads(encoder_json)
    eos = vocab.pop(EOT)
    return {_token_bytes(token): rank for token, rank in vocab.items()}, eos


class GPT2Tokenizer(Tokenizer):
    """OpenAI's GPT-2 BPE, built offline from the vendored encoder.json/vocab.bpe.

    The tiktoken encoding is built on first use: ``prepare`` only needs the name,
    sizes and fingerprint in the parent process, its workers do the encoding.
    """

    name, vocab_size, eos_id = "gpt2", 50257, 50256

    def __init__(self) -> None:
        digest, files = hashlib.sha256(), {}
        for fname, want in sorted(GPT2_SHA256.items()):
            path = GPT2_DIR / fname
            try:
                files[fname] = path.read_bytes()
            except OSError as e:
                raise DataError(f"{path}: cannot read the vendored GPT-2 vocabulary ({e.strerror})") from None
            if hashlib.sha256(files[fname]).hexdigest() != want:
                raise DataError(f"{path}: sha256 differs from the vendored GPT-2 file; reinstall distlm")
            digest.update(fname.encode() + b"\0" + bytes.fromhex(want))
        self._fingerprint, self._encoder_json, self._enc = digest.hexdigest(), files["encoder.json"], None

    @property
    def encoding(self):
        if self._enc is None:
            import tiktoken
            ranks, eos = _gpt2_ranks(self._encoder_json)
            assert eos == self.eos_id and len(ranks) + 1 == self.vocab_size
            self._enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={EOT: eos})
        return self._enc

    def fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_enc": None}  # to a spawned worker: rebuilt there from encoder.json

    def save(self, directory: Path) -> None:
        pass  # vendored with distlm: nothing to write


class BPETokenizer(Tokenizer):
    """A byte-level BPE from ``train_bpe``, kept as Hugging Face ``tokenizer.json`` text.

    It encodes with tiktoken, given the vocabulary as merge ranks: the trainer numbers
    tokens in merge order, and tiktoken splits text with the ByteLevel pre-tokenizer's
    own GPT-2 pattern, so the ids are those of ``tokenizers`` (the tests compare them),
    several times faster. A vocabulary where one token comes from two merges breaks
    that numbering and is encoded by ``tokenizers`` itself.
    """

    def __init__(self, name: str, json_text: str, source: str = "tokenizer.json") -> None:
        try:
            spec = json.loads(json_text)
            vocab, merges, pre = spec["model"]["vocab"], spec["model"]["merges"], spec["pre_tokenizer"] or {}
            ok = spec["model"]["type"] == "BPE" and pre.get("type") == "ByteLevel" and not pre["add_prefix_space"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{source}: not a valid tokenizer file ({type(e).__name__}: {e})") from None
        if not ok or EOT not in vocab or sorted(vocab.values()) != list(range(len(vocab))):
            raise DataError(f"{source}: not a byte-level BPE with {EOT} as made by `distlm prepare`")
        self.name, self._json, self.vocab_size, self.eos_id = name, json_text, len(vocab), vocab[EOT]
        made = [vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m)) for m in merges]
        if None in made or any(a >= b for a, b in zip(made, made[1:])):
            self.encoding = _HFEncoding(json_text)
            self.chunk_chars = 1 << 14  # tokenizers is faster on many small pieces
        else:
            import tiktoken
            ranks = {_token_bytes(token): i for token, i in vocab.items() if token != EOT}
            self.encoding = tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                              special_tokens={EOT: self.eos_id})

    def fingerprint(self) -> str:
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self._json, encoding="utf-8")


class _HFEncoding:
    """``tokenizers`` behind the tiktoken methods used here, for vocabularies tiktoken cannot take."""

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        self.hf = HFTokenizer.from_str(json_text)
        self.hf.encode_special_tokens = True  # typed "<|endoftext|>" stays text, as with tiktoken

    def encode_ordinary(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


def parse_bpe_size(name: str) -> int:
    """N of ``bpe:N``; DataError naming the value otherwise."""
    head, _, size = name.partition(":")
    if head != "bpe" or not size.isdigit():
        raise DataError(f"unknown tokenizer {name!r}: use 'gpt2' or 'bpe:N' (e.g. bpe:4096)")
    n = int(size)
    lo, hi = BPE_VOCAB_RANGE
    if not lo <= n <= hi:
        raise DataError(f"tokenizer {name!r}: N must be between {lo} and {hi}")
    return n


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens; the same texts give the same ids.

    Id 0 is ``<|endoftext|>``, ids 1..256 the bytes, then merges in the order learned.
    The vocabulary is smaller than asked when the texts run out of pairs to merge.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    name = f"bpe:{vocab_size}"
    parse_bpe_size(name)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(name, tok.to_str())


@lru_cache(maxsize=1)
def gpt2() -> GPT2Tokenizer:
    return GPT2Tokenizer()


def load_tokenizer(name: str, data_dir: Path | str | None = None) -> Tokenizer:
    """``"gpt2"``, or ``"bpe:N"`` from ``data_dir/tokenizer.json`` (written by prepare)."""
    if name == "gpt2":
        return gpt2()
    n = parse_bpe_size(name)
    if data_dir is None:
        raise DataError(f"tokenizer {name!r} is trained by prepare: pass the data folder holding its tokenizer.json")
    path = Path(data_dir) / "tokenizer.json"
    try:
        text = read_regular_text(path, TOKENIZER_MAX_BYTES, "the tokenizer")
    except FileNotFoundError:
        raise DataError(f"{path}: missing; a {name} tokenizer is written there by `distlm prepare`") from None
    tok = BPETokenizer(name, text, str(path))
    if tok.vocab_size > n:
        raise DataError(f"{path}: has {tok.vocab_size} tokens, more than {name} allows")
    return tok


RECORD_MAX_BYTES = 1 << 20  # a tokenizer record is a few lines; anything bigger is not one
TOKENIZER_MAX_BYTES = 256 << 20  # a BPE's tokenizer.json: a few MB at the largest vocabulary


def read_tokenizer_record(path: Path) -> dict:
    """A run's ``tokenizer.meta.json``, checked: a one-line DataError naming the file for one
    that is not a regular file, unreadable, not JSON, or not a tokenizer record."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        raise DataError(f"{path}: not a regular file; a run's tokenizer record is written by `distlm train`")
    try:
        if path.stat().st_size > RECORD_MAX_BYTES:
            raise DataError(f"{path}: {path.stat().st_size:,} bytes, too large for a tokenizer record")
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path}: not a readable tokenizer record ({type(e).__name__})") from None
    return check_tokenizer_record(record, path)


def check_tokenizer_record(record, source) -> dict:
    """The fields a tokenizer record (a run's tokenizer.meta.json, a manifest's "tokenizer")
    must hold, with their types: ``name``, and ``vocab_size`` and ``fingerprint`` where present
    (what distlm writes has all three; a record of the name alone still loads)."""
    if not isinstance(record, dict):
        raise DataError(f"{source}: the tokenizer record is not a mapping")
    name, size, fp = record.get("name"), record.get("vocab_size"), record.get("fingerprint")
    if not isinstance(name, str) or not name:
        raise DataError(f"{source}: the tokenizer record has no name (got {name!r})")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= BPE_VOCAB_RANGE[1]):
        raise DataError(f"{source}: tokenizer vocab_size must be an integer in 1..{BPE_VOCAB_RANGE[1]}, got {size!r}")
    if fp is not None and not (isinstance(fp, str) and len(fp) == 64 and all(c in "0123456789abcdef" for c in fp)):
        raise DataError(f"{source}: tokenizer fingerprint must be a sha256 in hex, got {str(fp)[:80]!r}")
    return record


def load_recorded_tokenizer(record, directory: Path | str, source) -> Tokenizer:
    """The tokenizer a record names, from ``directory``, refused unless it is the one the
    record describes: the same fingerprint (sha256 of what defines the ids) where the record
    has one, and the same vocabulary size. Two ids swapped in tokenizer.json keep the size
    but not the fingerprint, and would decode every sample wrong without a word."""
    record = check_tokenizer_record(record, source)
    tok = load_tokenizer(record["name"], directory)
    where = Path(directory) / "tokenizer.json" if record["name"] != "gpt2" else GPT2_DIR
    if record.get("fingerprint") and tok.fingerprint() != record["fingerprint"]:
        raise DataError(f"{where}: fingerprint {tok.fingerprint()[:12]} is not the {record['fingerprint'][:12]} "
                        f"recorded in {source}: the tokenizer was changed after the run recorded it")
    if record.get("vocab_size") is not None and tok.vocab_size != record["vocab_size"]:
        raise DataError(f"{where}: {tok.vocab_size} tokens, but {source} records {record['vocab_size']}")
    return tok


# The longest piece the tokenizers are given: tiktoken aborted the process (a Rust panic,
# exit 134) on a single multi-GB "word"; 64 Mi characters encode in under a minute.
HARD_CUT = 1 << 26


def split_for_encoding(text: str, size: int) -> Iterator[str]:
    """Cut ``text`` into pieces of about ``size`` chars that tokenize exactly as the whole.

    A cut at index i is safe when text[i] is whitespace and text[i-1] is not: the
    GPT-2 pattern (shared by the ByteLevel pre-tokenizer) always ends a piece there,
    and none of its branches looks past a non-space character, so both halves split
    into the same pieces as before. (Python's isspace() covers every character the
    pattern's \\s matches.) Text with no such place stays whole.
    """
    start, n = 0, len(text)
    while n - start > size:
        lo, hi = start + max(1, size // 2), start + size
        cut = _safe_cut(text, "\n", lo, hi) or _safe_cut(text, " ", lo, hi) or _next_safe_cut(text, hi)
        if not cut or cut - start > HARD_CUT:
            # No safe place within HARD_CUT characters (one "word" of megabytes, from a small
            # compressed file): cut there anyway. Its tokens differ from the whole's only at the
            # cut, and tiktoken is never handed a piece it aborts the process on.
            if n - start <= HARD_CUT:
                break
            cut = start + HARD_CUT
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


def _safe_cut(text: str, sep: str, lo: int, hi: int) -> int:
    """The last index in [lo, hi) holding ``sep`` after a non-space character; 0 if none."""
    while hi > lo:
        j = text.rfind(sep, lo, hi)
        if j < 0:
            return 0
        if not text[j - 1].isspace():
            return j
        hi = j
    return 0


def _next_safe_cut(text: str, pos: int) -> int:
    """The first safe newline cut at or after ``pos``; 0 if none."""
    j = text.find("\n", pos)
    while j > 0 and text[j - 1].isspace():
        j = text.find("\n", j + 1)
    return max(j, 0)


def _packed(run: array) -> bytes:
    if sys.byteorder == "big":  # shards are little-endian everywhere
        run.byteswap()
    return run.tobytes()
