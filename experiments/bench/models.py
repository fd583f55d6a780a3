"""The models the benches train, as config overrides of ``experiments/tiny.toml``: one table, so
that ``bench overhead`` and ``bench recovery`` measure the same model under the same name."""

from __future__ import annotations

#: Model name -> ``--set`` overrides. ``llama3_debug`` is torchtitan's llama3 debug model (6.16 M
#: parameters), whose vocabulary is fixed at 2048 tokens.
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "llama3_debug": [
        "model.kind=llama3_debug",
        "data.seq_len=128",
        "data.batch_size=4",
        "data.vocab_size=2048",
    ],
}
