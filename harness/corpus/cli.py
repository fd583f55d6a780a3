"""``ftharness data prepare [SOURCE] --out DIR``, and the default corpus a job uses.

The environment is read here and only here: the default corpus lives in
``$XDG_CACHE_HOME/ftharness/corpus/<fingerprint>`` (``~/.cache`` without it), never inside the
package, and is prepared the first time a job with ``data.kind = "tokens"`` and no
``data.corpus`` runs (:func:`corpus_for_job`, called while the config is resolved, in the CLI
process, before any worker starts).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.corpus.prepare import PrepareOptions, Say, fingerprint, prepare
from harness.corpus.sources import stdlib_source
from harness.corpus.tokenfile import Corpus, CorpusError, open_corpus


def cache_root() -> Path:
    """Where prepared default corpora are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ftharness" / "corpus"


def default_corpus_dir() -> Path:
    """The cache directory of the default corpus (the standard library, default options): its
    name is the fingerprint, so a changed standard library gets a directory of its own."""
    return cache_root() / fingerprint(stdlib_source(), PrepareOptions())[:16]


def corpus_for_job(corpus: str | None, say: Say | None = None) -> Corpus:
    """The corpus a job trains on, opened and verified: ``corpus`` (a directory ``ftharness data
    prepare`` wrote), or None: the default corpus, prepared now if it is not in the cache."""
    if corpus is None:
        out = default_corpus_dir()
        quiet: Say = lambda _msg: None  # noqa: E731
        if not (out / "manifest.json").exists() and say is not None:
            say(f"preparing the default corpus (the standard library) into {out}, once")
            prepare(None, out, say=say)
        else:  # reused (checked against its checksums): nothing to say on every run
            prepare(None, out, say=quiet)
        return open_corpus(out)
    path = Path(corpus).expanduser()
    if not path.is_dir():
        raise CorpusError(
            f"data.corpus = {corpus}: no such directory (prepare one: ftharness data prepare "
            f"SOURCE --out {corpus})"
        )
    return open_corpus(path)


def main(args: argparse.Namespace) -> int:
    if args.data_command == "verify":
        from harness.corpus import verify

        progress: Say = (lambda _msg: None) if args.quiet else _say
        return verify.main(args.dir, progress, args.limit)
    if args.data_command != "prepare":  # argparse allows only these; a guard for callers
        print(f"ftharness data: unknown subcommand {args.data_command!r}", file=sys.stderr)
        return 2
    given = {
        key: getattr(args, key)
        for key in ("vocab_size", "heldout", "tokenizer", "text_key", "sample_bytes")
        if getattr(args, key, None) is not None
    }
    opts = PrepareOptions(**given)  # what was not given: PrepareOptions' defaults
    try:
        say: Say = (lambda _msg: None) if args.quiet else _say
        manifest = prepare(args.source, args.out, opts, say=say)
    except (CorpusError, OSError) as exc:
        print(f"ftharness data prepare: {exc}", file=sys.stderr)
        return 2
    splits = manifest["splits"]
    print(
        f"{args.out}: {manifest['tokens']} tokens ({manifest['dtype']}), vocabulary "
        f"{manifest['vocab_size']}, train {splits['train']['documents']} documents, held out "
        f"{splits['heldout']['documents']}"
    )
    return 0


def _say(msg: str) -> None:
    print(f"[ftharness data] {msg}", file=sys.stderr, flush=True)
