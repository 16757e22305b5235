"""Data: tokenized corpora on disk, deterministic micro-batches, preprocessing, an offline corpus.

* :mod:`.corpus` -- the on-disk format (``tokens.bin`` + ``index.json``), writer, reader and
  :func:`validate_corpus` (does a corpus fit the model and its tokenizer?).
* :mod:`.microbatches` -- micro-batch id -> token tensor, a pure function (determinism).
* :mod:`.preprocess` -- stream a HF dataset, tokenize, write a corpus (``nanotron-recover preprocess``).
* :mod:`.tokenization` -- tokenizer fingerprint and ordered multi-process encoding for preprocess.
* :mod:`.local_corpus` -- stdlib docstrings as an offline dataset + tokenizer for tests and demos.

Every name is imported eagerly, torch included (via ``.microbatches``), as the trainer needs
it anyway. Two things depend on that: the ``preprocess`` *function* must be bound after the
``preprocess`` submodule of the same name, and :func:`.local_corpus.stdlib_docstring_texts`
must see the same standard library in every process -- importing torch replaces
``inspect.getfile``, which removes that docstring from the collected texts, so a lazily
imported torch would make the offline corpus depend on what a process imported before.
(The price: each spawned tokenization worker of preprocess imports torch too, ~1 s and
~150 MB once per worker.) Heavy libraries that are not needed to *use* a corpus
(``datasets``, ``transformers``, ``tokenizers``) are imported inside the functions that need them.
"""

from nanotron_recover.data.corpus import (
    FORMAT_VERSION,
    CorpusIndex,
    CorpusWriter,
    TokenCorpus,
    dtype_for_vocab,
    validate_corpus,
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
from nanotron_recover.data.preprocess import (
    PreprocessResult,
    add_preprocess_arguments,
    preprocess,
    preprocess_run,
    run_preprocess,
)
from nanotron_recover.data.tokenization import tokenizer_fingerprint

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "FORMAT_VERSION",
    "CorpusIndex",
    "CorpusMicroBatches",
    "CorpusWriter",
    "LocalDataset",
    "MicroBatchSource",
    "PreprocessResult",
    "SyntheticMicroBatches",
    "TokenCorpus",
    "add_preprocess_arguments",
    "build_local_corpus",
    "build_local_tokenizer",
    "build_microbatch_source",
    "dtype_for_vocab",
    "ensure_local_dataset",
    "preprocess",
    "preprocess_run",
    "run_preprocess",
    "stdlib_docstring_texts",
    "tokenizer_fingerprint",
    "validate_corpus",
]
