"""``ftharness data prepare``: the token file, its index and manifest, reuse, and bad input.

A tiny source made here (text files and a JSONL file), a tokenizer trained on it for real
(Hugging Face ``tokenizers``); every assertion reads the files back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main as cli_main
from harness.config import config_from_dict
from harness.corpus.job import resolve_data
from harness.corpus.prepare import PrepareOptions, prepare
from harness.corpus.tokenfile import CorpusError, dtype_for, open_corpus

WORDS = [
    "the",
    "model",
    "trains",
    "on",
    "text",
    "and",
    "every",
    "replica",
    "heals",
    "from",
    "a",
    "peer",
    "while",
    "others",
    "go",
    "on",
]
OPTS = PrepareOptions(vocab_size=300, heldout=0.2)


def _text(rng: random.Random, n: int) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]
    return "\n".join(f"def f{i}():\n    return {line!r}" for i, line in enumerate(lines)) + "\n"


def make_source(root: Path, docs: int = 24) -> Path:
    rng = random.Random(0)
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(docs):
        (src / ("sub" if i % 3 else "") / f"doc{i:02d}.txt").write_text(_text(rng, 40))
    with open(src / "more.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"text": _text(rng, 20), "id": i}) + "\n")
    return src


def _quiet(_msg: str) -> None:
    pass


def test_prepare_writes_a_token_file_that_decodes_back_to_every_document(tmp_path):
    from tokenizers import Tokenizer

    src = make_source(tmp_path)
    m = prepare(str(src), tmp_path / "out", OPTS, say=_quiet)
    c = open_corpus(tmp_path / "out")
    assert m["dtype"] == "uint16" and c.tokens.dtype == np.uint16
    assert m["documents"] == 24 + 6 == len(c.index) - 1
    assert int(c.index[-1]) == m["tokens"] == len(c.tokens)
    train, held = m["splits"]["train"], m["splits"]["heldout"]
    assert held["documents"] >= 1 and train["documents"] + held["documents"] == 30
    assert train["end"] == held["start"] and held["end"] == m["tokens"]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    eot = m["tokenizer"]["eot_id"]
    texts = {p.read_text() for p in src.rglob("*.txt")}
    texts |= {json.loads(line)["text"] for line in (src / "more.jsonl").read_text().splitlines()}
    decoded = set()
    for a, b in zip(c.index[:-1], c.index[1:], strict=True):
        ids = c.tokens[int(a) : int(b)].tolist()
        assert ids[-1] == eot and eot not in ids[:-1]  # one end-of-text after each document
        decoded.add(tok.decode(ids[:-1]))
    assert decoded == texts  # every document, exactly, and nothing else
    assert int(c.tokens.max()) == m["max_token_id"] < m["vocab_size"] <= 300


def test_the_fast_encoding_equals_the_tokenizers_own(tmp_path):
    """Pieces encoded once and gathered (a trained tokenizer) give the ids the tokenizer gives
    whole documents (the path a --tokenizer takes)."""
    src = make_source(tmp_path)
    prepare(str(src), tmp_path / "a", OPTS, say=_quiet)
    given = PrepareOptions(
        vocab_size=300, heldout=0.2, tokenizer=str(tmp_path / "a/tokenizer.json")
    )
    m = prepare(str(src), tmp_path / "b", given, say=_quiet)
    assert m["tokenizer"]["kind"] == "given"
    assert (tmp_path / "a/tokens.bin").read_bytes() == (tmp_path / "b/tokens.bin").read_bytes()


def test_an_unchanged_source_is_reused_and_a_different_one_refused(tmp_path):
    src = make_source(tmp_path)
    out = tmp_path / "out"
    said: list[str] = []
    first = prepare(str(src), out, OPTS, say=said.append)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare(str(src), out, OPTS, say=said.append)
    assert again == first and "reused" in said[-1]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    (src / "doc00.txt").write_text("something else entirely\n" * 50)
    with pytest.raises(CorpusError, match="already holds a different corpus"):
        prepare(str(src), out, OPTS, say=_quiet)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing written


def test_a_changed_token_file_fails_its_checksum(tmp_path):
    prepare(str(make_source(tmp_path)), tmp_path / "out", OPTS, say=_quiet)
    path = tmp_path / "out" / "tokens.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="checksum does not match"):
        open_corpus(tmp_path / "out")
    with pytest.raises(CorpusError, match="checksum does not match"):  # and reuse refuses it
        prepare(str(tmp_path / "src"), tmp_path / "out", OPTS, say=_quiet)
    path.write_bytes(bytes(data[:-2]))
    with pytest.raises(CorpusError, match="bytes, its manifest says"):
        open_corpus(tmp_path / "out", verify=False)


def test_a_vocabulary_the_dtype_cannot_hold_is_refused(tmp_path):
    assert (dtype_for(65536), dtype_for(65537)) == ("uint16", "uint32")
    prepare(str(make_source(tmp_path)), tmp_path / "out", OPTS, say=_quiet)
    manifest = tmp_path / "out" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "vocab_size": 70000}))
    with pytest.raises(CorpusError, match="does not fit the token dtype uint16"):
        open_corpus(tmp_path / "out")
    manifest.write_text(json.dumps({**m, "vocab_size": 10}))
    with pytest.raises(CorpusError, match="outside the tokenizer's vocabulary"):
        open_corpus(tmp_path / "out")


def _with(d: Path, name: str, text: str) -> Path:
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "missing", "no such file or directory"),
        (lambda d: d, "no .txt, .jsonl, .parquet file"),
        (lambda d: _with(d, "a.txt", ""), "no text"),
        (lambda d: _with(d, "a.jsonl", "{not json\n"), "a.jsonl:1: not a JSON"),
        (lambda d: _with(d, "a.jsonl", '{"body": "x"}\n'), "no string field 'text'"),
        (lambda d: _with(d, "a.jsonl", "[" * 100_000 + "]" * 100_000), "a.jsonl:1: nested too"),
        (lambda d: str(d / "*.md"), "the glob matches no file"),
    ],
)
def test_bad_sources_are_refused_before_anything_is_written(tmp_path, make, match):
    src = tmp_path / "src"
    src.mkdir()
    source = make(src)
    with pytest.raises(CorpusError, match=match):
        prepare(str(source), tmp_path / "out", OPTS, say=_quiet)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.bin"))


def test_an_out_dir_holding_other_files_is_refused(tmp_path):
    src = make_source(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(CorpusError, match="holds other files"):
        prepare(str(src), tmp_path / "out", OPTS, say=_quiet)
    # refused before its lock file is made: the folder is as the user left it
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_the_cli_prepares_and_says_what_is_wrong(tmp_path, capsys):
    src = make_source(tmp_path)
    args = ["data", "prepare", str(src), "--out", str(tmp_path / "o"), "--quiet"]
    assert cli_main([*args, "--vocab-size", "300"]) == 0
    assert "tokens (uint16)" in capsys.readouterr().out
    assert cli_main(["data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "p")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_job_takes_its_vocabulary_from_the_corpus_and_must_fit_it(tmp_path):
    prepare(str(make_source(tmp_path)), tmp_path / "out", OPTS, say=_quiet)
    data = {"kind": "tokens", "corpus": str(tmp_path / "out"), "eval_every": 10}
    cfg = resolve_data(config_from_dict({"data": data}))
    assert cfg.data.vocab_size == open_corpus(tmp_path / "out").vocab_size
    assert cfg.data.corpus == str((tmp_path / "out").resolve())
    with pytest.raises(CorpusError, match="longer than the corpus"):
        resolve_data(config_from_dict({"data": {**data, "seq_len": 10**6}}))
    with pytest.raises(CorpusError, match="held-out split"):
        resolve_data(config_from_dict({"data": {**data, "eval_batches": 1000}}))
    with pytest.raises(CorpusError, match="no such directory"):
        resolve_data(config_from_dict({"data": {**data, "corpus": str(tmp_path / "none")}}))
