"""An embedded, offline dataset: Python's own standard-library docstrings.

Tests, the demo and CI need real-looking text and a real tokenizer, but must never touch
the network. Every Python installation ships a few hundred kilobytes of English prose with
code in it -- the docstrings of its standard library -- so we use those:

* :func:`stdlib_docstring_texts` collects them from a fixed, sorted list of modules, in a
  fixed order, so the texts are identical on every machine running the same Python
  (a module that fails to import is skipped; ``python -OO`` strips docstrings and is refused).
* :func:`build_local_tokenizer` trains a small byte-level BPE on them with ``tokenizers``
  (deterministic: merge ties are broken by the pair itself) and saves it with
  ``save_pretrained`` so ``AutoTokenizer.from_pretrained(folder)`` loads it offline.
  Special tokens come first: ``<s>`` (bos) is id 0 and ``</s>`` (eos) is id 1; ids 2..257
  are the 256 byte symbols, the rest are merges, for exactly ``vocab_size`` ids in total.
  No bos/eos is added on encode; preprocessing appends eos to every document itself.
* :func:`build_local_corpus` writes the texts as a JSON-lines file and runs the real
  :func:`~nanotron_recover.data.preprocess.tokenize_to_nanoset` on it (datatrove's reader and
  ``DocumentTokenizer``), so the offline path exercises the same code as a C4 run and the
  result is a Nanoset folder like any other. ``max_tokens`` keeps the longest run of whole
  documents, from the first text on, whose tokens (one eos each) fit: the texts are cut before
  tokenizing, so the corpus holds at most ``max_tokens`` tokens, and exactly the same ones on
  every machine running the same Python.
* :func:`ensure_local_dataset` caches both under a root folder, keyed by everything that
  changes the result. It builds into a private temporary folder and renames it into place,
  so concurrent callers never see a half-built dataset; the loser of a race simply uses
  the winner's build. The corpus's ``.ds.metadata`` names the tokenizer by its *final*
  folder, not the temporary one it was built from, since training compares that name with
  the config's ``tokenizer.tokenizer_name_or_path``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanotron_recover.data.preprocess import NanosetSummary, summarize_nanoset, tokenize_to_nanoset
from nanotron_recover.errors import InputError

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1

# Bump when anything below changes what gets built, so stale cached builds are not reused.
_BUILD_VERSION = 3  # 2: Nanoset folders written by datatrove; 3: their metadata records the fingerprint

# Pure-Python, side-effect-free modules with substantial documentation. Deliberately a fixed
# list rather than sys.stdlib_module_names: some stdlib modules open windows or browsers on
# import (turtle, antigravity) or print (this).
_STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        """
        abc argparse ast asyncio base64 bdb bisect calendar cmd code codecs collections colorsys
        concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib dis
        doctest email.message enum filecmp fileinput fnmatch fractions ftplib functools gettext glob
        graphlib gzip hashlib heapq hmac html.parser http.client http.server imaplib inspect io
        ipaddress itertools json logging lzma mailbox math mimetypes netrc numbers operator optparse
        os pathlib pdb pickle pickletools pkgutil platform plistlib poplib pprint pydoc queue quopri
        random re reprlib sched secrets selectors shelve shlex shutil smtplib socket socketserver
        statistics string struct subprocess tarfile tempfile textwrap threading timeit tokenize
        tomllib trace traceback types typing unittest urllib.parse urllib.request uuid warnings wave
        weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo
        """.split()
    )
)


def stdlib_docstring_texts(max_chars: int = 2_000_000) -> list[str]:
    """Docstrings of standard-library modules and their public classes, methods and functions.

    Deterministic for a given Python: modules, then members, are visited in sorted order;
    only objects *defined* in the module are used (so re-exports and lazily added attributes
    cannot change the result); duplicates are dropped. The total is cut at ``max_chars``.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    texts: list[str] = []
    seen: set[str] = set()
    total = 0

    def add(obj: object) -> bool:
        nonlocal total
        doc = inspect.getdoc(obj)
        if not doc or doc in seen:
            return total < max_chars
        seen.add(doc)
        doc = doc[: max_chars - total]
        texts.append(doc)
        total += len(doc)
        return total < max_chars

    # Importing and introspecting old modules emits DeprecationWarnings (typing.io, ...); silence
    # them so that neither the output nor the result depends on the caller's warning filters.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _collect(add)
    if not texts:
        raise RuntimeError("no standard-library docstrings found (is Python running with -OO?)")
    return texts


def _collect(add: Callable[[object], bool]) -> None:
    """Feed every docstring-bearing object to ``add`` in a fixed order, until ``add`` says stop."""
    for module_name in _STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a module missing from this build (e.g. no _lzma) is just skipped
            continue
        if not add(module):
            return
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if not add(obj):
                return
            if inspect.isclass(obj):
                for member_name, member in sorted(vars(obj).items()):
                    if member_name.startswith("_"):
                        continue
                    if _is_own_method(member, module.__name__) and not add(member):
                        return


def _is_own_method(member: object, module_name: str) -> bool:
    """Whether a class attribute is a method defined by the stdlib, not patched in by a library.

    Libraries do patch stdlib classes (transformers adds ``logging.Logger.warning_once``), and
    whether they did depends on what the process imported; such functions carry their own
    module's name. C-implemented methods have no ``__module__`` and are always the stdlib's.
    """
    if isinstance(member, property):
        member = member.fget
    elif isinstance(member, (classmethod, staticmethod)):
        member = member.__func__
    if not inspect.isroutine(member):
        return False
    return getattr(member, "__module__", None) in (None, module_name)


def build_local_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` ids on the stdlib docstrings; save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS_TOKEN, EOS_TOKEN]  # trainer assigns ids in this order: bos=0, eos=1
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(specials) + len(alphabet)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (2 special tokens + 256 bytes), got {vocab_size}")

    texts = stdlib_docstring_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the stdlib docstrings only support a vocabulary of {tok.get_vocab_size()} ids, "
            f"fewer than the requested vocab_size {vocab_size}"
        )
    if (tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)) != (BOS_TOKEN_ID, EOS_TOKEN_ID):
        raise RuntimeError("tokenizers assigned unexpected ids to the special tokens")  # library change

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # Byte-level BPE round-trips exactly; "cleaning up" spaces before punctuation would not.
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    wrapped.save_pretrained(out_dir)
    return out_dir


def build_local_corpus(
    out_dir: Path,
    tokenizer_dir: Path,
    max_tokens: int | None = None,
    *,
    tokenizer_name: str | None = None,
) -> NanosetSummary:
    """Tokenize the stdlib docstrings (one document each) into a Nanoset folder at ``out_dir``.

    ``max_tokens``: keep the first texts, whole, whose tokens plus one eos each fit (see the module
    docstring). ``tokenizer_name`` is what the metadata records as the tokenizer (default: the
    folder it was tokenized with, ``str(tokenizer_dir)``).
    """
    texts = stdlib_docstring_texts()
    if max_tokens is not None:
        texts = _texts_within(texts, Path(tokenizer_dir), max_tokens)
    with tempfile.TemporaryDirectory(prefix="nanotron-local-corpus-") as tmp:
        jsonl = Path(tmp) / "stdlib_docstrings.jsonl"
        with open(jsonl, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        # The logs only serve a rerun of this build, which never happens: they go with the JSON lines.
        summary = tokenize_to_nanoset(jsonl, out_dir, str(tokenizer_dir), logging_dir=Path(tmp) / "logs")
    if tokenizer_name is not None and tokenizer_name != summary.tokenizer:
        _rename_tokenizer(summary, tokenizer_name)
        summary = summarize_nanoset(out_dir)
    return summary


def _texts_within(texts: list[str], tokenizer_dir: Path, max_tokens: int) -> list[str]:
    """The longest prefix of ``texts`` whose tokens, plus one eos per text, number at most ``max_tokens``."""
    from tokenizers import Tokenizer

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    total = 0
    for i, encoding in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
        total += len(encoding.ids) + 1
        if total > max_tokens:
            if i == 0:
                raise ValueError(f"max_tokens {max_tokens} is less than the first document ({total} tokens)")
            return texts[:i]
    return texts


def _rename_tokenizer(summary: NanosetSummary, name: str) -> None:
    """Make every ``.ds.metadata`` of ``summary`` name the tokenizer ``name`` (its other lines unchanged)."""
    for ds in summary.files:
        path = Path(f"{ds}.metadata")
        first, sep, rest = path.read_text(encoding="utf-8").partition("\n")
        token_size = first.rsplit("|", 1)[1]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(f"{name}|{token_size}{sep}{rest}", encoding="utf-8")
        os.replace(tmp, path)


@dataclass(frozen=True)
class LocalDataset:
    """Where :func:`ensure_local_dataset` put the tokenizer and the corpus."""

    tokenizer_dir: Path
    corpus_dir: Path


def _dataset_at(folder: Path) -> LocalDataset:
    return LocalDataset(tokenizer_dir=folder / "tokenizer", corpus_dir=folder / "corpus")


def _is_complete(dataset: LocalDataset) -> bool:
    if not (dataset.tokenizer_dir / "tokenizer.json").is_file():
        return False
    if not (dataset.tokenizer_dir / "tokenizer_config.json").is_file():
        return False
    try:
        summary = summarize_nanoset(dataset.corpus_dir)
    except (InputError, OSError):
        return False
    return summary.tokenizer == str(dataset.tokenizer_dir) and summary.num_tokens > 0


def ensure_local_dataset(root: Path, vocab_size: int = 512, max_tokens: int | None = 300_000) -> LocalDataset:
    """Build (or reuse) the local tokenizer and Nanoset corpus under ``root``; safe to call concurrently."""
    root = Path(root)
    # Docstrings can change between Python releases, so the exact version is part of the key.
    py = ".".join(str(v) for v in sys.version_info[:3])
    key = f"stdlib-py{py}-b{_BUILD_VERSION}-v{vocab_size}-t{'all' if max_tokens is None else max_tokens}"
    final = root / key
    dataset = _dataset_at(final)
    if _is_complete(dataset):
        return dataset

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        built = _dataset_at(tmp)
        build_local_tokenizer(built.tokenizer_dir, vocab_size)
        # The metadata names the tokenizer where it will be, not in this temporary folder.
        build_local_corpus(
            built.corpus_dir, built.tokenizer_dir, max_tokens, tokenizer_name=str(dataset.tokenizer_dir)
        )
        if final.exists() and not _is_complete(dataset):
            _discard(final, root)  # a damaged earlier build: move it out of the way
        try:
            os.rename(tmp, final)  # atomic; fails if another process already put a build there
        except OSError:
            if not _is_complete(dataset):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left to remove if the rename succeeded
    return dataset


def _discard(folder: Path, root: Path) -> None:
    trash = Path(tempfile.mkdtemp(prefix=".trash.", dir=root))
    try:
        os.rename(folder, trash / "old")
    except FileNotFoundError:
        pass  # someone else discarded it first
    shutil.rmtree(trash, ignore_errors=True)
