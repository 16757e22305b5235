"""Data: Nanoset folders on disk, deterministic micro-batches, preprocessing, an offline corpus.

Training data on disk is a *Nanoset folder*: what datatrove's ``DocumentTokenizer`` writes
(``*.ds`` token ids, ``*.ds.index`` document ends, ``*.ds.metadata`` naming the tokenizer).

* :mod:`.nanoset` -- checking a Nanoset folder, and its micro-batches by the sampling rule
  (blends of folders included).
* :mod:`.microbatches` -- micro-batch id -> token tensor, a pure function (determinism): the
  source a data stage asks for, synthetic or Nanoset.
* :mod:`.stages` -- which data stage feeds a step (``data_stages``), each from its own beginning.
* :mod:`.preprocess` -- datatrove's reader + ``DocumentTokenizer`` pipeline that writes a Nanoset
  folder (``nanotron-recover preprocess``, :func:`tokenize_to_nanoset`).
* :mod:`.convert` -- a corpus of the old ``tokens.bin`` + ``index.json`` format into a Nanoset
  folder (``nanotron-recover convert-corpus``).
* :mod:`.tokenization` -- loading a tokenizer, its content fingerprint, and the check that a folder
  was tokenized with the config's tokenizer, however either spells it.
* :mod:`.local_corpus` -- stdlib docstrings as an offline dataset + tokenizer for tests and demos.

Every name is imported eagerly, torch included (via ``.microbatches``), as the trainer needs
it anyway. :func:`.local_corpus.stdlib_docstring_texts` depends on that: it must see the same
standard library in every process -- importing torch replaces ``inspect.getfile``, which
removes that docstring from the collected texts, so a lazily imported torch would make the
offline corpus depend on what a process imported before. (The price: each worker process of a
preprocess run with several workers imports torch too, ~1 s and ~150 MB once per worker.) Heavy
libraries that are not needed to *use* the data (datatrove, ``datasets``, ``transformers``,
``tokenizers``) are imported inside the functions that need them.
"""

from nanotron_recover.data.convert import convert_corpus
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
    MicroBatchSource,
    SyntheticMicroBatches,
    build_microbatch_source,
)
from nanotron_recover.data.nanoset import NanosetMicroBatches, NanosetSummary, summarize_nanoset
from nanotron_recover.data.preprocess import (
    add_preprocess_arguments,
    run_preprocess,
    tokenize_to_nanoset,
)
from nanotron_recover.data.stages import DataStages
from nanotron_recover.data.tokenization import tokenizer_fingerprint

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "LocalDataset",
    "DataStages",
    "MicroBatchSource",
    "NanosetMicroBatches",
    "NanosetSummary",
    "SyntheticMicroBatches",
    "add_preprocess_arguments",
    "build_local_corpus",
    "build_local_tokenizer",
    "build_microbatch_source",
    "convert_corpus",
    "ensure_local_dataset",
    "run_preprocess",
    "stdlib_docstring_texts",
    "summarize_nanoset",
    "tokenize_to_nanoset",
    "tokenizer_fingerprint",
]
