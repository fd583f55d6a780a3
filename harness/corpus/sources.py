"""Where a corpus's text comes from: the files of a source, their documents, a fingerprint.

A source is a directory (searched recursively), a glob (``**`` allowed) or one file, of
``.txt`` (a file is a document), ``.jsonl`` (a line is a document: its ``text_key`` field) or
``.parquet`` (a row is a document: its ``text_key`` column; needs ``pyarrow``). With no source,
the running interpreter's standard library: its ``.py`` files, without ``site-packages`` (what
the user installed is not the same on every machine) and caches.

The fingerprint covers each file's path, size and modification time (not its bytes: reading
tens of MB to find nothing changed would cost what preparing costs), plus the text key.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from harness.corpus.tokenfile import CorpusError

SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Directories of the standard library that are not the standard library.
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Source:
    """The files a corpus is made from, sorted, and what to call the source."""

    name: str
    root: Path  # document names are relative to it
    files: tuple[Path, ...]
    text_key: str = "text"

    def fingerprint(self) -> str:
        h = xxhash.xxh3_128()
        h.update(f"{self.text_key}\0".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f.relative_to(self.root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        return h.hexdigest()

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def stdlib_source() -> Source:
    """The default: the running interpreter's standard library ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP)
        files += [Path(dirpath) / n for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise CorpusError(f"the standard library at {root} holds no .py files")
    return Source(name=f"stdlib:{root}", root=root, files=tuple(files))


def find_source(source: str | None, *, text_key: str = "text") -> Source:
    """The files of ``source`` (None: :func:`stdlib_source`); CorpusError if there are none."""
    if source is None:
        return stdlib_source()
    path = Path(source).expanduser()
    if any(c in source for c in "*?["):
        found = [Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True)]
        if not found:
            raise CorpusError(f"source {source!r}: the glob matches no file")
        root = Path(os.path.commonpath([p.parent for p in found]))
    elif path.is_dir():
        root, found = path, [p for p in path.rglob("*") if p.is_file()]
    elif path.is_file():
        root, found = path.parent, [path]
    else:
        raise CorpusError(f"source {source}: no such file or directory")
    files = sorted(p for p in found if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise CorpusError(
            f"source {source}: no {', '.join(SUFFIXES)} file in it ({len(found)} other files)"
        )
    return Source(name=str(source), root=root, files=tuple(files), text_key=text_key)


def documents(src: Source) -> Iterator[tuple[str, str]]:
    """Every document of the source as ``(name, text)``, in a fixed order; a name is unique
    within the source and depends on nothing else (the held-out split is chosen by it)."""
    for f in src.files:
        rel = str(f.relative_to(src.root))
        if f.suffix == ".jsonl":
            yield from _jsonl(f, rel, src.text_key)
        elif f.suffix == ".parquet":
            yield from _parquet(f, rel, src.text_key)
        else:  # .txt, and the standard library's .py
            yield rel, f.read_bytes().decode("utf-8", errors="replace")


def _jsonl(f: Path, rel: str, key: str) -> Iterator[tuple[str, str]]:
    with open(f, encoding="utf-8", errors="replace") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{f}:{n}: not a JSON object: {exc}") from None
            except RecursionError:
                raise CorpusError(f"{f}:{n}: nested too deeply to read") from None
            text = obj.get(key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise CorpusError(f"{f}:{n}: no string field {key!r} (--text-key names it)")
            yield f"{rel}:{n}", text


def _parquet(f: Path, rel: str, key: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{f}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(f, columns=[key])
    except Exception as exc:  # pyarrow's own errors: a missing column, a broken file
        raise CorpusError(f"{f}: cannot read column {key!r}: {exc}") from None
    for n, text in enumerate(table.column(key).to_pylist()):
        if isinstance(text, str):
            yield f"{rel}:{n}", text
