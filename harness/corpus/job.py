"""A job's config with its corpus resolved: ``data.kind = "tokens"`` made concrete.

Called in the CLI process while the config is resolved (``harness.job.site.prepare_site``, and
earlier by ``ftharness run`` and ``chaos`` so that a bad corpus is refused before anything
starts): the default corpus is prepared if it is not in the cache, the corpus is opened and
checked against its checksums, ``data.corpus`` becomes its absolute path and
``data.vocab_size`` its tokenizer's vocabulary (what the model is built for). Workers then only
open the files (``harness.rank.token_data``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from harness.config import JobConfig, config_from_dict, config_to_dict
from harness.corpus.cli import corpus_for_job
from harness.corpus.tokenfile import Corpus, CorpusError


def resolve_data(cfg: JobConfig, say: Callable[[str], None] | None = None) -> JobConfig:
    """``cfg`` unchanged for synthetic data; else with its corpus path and vocabulary set, after
    checking that the corpus fits the job. CorpusError (a ConfigError) says what does not."""
    if cfg.data.kind != "tokens":
        return cfg
    corpus = corpus_for_job(cfg.data.corpus, say)
    check_fits(cfg, corpus)
    data = dataclasses.replace(
        cfg.data, corpus=str(corpus.path.resolve()), vocab_size=corpus.vocab_size
    )
    # validated again as a whole: the vocabulary sizes the model and the logits
    return config_from_dict(config_to_dict(dataclasses.replace(cfg, data=data)))


def check_fits(cfg: JobConfig, corpus: Corpus) -> None:
    """A training sequence, and every held-out batch, must fit in its split."""
    d = cfg.data
    train = len(corpus.split("train"))
    if train < d.seq_len + 1:
        raise CorpusError(
            f"data.seq_len = {d.seq_len} is longer than the corpus {corpus.path} "
            f"({train} training tokens)"
        )
    held = max(0, len(corpus.split("heldout")) - 1) // d.seq_len
    want = d.eval_batches * d.batch_size
    if d.eval_every and held < want:
        raise CorpusError(
            f"data.eval_batches x data.batch_size = {want} held-out sequences of {d.seq_len} "
            f"tokens; the held-out split of {corpus.path} has {held}: lower eval_batches or "
            "prepare the corpus with a larger --heldout"
        )
