"""A user's local data as a ``Corpus``: text files (``.txt``, ``.jsonl``) and Hugging Face
``datasets`` datasets (a ``save_to_disk`` folder or local data files) tokenized as bytes or by a
local tokenizer, and pre-tokenized arrays (``.bin``, ``.npy``), with their fingerprint.

Why a fingerprint and not a hash of every byte: a dataset may be many gigabytes, and every peer
(and the coordinator) computes it before training. It covers what makes two peers' data differ in
practice: each file's name, size, first and last MiB; the tokenizer's own bytes; the number of
tokens in each split; and 4096 token values at evenly spaced positions (a sample index). Two
copies that agree on all of it hold the same data for every purpose short of a deliberate forgery,
which the swarm's state-hash agreement would not catch either.

Held-out split: the last twentieth of the token stream (at least one window for the sizes the
caller asks of ``check_sizes``), so it depends on the data alone, like the stdlib corpus' split.

Files match their globs in sorted order (a glob's matches, sorted, then the next glob's); a path
matched twice counts once. Relative paths are taken from the current directory (callers join
them to the run's folder first: ``swarmtrain.config.with_base``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from diloco.data import HELDOUT_MODULUS, Corpus, DataError
from diloco.token_stream import TokenStream, max_token

EDGE_BYTES = 2**20
SAMPLE_TOKENS = 4096
TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# ``[data] kind = "datasets"`` with local files: the ``datasets`` builder each suffix needs.
DATASET_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}


def expand_paths(patterns: tuple[str, ...] | list[str], suffixes: tuple[str, ...]) -> list[Path]:
    """The files ``patterns`` (paths or globs) name, in order. Raises DataError when one matches
    nothing, or matches a file without one of ``suffixes``."""
    found: dict[str, None] = {}
    for pattern in patterns:
        matches = sorted(m for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
        if not matches:
            raise DataError(f"data.paths: {pattern} matches no file")
        for match in matches:
            if not match.endswith(suffixes):
                raise DataError(f"data.paths: {match} is not one of {', '.join(suffixes)}")
            found.setdefault(match)
    return [Path(p) for p in found]


def _file_digest(path: Path) -> bytes:
    """Name, size, first and last MiB: what tells two copies of a file apart, cheaply."""
    size = path.stat().st_size
    hasher = hashlib.sha256(path.name.encode() + b"\0" + size.to_bytes(8, "little"))
    with path.open("rb") as file:
        hasher.update(file.read(EDGE_BYTES))
        file.seek(max(0, size - EDGE_BYTES))
        hasher.update(file.read(EDGE_BYTES))
    return hasher.digest()


def _sample(length: int) -> np.ndarray:
    """Up to ``SAMPLE_TOKENS`` evenly spaced positions in ``range(length)`` (the sample index)."""
    return np.linspace(0, length - 1, num=min(SAMPLE_TOKENS, length)).astype(np.int64)


def fingerprint(
    kind: str, files: list[Path], extra: bytes, train: np.ndarray, heldout: np.ndarray
) -> str:
    """sha256 hex over the kind, the files' digests, ``extra`` (settings and the tokenizer's
    bytes), each split's length and a sample of each split's tokens."""
    hasher = hashlib.sha256(b"swarmtrain/data/1\0" + kind.encode() + b"\0" + extra)
    for path in files:
        hasher.update(_file_digest(path))
    for part in (train, heldout):
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(np.asarray(part[_sample(len(part))], dtype="<u4").tobytes())
    return hasher.hexdigest()


def split_heldout(tokens: np.ndarray | TokenStream) -> tuple[Any, Any]:
    """(train, held out): the held-out part is the stream's last twentieth (views, no copy)."""
    cut = len(tokens) - len(tokens) // HELDOUT_MODULUS
    return tokens[:cut], tokens[cut:]


def _documents(path: Path, field: str) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data.paths: {path} is not UTF-8 text ({exc.reason})") from None
    if path.suffix == ".txt":
        return [text]
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise DataError(f"data.paths: {path}:{number} is not a JSON line") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise DataError(f"data.field: {path}:{number} has no string {field!r}")
        documents.append(value)
    return documents


def tokenizer_path(setting: str) -> Path:
    """The ``tokenizer.json`` that ``data.tokenizer`` names (the file, or a folder holding it).
    Raises DataError when it is absent."""
    path = Path(setting)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"data.tokenizer: {path} does not exist")
    return path


def load_text_corpus(patterns: tuple[str, ...], *, field: str, tokenizer: str) -> Corpus:
    """``.txt`` files (one document each) and ``.jsonl`` files (one document per line, its
    ``field``), each document followed by a newline, tokenized by the ``tokenizers`` library's
    ``tokenizer.json`` at ``tokenizer`` or, when it is "", as UTF-8 bytes (vocabulary 256).
    Raises DataError naming the key or the file."""
    files = expand_paths(patterns, TEXT_SUFFIXES)
    documents = [d + "\n" for path in files for d in _documents(path, field)]
    return _tokenized("text", files, documents, field=field, tokenizer=tokenizer)


def load_datasets_corpus(
    path: str, patterns: tuple[str, ...], *, field: str, tokenizer: str
) -> Corpus:
    """A Hugging Face ``datasets`` dataset: the ``save_to_disk`` folder ``path`` (its "train"
    split when it holds several), or local data files ``patterns`` (.json/.jsonl, .csv,
    .parquet, .txt, .arrow; one format), read without any download. Each row's ``field`` is a
    document, tokenized as ``load_text_corpus`` does; the fingerprint covers the dataset's files.
    Raises DataError naming the key or the file."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # before the import: local files only
    import datasets  # imported here: seconds to import, and only these runs need it

    try:
        if path:
            folder = Path(path)
            if not folder.is_dir():
                raise DataError(f"data.path: {folder} is not a folder (a save_to_disk dataset)")
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            loaded = datasets.load_from_disk(str(folder))
            if isinstance(loaded, datasets.DatasetDict):
                split = "train" if "train" in loaded else sorted(loaded)[0]
                loaded = loaded[split]
        else:
            files = expand_paths(patterns, tuple(DATASET_BUILDERS))
            builders = {DATASET_BUILDERS[p.suffix] for p in files}
            if len(builders) != 1:
                raise DataError(f"data.paths: files of one format please, not {sorted(builders)}")
            loaded = datasets.load_dataset(
                builders.pop(), data_files=[str(p) for p in files], split="train"
            )
    except DataError:
        raise
    except Exception as exc:  # the library's errors: a folder that is no dataset, bad rows
        where = f"data.path: {path}" if path else f"data.paths: {', '.join(patterns)}"
        raise DataError(f"{where} is not a readable dataset: {type(exc).__name__}: {exc}") from None
    if field not in loaded.column_names:
        raise DataError(f"data.field: the dataset has no column {field!r} ({loaded.column_names})")
    column = loaded[field]
    if not all(isinstance(d, str) for d in column):
        raise DataError(f"data.field: column {field!r} does not hold text in every row")
    documents = [d + "\n" for d in column]
    return _tokenized("datasets", files, documents, field=field, tokenizer=tokenizer)


def _tokenized(
    kind: str, files: list[Path], documents: list[str], *, field: str, tokenizer: str
) -> Corpus:
    """``documents`` as one token stream (bytes, or ``tokenizer``'s ids), split and
    fingerprinted."""
    if not tokenizer:
        tokens = np.frombuffer("".join(documents).encode(), dtype=np.uint8)
        vocab_size, extra = 256, b"bytes\0" + field.encode()
    else:
        from tokenizers import Tokenizer  # imported here: only text runs with a tokenizer need it

        path = tokenizer_path(tokenizer)
        try:
            loaded = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception subclasses
            raise DataError(f"data.tokenizer: {path} is not a tokenizer.json: {exc}") from None
        vocab_size = loaded.get_vocab_size(with_added_tokens=True)
        dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
        encoded = loaded.encode_batch(documents, add_special_tokens=False)
        tokens = np.fromiter((i for e in encoded for i in e.ids), dtype=dtype)
        extra = b"tokenizer\0" + field.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest()
    tokens.flags.writeable = False
    train, heldout = split_heldout(tokens)
    names = tuple(str(p) for p in files)
    digest = fingerprint(kind, files, extra, train, heldout)
    return Corpus(train, heldout, names, names, digest, vocab_size)


def _token_array(path: Path, dtype: str) -> np.ndarray:
    want = TOKEN_DTYPES[dtype]
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise DataError(f"data.paths: {path} is not a .npy array: {exc}") from None
        if array.ndim != 1 or array.dtype != want:
            raise DataError(
                f"data.dtype: {path} holds a {array.ndim}-d {array.dtype} array, not 1-d {dtype}"
            )
        if array.size == 0:
            raise DataError(f"data.paths: {path} is empty")
        return array
    size = path.stat().st_size
    if size % want.itemsize:
        raise DataError(f"data.dtype: {path} has {size} bytes, not a whole number of {dtype}")
    if size == 0:
        raise DataError(f"data.paths: {path} is empty")
    return np.memmap(path, dtype=want, mode="r")


def load_token_corpus(patterns: tuple[str, ...], *, dtype: str) -> Corpus:
    """Pre-tokenized ``.bin`` (raw little-endian) or ``.npy`` (1-d) arrays of ``dtype``
    (``uint16`` or ``uint32``), memory-mapped: one stream of the files in order, each file
    staying mapped (several are read through a ``TokenStream``, never concatenated in memory).
    The vocabulary is the largest token + 1, every file scanned in bounded chunks once per
    version of it (``_file_max_token``), so a model whose vocabulary is smaller is refused
    before training (``training.workload``). Raises
    DataError naming the key or the file."""
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"data.dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    files = expand_paths(patterns, TOKEN_SUFFIXES)
    arrays = [_token_array(path, dtype) for path in files]
    tokens = arrays[0] if len(arrays) == 1 else TokenStream(arrays)
    train, heldout = split_heldout(tokens)  # a stream slices as an array does
    names = tuple(str(p) for p in files)
    digest = fingerprint("tokens", files, dtype.encode(), train, heldout)
    vocab_size = max(_file_max_token(p, a) for p, a in zip(files, arrays, strict=True)) + 1
    return Corpus(train, heldout, names, names, digest, vocab_size)


def _scan_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarmtrain" / "token-max"


def _file_max_token(path: Path, array: np.ndarray) -> int:
    """``max_token`` of one token file, cached per version of the file. Why: the scan reads the
    whole file, and every node (and the coordinator) did it at every start; a restart, or a
    second process on the machine, now reads one small cache file. The key is the file's real
    path, size, modification time (ns), inode and dtype, so a rewritten file is scanned again.
    An unreadable or unwritable cache only means scanning (``$XDG_CACHE_HOME/swarmtrain``)."""
    st = path.stat()
    version = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{array.dtype.str}"
    cached = _scan_cache() / hashlib.sha256(version.encode()).hexdigest()[:32]
    try:
        return int(cached.read_text())
    except (OSError, ValueError):
        pass
    found = max_token(array)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}")
        partial.write_text(str(found))
        os.replace(partial, cached)  # processes starting together never read a half-written one
    except OSError:
        pass
    return found
