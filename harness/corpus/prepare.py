"""Prepare a corpus: documents -> byte-level BPE tokenizer -> token file, index and manifest.

Steps, each timed in the manifest (``timings``): find the source's files and check the output
directory (every bad input is reported here, before anything is written); read the documents;
split them into train and held-out by a hash of each document's name (so the split does not
depend on the order or the number of other documents, and a held-out document is never trained
on, nor seen by the tokenizer's training); train the tokenizer on a sample of the training
documents (every k-th, about ``sample_bytes`` of text: BPE merges settle long before the whole
corpus is read) unless one is given; encode every document (Hugging Face ``tokenizers``, in
Rust, on all cores); write the files into a private folder inside ``out`` and move them into
place, the manifest last. See :mod:`harness.corpus.tokenfile` for the format.

Reuse: the manifest records a fingerprint of the source (its files' paths, sizes and times) and
of the options; preparing again into a directory whose manifest has the same fingerprint only
checks the files against their checksums. A directory holding a different corpus, or anything
else, is an error: nothing is overwritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from harness.corpus.sources import Source, documents, find_source
from harness.corpus.tokenfile import (
    DTYPES,
    FILES,
    FORMAT,
    INDEX,
    MANIFEST,
    TOKENIZER,
    TOKENS,
    CorpusError,
    dtype_for,
    file_checksum,
    read_manifest,
    verify_files,
)

#: The end-of-text token a trained tokenizer puts between documents (id 0).
EOT = "<|endoftext|>"
#: How a trained tokenizer splits text before BPE: words with their leading space, runs of
#: digits, runs of punctuation, whitespace. GPT-2's pattern (the ByteLevel default) has a
#: look-ahead that made encoding 2-3x slower here, for the same kind of pieces.
SPLIT_PATTERN = r" ?[A-Za-z_]+| ?[0-9]+| ?[^\sA-Za-z_0-9]+|\s+"
#: Text encoded per call to the tokenizer (progress is shown between calls).
_ENCODE_BATCH_BYTES = 4 << 20

Say = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"[ftharness data] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """What ``ftharness data prepare`` is asked for besides the source and ``--out``."""

    # of a tokenizer trained here: 2048, the llama3 debug model's own, which keeps the tiny model's
    # output layer (most of its compute at this size) small on a CPU
    vocab_size: int = 2048
    heldout: float = 0.01  # fraction of the documents held out (by a hash of their names)
    tokenizer: str | None = None  # a tokenizer.json to use instead of training one
    text_key: str = "text"  # the field of a .jsonl record / column of a .parquet file
    sample_bytes: int = 2 << 20  # text the tokenizer is trained on (a sample of the documents)

    def check(self) -> None:
        if not 257 <= self.vocab_size <= 1 << 20:
            raise CorpusError(f"--vocab-size {self.vocab_size}: must be 257 .. {1 << 20}")
        if not 0.0 < self.heldout < 0.5:
            raise CorpusError(f"--heldout {self.heldout}: must be a fraction in (0, 0.5)")
        if self.sample_bytes < 1:
            raise CorpusError("--sample-bytes must be positive")
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise CorpusError(f"--tokenizer {self.tokenizer}: no such file")


def fingerprint(src: Source, opts: PrepareOptions) -> str:
    """What makes two preparations the same corpus: the format, the source and the options."""
    h = xxhash.xxh3_128()
    described = {**asdict(opts), "format": FORMAT, "split": SPLIT_PATTERN}
    if opts.tokenizer is not None:
        described["tokenizer"] = file_checksum(Path(opts.tokenizer))
    h.update(json.dumps(described, sort_keys=True).encode())
    h.update(src.fingerprint().encode())
    return h.hexdigest()


def prepare(
    source: str | None, out: str | Path, opts: PrepareOptions | None = None, *, say: Say = _stderr
) -> dict[str, Any]:
    """Prepare (or reuse) the corpus of ``source`` in ``out``; return its manifest. CorpusError
    for every bad input, before anything in ``out`` is written."""
    opts = opts or PrepareOptions()
    opts.check()
    t0, cpu0 = time.perf_counter(), time.process_time()
    src = find_source(source, text_key=opts.text_key)
    fp = fingerprint(src, opts)
    root = Path(out).expanduser()
    if root.exists() and not root.is_dir():
        raise CorpusError(f"--out {root}: exists and is not a directory")
    if root.is_dir():
        _check_out(root, fp)  # refused before the lock file is made: nothing left behind
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        found = _reusable(root, fp)
        if found is not None:
            say(f"{root}: already prepared from {src.name} ({found['tokens']:,} tokens); reused")
            return found
        return _prepare(src, root, fp, opts, say, t0, cpu0)


def _check_out(root: Path, fp: str) -> dict[str, Any] | None:
    """CorpusError if ``root`` holds something other than this corpus (a different one, or
    files that are no corpus's); else its manifest, None if it has none yet (unverified)."""
    if (root / MANIFEST).exists():
        manifest = read_manifest(root)
        if manifest.get("fingerprint") != fp:
            raise CorpusError(
                f"--out {root} already holds a different corpus (from {manifest.get('source')}, "
                f"vocabulary {manifest.get('vocab_size')}): choose another --out, or remove it "
                "to prepare this one there"
            )
        return manifest
    others = sorted(p.name for p in root.iterdir() if p.name not in FILES and p.name[0] != ".")
    if others:
        raise CorpusError(
            f"--out {root} holds other files ({', '.join(others[:3])}...): a corpus needs an "
            "empty or new directory"
        )
    return None  # new, or a preparation interrupted before its manifest: ours to write


def _reusable(root: Path, fp: str) -> dict[str, Any] | None:
    """The manifest of ``root`` if it holds this very corpus (checked against its checksums),
    None if it holds nothing of ours; CorpusError if it holds something else."""
    manifest = _check_out(root, fp)
    if manifest is not None:
        verify_files(root, manifest)
    return manifest


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One preparation of a directory at a time (two jobs resolving the default corpus)."""
    with open(root / ".lock", "a") as f:  # "a": never truncated, its time unchanged
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_heldout(name: str, fraction: float) -> bool:
    return xxhash.xxh3_64_intdigest(name.encode()) < fraction * 2**64


def _prepare(
    src: Source, root: Path, fp: str, opts: PrepareOptions, say: Say, t0: float, cpu0: float
) -> dict[str, Any]:
    from tokenizers import Tokenizer

    timings: dict[str, float] = {}
    size = src.total_bytes()
    say(f"reading {len(src.files)} files ({size / 1e6:.1f} MB) from {src.name}")
    train: list[str] = []
    held: list[str] = []
    for name, text in documents(src):
        if text:
            (held if _is_heldout(name, opts.heldout) else train).append(text)
    text_bytes = sum(len(t) for t in train) + sum(len(t) for t in held)
    if not train or text_bytes == 0:
        raise CorpusError(f"source {src.name}: no text in its {len(src.files)} files")
    if not held:  # a tiny source: hold out its last document, keep at least one to train on
        if len(train) < 2:
            raise CorpusError(f"source {src.name}: one document; a held-out split needs two")
        held.append(train.pop())
    timings["read_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    tok: Any
    if opts.tokenizer is not None:
        try:
            tok = Tokenizer.from_file(opts.tokenizer)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise CorpusError(
                f"--tokenizer {opts.tokenizer}: not a tokenizer.json: {exc}"
            ) from None
        kind = "given"
    else:
        sample = _sample(train, opts.sample_bytes)
        say(
            f"training a byte-level BPE tokenizer (vocabulary {opts.vocab_size}) on "
            f"{sum(map(len, sample)) / 1e6:.1f} MB of {len(train)} training documents"
        )
        tok = _Trained(train_tokenizer(sample, opts.vocab_size))
        kind = "trained"
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype_name = dtype_for(vocab)
    eot = tok.token_to_id(EOT)
    timings["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        tok.save(str(partial / TOKENIZER))
        dtype = DTYPES[dtype_name][0]
        starts: list[int] = []
        max_id = -1
        with open(partial / TOKENS, "wb") as f:
            n_train, max_id = _encode(tok, train, eot, dtype, f, starts, 0, say, "train")
            n_total, max_held = _encode(tok, held, eot, dtype, f, starts, n_train, say, "held-out")
        max_id = max(max_id, max_held)
        np.save(partial / INDEX, np.asarray([*starts, n_total], dtype=np.uint64))
        timings["encode_s"] = time.perf_counter() - t
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "fingerprint": fp,
            "source": src.name,
            "source_files": len(src.files),
            "text_bytes": text_bytes,
            "tokenizer": {"kind": kind, "file": TOKENIZER, "eot_id": eot},
            "vocab_size": vocab,
            "max_token_id": max_id,
            "dtype": dtype_name,
            "tokens": n_total,
            "documents": len(train) + len(held),
            "splits": {
                "train": {"documents": len(train), "start": 0, "end": n_train},
                "heldout": {"documents": len(held), "start": n_train, "end": n_total},
            },
            "options": asdict(opts),
            "files": {
                name: {
                    "bytes": (partial / name).stat().st_size,
                    "xxh3_128": file_checksum(partial / name),
                }
                for name in (TOKENS, INDEX, TOKENIZER)
            },
        }
        for name in (TOKENS, INDEX, TOKENIZER):
            os.replace(partial / name, root / name)
        timings["total_s"] = time.perf_counter() - t0
        manifest["timings"] = {k: round(v, 3) for k, v in timings.items()}
        manifest["mb_per_s"] = round(size / 1e6 / timings["total_s"], 2)
        # CPU seconds of this process, all threads (the wall time depends on the machine's load)
        manifest["cpu_s"] = round(time.process_time() - cpu0, 2)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        os.replace(partial / MANIFEST, root / MANIFEST)  # last: now it is a corpus
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    split = ", ".join(f"{k} {v:.1f} s" for k, v in manifest["timings"].items())
    say(
        f"{root}: {n_total:,} tokens ({dtype_name}, vocabulary {vocab}) from {size / 1e6:.1f} MB "
        f"at {manifest['mb_per_s']} MB/s ({split}; {manifest['cpu_s']} s of CPU); held out: "
        f"{len(held)} documents, {n_total - n_train:,} tokens"
    )
    return manifest


def _byte_chars() -> dict[int, str]:
    """Byte -> the character ByteLevel writes it as (GPT-2's ``bytes_to_unicode``): printable
    bytes as themselves, the others as the characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in out)
    out.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return out


def _sample(docs: Sequence[str], budget: int) -> list[str]:
    """Every k-th document, about ``budget`` characters in all (all of them if fewer)."""
    total = sum(map(len, docs))
    step = max(1, total // max(1, budget))
    return list(docs[::step])


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (Hugging Face ``tokenizers``, offline),
    with :data:`EOT` as id 0. Its vocabulary is at most ``vocab_size`` (less on little text)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


class _Trained:
    """A tokenizer trained here, with the pattern its pre-tokenizer splits text by (``_encode``
    encodes each distinct piece once), and :meth:`encode_piece`."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.pre_split = re.compile(SPLIT_PATTERN)
        self._model = tok.model
        self._bytes = str.maketrans({chr(b): c for b, c in _byte_chars().items()})

    def encode_piece(self, piece: str) -> list[int]:
        """The ids of one piece of :data:`SPLIT_PATTERN`, as the whole pipeline gives them: its
        UTF-8 bytes as ByteLevel's characters, then the BPE model alone (5x faster per piece
        than the pipeline, which also tracks offsets; tests compare the two)."""
        chars = piece.encode("utf-8").decode("latin-1").translate(self._bytes)
        return [t.id for t in self._model.tokenize(chars)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def _encode(
    tok: Any,
    docs: Sequence[str],
    eot: int | None,
    dtype: Any,
    f: Any,
    starts: list[int],
    offset: int,
    say: Say,
    label: str,
) -> tuple[int, int]:
    """Encode ``docs`` into ``f`` (each followed by ``eot``), appending each one's first token's
    offset to ``starts``; return the offset after them and the largest id written.

    A tokenizer trained here (``tok.pre_split``) encodes each distinct piece of text once: the
    pieces (:data:`SPLIT_PATTERN`, which its pre-tokenizer splits by too, so each piece encodes
    alone as it would in its document) are found by Python's ``re``, numbered, and the ids of
    the distinct ones gathered with numpy. Encoding whole documents through ``tokenizers``
    tracks character offsets through every step and ran at 1-2 MB/s a core here. A given
    tokenizer (``--tokenizer``) encodes whole documents, its own way."""
    words = getattr(tok, "pre_split", None)
    known: dict[str, int] = {}
    flat = np.zeros(0, dtype=np.int64)  # the distinct pieces' ids, one after the other
    first = np.zeros(1, dtype=np.int64)  # where each piece's ids start in ``flat``
    max_id = -1
    i = done = 0
    total = sum(map(len, docs))
    while i < len(docs):
        j, size = i, 0
        while j < len(docs) and (size < _ENCODE_BATCH_BYTES or j == i):
            size += len(docs[j])
            j += 1
        if words is None:
            pieces: list[np.ndarray] = []
            for enc in tok.encode_batch_fast(docs[i:j], add_special_tokens=False):
                pieces.append(np.asarray(enc.ids + ([] if eot is None else [eot]), np.int64))
            lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
            arr = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        else:
            numbers: list[int] = []
            per_doc: list[int] = []
            for doc in docs[i:j]:
                found = words.findall(doc)
                # number the pieces not seen before (a loop over the document's distinct pieces
                # only), then look every piece up (a map of a bound method: no frame per piece)
                unseen = [w for w in dict.fromkeys(found) if w not in known]
                known.update(zip(unseen, itertools.count(len(known))))
                numbers.extend(map(known.__getitem__, found))
                if eot is not None:
                    numbers.append(-1)  # the end-of-text marker
                per_doc.append(len(found) + (eot is not None))
            new = list(known)[len(first) - 1 :]
            if new:
                ids = [tok.encode_piece(w) for w in new]
                lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
                flat = np.concatenate(
                    [flat, np.fromiter(itertools.chain.from_iterable(ids), np.int64)]
                )
                first = np.concatenate([first, first[-1] + np.cumsum(lens)])
            arr, lengths = _gather(np.asarray(numbers, np.int64), per_doc, flat, first, eot)
        doc_starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        starts.extend(int(x) for x in doc_starts)
        if arr.size:
            max_id = max(max_id, int(arr.max()))
        f.write(arr.astype(dtype).tobytes())
        offset += arr.size
        done += size
        say(f"encoded {label} {done / 1e6:.1f} / {total / 1e6:.1f} MB ({offset:,} tokens)")
        i = j
    return offset, max_id


def _gather(
    numbers: np.ndarray, per_doc: list[int], flat: np.ndarray, first: np.ndarray, eot: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of a run of pieces (``numbers``: each piece's number, -1 for end of text)
    from the distinct pieces' ids, and the tokens of each document (``per_doc`` pieces each)."""
    is_eot = numbers < 0
    safe = np.where(is_eot, 0, numbers)
    lens = np.where(is_eot, 1, first[safe + 1] - first[safe])
    out_start = np.cumsum(lens) - lens
    src = np.where(is_eot, -1, first[safe])
    # ids[k] for output position k: the src of its piece plus its place within the piece
    piece_of = np.repeat(np.arange(len(numbers)), lens)
    within = np.arange(int(lens.sum())) - out_start[piece_of]
    ids = (
        flat[np.maximum(src[piece_of] + within, 0)]
        if flat.size
        else np.zeros(len(piece_of), np.int64)
    )
    if eot is not None:
        ids = np.where(is_eot[piece_of], eot, ids)
    doc_of_piece = np.repeat(np.arange(len(per_doc)), per_doc)
    lengths = np.bincount(doc_of_piece, weights=lens, minlength=len(per_doc)).astype(np.int64)
    return ids.astype(np.int64), lengths
