"""A real corpus with no download: text tokenized into a memory-mapped token file.

Runs in the CLI process (``ftharness data prepare``, and a job's config resolution when
``data.kind = "tokens"``), never in a worker: a worker only opens what was prepared
(:mod:`harness.corpus.tokenfile`). Modules: ``sources`` (which files, which documents, the
fingerprint that says whether a source changed), ``prepare`` (tokenizer, token file, index,
manifest, reuse), ``tokenfile`` (the format, its checksums and the checks on open), ``cli``
(the subcommand).
"""

from harness.corpus.tokenfile import CorpusError

__all__ = ["CorpusError"]
