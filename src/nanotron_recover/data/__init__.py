"""Data: tokenized corpora on disk, deterministic micro-batches, preprocessing, an offline corpus.

* :mod:`.corpus` -- the on-disk format (``tokens.bin`` + ``index.json``), writer and reader.
* :mod:`.microbatches` -- micro-batch id -> token tensor, a pure function (determinism).
* :mod:`.preprocess` -- stream a HF dataset, tokenize, write a corpus (``nanotron-recover preprocess``).
* :mod:`.local_corpus` -- stdlib docstrings as an offline dataset + tokenizer for tests and demos.

Heavy libraries (``datasets``, ``transformers``, ``tokenizers``) are imported lazily inside the
functions that need them, so importing this package is cheap for the trainer.
"""

from nanotron_recover.data.corpus import (
    FORMAT_VERSION,
    CorpusIndex,
    CorpusWriter,
    TokenCorpus,
    dtype_for_vocab,
)
from nanotron_recover.data.local_corpus import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    LocalDataset,
    build_local_corpus,
    build_local_tokenizer,
    ensure_local_dataset,
    stdlib_docstring_texts,
)
from nanotron_recover.data.microbatches import (
    CorpusMicroBatches,
    MicroBatchSource,
    SyntheticMicroBatches,
    build_microbatch_source,
)
from nanotron_recover.data.preprocess import add_preprocess_arguments, preprocess, run_preprocess

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "FORMAT_VERSION",
    "CorpusIndex",
    "CorpusMicroBatches",
    "CorpusWriter",
    "LocalDataset",
    "MicroBatchSource",
    "SyntheticMicroBatches",
    "TokenCorpus",
    "add_preprocess_arguments",
    "build_local_corpus",
    "build_local_tokenizer",
    "build_microbatch_source",
    "dtype_for_vocab",
    "ensure_local_dataset",
    "preprocess",
    "run_preprocess",
    "stdlib_docstring_texts",
]
