"""The prepared corpus on disk, and the checks made when it is opened.

A corpus directory (``ftharness data prepare --out DIR``) holds:

* ``tokens.bin``: every document's token ids, one after the other, each document followed by the
  end-of-text id (when the tokenizer has one), as raw little-endian ``uint16`` (vocabulary up to
  65536) or ``uint32``. The training documents come first, then the held-out ones: the
  ``train`` split is tokens ``[0, train_tokens)``, ``heldout`` the rest. Read with ``np.memmap``.
* ``index.npy``: ``uint64`` offsets of the documents' first tokens, plus the total at the end
  (``documents + 1`` values): the document boundaries.
* ``tokenizer.json``: the Hugging Face ``tokenizers`` tokenizer that made the ids.
* ``manifest.json`` (written last: a directory without it is not a corpus): the format version,
  where the text came from and its fingerprint, the tokenizer, ``vocab_size``, ``dtype``, the
  token and document counts of each split, and the xxh3-128 checksum and size of each file.

Contract: :func:`open_corpus` returns only a corpus whose files match their manifest (sizes
always; checksums when ``verify``, the default), whose dtype holds its vocabulary and whose ids
are below it. Not guaranteed: that a file does not change after it was opened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from harness.config import ConfigError

FORMAT = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
INDEX = "index.npy"
TOKENIZER = "tokenizer.json"
#: The files a corpus directory holds, the manifest last.
FILES = (TOKENS, INDEX, TOKENIZER, MANIFEST)
#: The token dtypes by name, and the vocabulary each holds.
DTYPES = {"uint16": (np.uint16, 1 << 16), "uint32": (np.uint32, 1 << 32)}


class CorpusError(ConfigError):
    """A corpus that must not be prepared or used; the message says which file and why. A
    ConfigError: a job whose corpus is bad is refused as a bad config is, before it starts."""


def dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds ids ``0 .. vocab_size - 1``."""
    for name, (_, limit) in DTYPES.items():
        if vocab_size <= limit:
            return name
    raise CorpusError(f"a vocabulary of {vocab_size} does not fit in 32-bit token ids")


def file_checksum(path: Path) -> str:
    """xxh3-128 of a file's bytes (hex), read in 8 MiB pieces."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Corpus:
    """An opened corpus: its directory, manifest and memory-mapped tokens and index."""

    path: Path
    manifest: dict[str, Any]
    tokens: np.ndarray  # memmap, 1-D
    index: np.ndarray  # uint64 document starts plus the total

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def split(self, name: str) -> np.ndarray:
        """The tokens of split ``train`` or ``heldout`` (a view of the memmap, no copy)."""
        s = self.manifest["splits"][name]
        return self.tokens[int(s["start"]) : int(s["end"])]


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of corpus directory ``path``; CorpusError if absent or unreadable."""
    file = Path(path) / MANIFEST
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(
            f"{path}: no {MANIFEST}: not a prepared corpus (ftharness data prepare --out {path})"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{file}: unreadable manifest: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorpusError(f"{file}: not a corpus manifest of format {FORMAT}")
    return data


def verify_files(path: Path, manifest: dict[str, Any], *, checksums: bool = True) -> None:
    """Each file's size (and checksum) against the manifest; CorpusError naming the first that
    differs."""
    for name, want in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorpusError(f"{file}: missing (listed in {path / MANIFEST})")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CorpusError(
                f"{file}: {size} bytes, its manifest says {want['bytes']}: the corpus was changed "
                f"or cut short; remove {path} and prepare it again"
            )
        if checksums and file_checksum(file) != want["xxh3_128"]:
            raise CorpusError(
                f"{file}: checksum does not match its manifest: the corpus was changed or is "
                f"corrupt; remove {path} and prepare it again"
            )


def open_corpus(path: str | Path, *, verify: bool = True) -> Corpus:
    """Open a prepared corpus read-only; see the module doc for what is checked."""
    root = Path(path)
    manifest = read_manifest(root)
    verify_files(root, manifest, checksums=verify)
    dtype_name = manifest.get("dtype")
    if dtype_name not in DTYPES:
        raise CorpusError(f"{root / MANIFEST}: dtype {dtype_name!r}: must be one of {list(DTYPES)}")
    dtype, limit = DTYPES[dtype_name]
    vocab = int(manifest["vocab_size"])
    if vocab > limit:
        raise CorpusError(
            f"{root / MANIFEST}: a vocabulary of {vocab} does not fit the token dtype {dtype_name} "
            f"(at most {limit})"
        )
    if int(manifest.get("max_token_id", -1)) >= vocab:
        raise CorpusError(
            f"{root / MANIFEST}: token id {manifest['max_token_id']} is outside the tokenizer's "
            f"vocabulary of {vocab}"
        )
    n = int(manifest["tokens"])
    tokens = (
        np.memmap(root / TOKENS, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    )
    index = np.load(root / INDEX, mmap_mode="r")
    return Corpus(path=root, manifest=manifest, tokens=tokens, index=index)
