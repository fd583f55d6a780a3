"""``ftharness data verify DIR``: find what would fail a run in a prepared corpus, before the run.

Opening a corpus (``harness.corpus.tokenfile.open_corpus``) checks what is cheap and trusts the
manifest for the rest: its ``max_token_id`` says no id is outside the vocabulary. A corrupted
upstream shard whose manifest was rewritten with it (checksums recomputed) opens fine, and its
bad ids crash the embedding of whichever replica group reads them (issue #50's poison data).
This reads everything instead:

* the manifest (format, dtype, vocabulary) and each file's size and xxh3-128 checksum, every
  mismatch listed, not only the first;
* every token id against the vocabulary, in pieces of :data:`CHUNK` ids (a memory map: nothing
  is loaded whole); each bad id is named with its offset in ``tokens.bin``, its split, and its
  document and offset in that document (``index.npy``), the first ``limit`` of them
  (:data:`SHOWN` unless asked) printed, all of them counted, and the largest id compared with
  the manifest's ``max_token_id``;
* the document index: ``documents + 1`` offsets from 0 to the token count, never decreasing,
  and a document boundary where the held-out split starts;
* the tokenizer: it loads, and its vocabulary fits the manifest's.

Exit status: 0 clean, 1 problems found (each on its own line), 2 not a corpus at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.corpus.tokenfile import (
    DTYPES,
    INDEX,
    MANIFEST,
    TOKENIZER,
    TOKENS,
    CorpusError,
    file_checksum,
    read_manifest,
)

#: Token ids read at a time.
CHUNK = 1 << 24
#: Bad ids named one by one by default (``--limit``); the rest are counted.
SHOWN = 1000


@dataclass(frozen=True)
class BadId:
    """A token id outside the vocabulary, and where it sits."""

    offset: int  # in tokens.bin
    value: int
    split: str
    document: int  # its number in index.npy (0-based, over both splits)
    in_document: int  # its offset in that document


@dataclass
class Verdict:
    """What :func:`verify` found."""

    path: Path
    tokens: int = 0
    documents: int = 0
    problems: list[str] = field(default_factory=list)
    bad_ids: list[BadId] = field(default_factory=list)  # the first ``limit``
    limit: int = SHOWN
    bad_count: int = 0
    max_id: int = -1
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.problems and not self.bad_count


def verify(
    path: str | Path, say: Callable[[str], None] = lambda _m: None, limit: int = SHOWN
) -> Verdict:
    """Check corpus directory ``path`` (module doc), naming at most ``limit`` bad ids. Raises
    CorpusError only where it is not a corpus at all (no readable manifest); everything else is
    a problem in the verdict."""
    t0 = time.monotonic()
    root = Path(path)
    manifest = read_manifest(root)
    v = Verdict(root, limit=limit)
    _check_files(root, manifest, v, say)
    tokens = _tokens(root, manifest, v)
    index = _index(root, manifest, v)
    if tokens is not None:
        _check_ids(manifest, tokens, index, v, say)
    _check_tokenizer(root, manifest, v)
    v.seconds = time.monotonic() - t0
    return v


def _check_files(root: Path, manifest: dict[str, Any], v: Verdict, say: Callable) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        v.problems.append(f"{root / MANIFEST}: no file list")
        return
    for name, want in files.items():
        file = root / name
        if not file.is_file():
            v.problems.append(f"{file}: missing (listed in {MANIFEST})")
            continue
        size = file.stat().st_size
        if size != want.get("bytes"):
            v.problems.append(f"{file}: {size} bytes, {MANIFEST} says {want.get('bytes')}")
            continue
        say(f"checksum of {name} ({size} bytes)")
        if file_checksum(file) != want.get("xxh3_128"):
            v.problems.append(f"{file}: its checksum is not the one {MANIFEST} lists")


def _tokens(root: Path, manifest: dict[str, Any], v: Verdict) -> np.ndarray | None:
    name = manifest.get("dtype")
    if name not in DTYPES:
        v.problems.append(f"{root / MANIFEST}: dtype {name!r} is none of {list(DTYPES)}")
        return None
    dtype, limit = DTYPES[name]
    if int(manifest.get("vocab_size", 0)) > limit:
        v.problems.append(f"{root / MANIFEST}: a vocabulary of {manifest['vocab_size']} > {name}")
    file = root / TOKENS
    try:
        size = file.stat().st_size
    except OSError as exc:
        v.problems.append(f"{file}: {exc.strerror}")
        return None
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        v.problems.append(f"{file}: {size} bytes, not a whole number of {name} ids")
    n = size // itemsize
    v.tokens = n
    if n != int(manifest.get("tokens", -1)):
        v.problems.append(f"{file}: {n} ids, {MANIFEST} says {manifest.get('tokens')}")
    return np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)


def _index(root: Path, manifest: dict[str, Any], v: Verdict) -> np.ndarray | None:
    file = root / INDEX
    try:
        index = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        v.problems.append(f"{file}: unreadable: {exc}")
        return None
    if index.ndim != 1 or len(index) < 1:
        v.problems.append(f"{file}: not a list of document offsets")
        return None
    v.documents = len(index) - 1
    splits = manifest.get("splits") or {}
    want = sum(int((splits.get(s) or {}).get("documents", 0)) for s in ("train", "heldout"))
    if v.documents != want:
        v.problems.append(f"{file}: {v.documents} documents, {MANIFEST} says {want}")
    if int(index[0]) != 0 or int(index[-1]) != v.tokens:
        v.problems.append(
            f"{file}: runs from {int(index[0])} to {int(index[-1])}, not 0 to {v.tokens}"
        )
    steps = np.flatnonzero(np.diff(index.astype(np.int64)) < 0)
    if len(steps):
        v.problems.append(f"{file}: offsets go back at document {int(steps[0]) + 1}")
    start = int((splits.get("heldout") or {}).get("start", v.tokens))
    if start != v.tokens and not len(np.flatnonzero(index == start)):
        v.problems.append(f"{file}: the held-out split starts at {start}, inside a document")
    return index


def _check_ids(
    manifest: dict[str, Any],
    tokens: np.ndarray,
    index: np.ndarray | None,
    v: Verdict,
    say: Callable[[str], None],
) -> None:
    vocab = int(manifest.get("vocab_size", 0))
    heldout = int(((manifest.get("splits") or {}).get("heldout") or {}).get("start", len(tokens)))
    for first in range(0, len(tokens), CHUNK):
        chunk = np.asarray(tokens[first : first + CHUNK])
        if first and first % (CHUNK * 16) == 0:
            say(f"token ids: {first} of {len(tokens)} read")
        if len(chunk):
            v.max_id = max(v.max_id, int(chunk.max()))
        bad = np.flatnonzero(chunk >= vocab)
        v.bad_count += len(bad)
        for i in bad[: max(0, v.limit - len(v.bad_ids))]:
            offset = first + int(i)
            doc, in_doc = _document(index, offset)
            split = "heldout" if offset >= heldout else "train"
            v.bad_ids.append(BadId(offset, int(chunk[i]), split, doc, in_doc))
    said = int(manifest.get("max_token_id", -1))
    if v.max_id != said and len(tokens):
        v.problems.append(
            f"{v.path / MANIFEST}: max_token_id {said}, but the largest id in {TOKENS} is "
            f"{v.max_id}"
        )


def _document(index: np.ndarray | None, offset: int) -> tuple[int, int]:
    if index is None or len(index) < 2:
        return -1, offset
    doc = int(np.searchsorted(index, offset, side="right")) - 1
    return doc, offset - int(index[doc])


def _check_tokenizer(root: Path, manifest: dict[str, Any], v: Verdict) -> None:
    file = root / TOKENIZER
    try:
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(file)).get_vocab_size()
    except Exception as exc:  # tokenizers raises its own Exception type
        v.problems.append(f"{file}: does not load: {str(exc)[:200]}")
        return
    if size > int(manifest.get("vocab_size", 0)):
        v.problems.append(
            f"{file}: a vocabulary of {size}, {MANIFEST} says {manifest.get('vocab_size')}"
        )


def report(v: Verdict) -> list[str]:
    """What the user reads, a line each; the last line is the summary."""
    lines = list(v.problems)
    vocab = "the vocabulary"
    for b in v.bad_ids:
        lines.append(
            f"{v.path / TOKENS}: id {b.value} at offset {b.offset} is outside {vocab} "
            f"({b.split}, document {b.document}, offset {b.in_document} in it)"
        )
    if v.bad_count > len(v.bad_ids):
        lines.append(f"... and {v.bad_count - len(v.bad_ids)} more ids outside {vocab}")
    verdict = (
        "clean"
        if v.clean
        else (f"{len(v.problems)} problem(s), {v.bad_count} id(s) outside the vocabulary")
    )
    lines.append(
        f"{v.path}: {verdict}: {v.tokens} tokens, {v.documents} documents, largest id "
        f"{v.max_id}, read in {v.seconds:.2f} s"
    )
    return lines


def main(path: str, say: Callable[[str], None], limit: int = SHOWN) -> int:
    """``ftharness data verify``: the report on stdout; 0 clean, 1 problems, 2 not a corpus."""
    if limit < 0:
        print(f"ftharness data verify: --limit {limit}: must be >= 0")
        return 2
    try:
        v = verify(path, say, limit)
    except CorpusError as exc:
        print(f"ftharness data verify: {exc}")
        return 2
    for line in report(v):
        print(line)
    return 0 if v.clean else 1
