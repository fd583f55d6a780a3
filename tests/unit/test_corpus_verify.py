"""``ftharness data verify DIR``: a corpus read whole, as a run would meet it (issue #50).

The corruption a run cannot see when it opens a corpus: ids outside the vocabulary in a token
file whose manifest was rewritten with it (its checksum recomputed, as a corrupted upstream shard
arrives), so ``open_corpus`` accepts it. Each case is planted in a corpus prepared here for real.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_corpus_prepare import OPTS, _quiet, make_source

from harness.cli import main as cli_main
from harness.corpus import verify as verify_mod
from harness.corpus.prepare import prepare
from harness.corpus.tokenfile import file_checksum, open_corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    prepare(str(make_source(root)), root / "out", OPTS, say=_quiet)
    return root / "out"


@pytest.fixture
def corpus(prepared, tmp_path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "c"))


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def plant(d: Path, offsets: list[int], value: int) -> None:
    """Ids ``value`` at ``offsets`` of ``d``'s token file, and its manifest's checksum and size
    recomputed (``max_token_id`` left as it was: a corrupted shard's manifest trusts it)."""
    m = _manifest(d)
    tokens = np.fromfile(d / "tokens.bin", dtype=m["dtype"])
    tokens[offsets] = value
    tokens.tofile(d / "tokens.bin")
    m["files"]["tokens.bin"]["xxh3_128"] = file_checksum(d / "tokens.bin")
    (d / "manifest.json").write_text(json.dumps(m))


def _run(capsys, d: Path, *more: str) -> tuple[int, list[str]]:
    rc = cli_main(["data", "verify", str(d), "--quiet", *more])
    return rc, capsys.readouterr().out.strip().splitlines()


def test_a_prepared_corpus_is_clean(capsys, corpus):
    rc, lines = _run(capsys, corpus)
    assert rc == 0, lines
    m = _manifest(corpus)
    assert lines == [
        f"{corpus}: clean: {m['tokens']} tokens, {m['documents']} documents, largest id "
        f"{m['max_token_id']}, read in {lines[-1].rsplit('read in ', 1)[1]}"
    ]


def test_every_id_outside_the_vocabulary_is_named_where_it_sits(capsys, corpus):
    m = _manifest(corpus)
    vocab, n = m["vocab_size"], m["tokens"]
    heldout = m["splits"]["heldout"]["start"]
    offsets = [3, n // 2, heldout + 1]
    plant(corpus, offsets, vocab + 5)
    open_corpus(corpus)  # what a run meets: it opens, and its first read of them crashes

    rc, lines = _run(capsys, corpus)
    assert rc == 1
    index = np.load(corpus / "index.npy")
    for off in offsets:
        doc = int(np.searchsorted(index, off, side="right")) - 1
        split = "heldout" if off >= heldout else "train"
        want = (
            f"{corpus / 'tokens.bin'}: id {vocab + 5} at offset {off} is outside the vocabulary "
            f"({split}, document {doc}, offset {off - int(index[doc])} in it)"
        )
        assert want in lines, lines
    assert any(f"max_token_id {m['max_token_id']}, but the largest id" in ln for ln in lines)
    assert "1 problem(s), 3 id(s) outside the vocabulary" in lines[-1]


def test_past_the_first_ones_bad_ids_are_counted(capsys, corpus):
    m = _manifest(corpus)
    offsets = list(range(0, m["tokens"], 97))
    plant(corpus, offsets, m["vocab_size"])
    rc, lines = _run(capsys, corpus)
    assert rc == 1
    shown = [ln for ln in lines if "is outside the vocabulary" in ln]
    assert len(shown) == len(offsets) < verify_mod.SHOWN  # every one named by default
    rc, lines = _run(capsys, corpus, "--limit", "5")
    assert rc == 1
    assert len([ln for ln in lines if "is outside the vocabulary" in ln]) == 5
    assert f"... and {len(offsets) - 5} more ids outside the vocabulary" in lines
    assert _run(capsys, corpus, "--limit", "-1")[0] == 2


def test_a_changed_file_and_a_broken_index_are_each_listed(capsys, corpus):
    data = bytearray((corpus / "tokens.bin").read_bytes())
    data[10] ^= 1
    (corpus / "tokens.bin").write_bytes(bytes(data))
    index = np.load(corpus / "index.npy")
    index[2], index[3] = index[3], index[2]
    np.save(corpus / "index.npy", index)  # same size, so only its checksum and order tell
    rc, lines = _run(capsys, corpus)
    assert rc == 1
    assert f"{corpus / 'tokens.bin'}: its checksum is not the one manifest.json lists" in lines
    assert f"{corpus / 'index.npy'}: its checksum is not the one manifest.json lists" in lines
    assert f"{corpus / 'index.npy'}: offsets go back at document 3" in lines


def test_a_directory_that_is_no_corpus_exits_2(capsys, tmp_path):
    rc, lines = _run(capsys, tmp_path)
    assert rc == 2
    assert "no manifest.json: not a prepared corpus" in lines[0]
