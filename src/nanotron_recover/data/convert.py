"""Convert a corpus of the old format into a Nanoset folder (``nanotron-recover convert-corpus``).

Before datatrove wrote our training data, ``preprocess`` produced a folder of two files:

* ``tokens.bin``: every document's token ids followed by the eos id, back to back, as raw
  little-endian uint16 (vocabularies of up to 65,535 ids) or uint32;
* ``index.json``: ``num_tokens``, ``num_documents``, ``vocab_size``, ``dtype``, ``tokenizer``,
  ``eos_token_id``, ``complete``, ``tokenizer_fingerprint`` and more (source, resume state) that a
  Nanoset has no use for.

Training now reads Nanoset folders only (what datatrove's ``DocumentTokenizer`` writes, see
:mod:`.preprocess`), so an existing corpus is converted once instead of tokenized again: the same
ids, in the same order, become one ``00000_converted.ds`` with its ``.ds.index`` (document ends,
little-endian uint64) and ``.ds.metadata`` (``tokenizer|token_size``, the token count, the count
in words) -- byte for byte what ``DocumentTokenizer`` writes for those documents without
shuffling -- plus, when the old index recorded the tokenizer's fingerprint (the same content
fingerprint, :func:`.tokenization.tokenizer_fingerprint`), the line ``tokenizer_fingerprint=...``
that ``preprocess`` adds too, by which training compares the tokenizer. The token size follows datatrove's rule (4 bytes for more than 65,536 ids, else 2), so
a uint32 corpus of a 65,536-id vocabulary becomes uint16; ids that do not fit are refused.

Document ends are found from the eos ids, as the old format kept documents only that way. A
document whose own text contained the eos token (``"</s>"`` written out, say) therefore counts
as two; that changes nothing training reads, since samples are cut from the token stream. A last
document cut short by the old ``--max-tokens`` (no eos) ends at the last token.

The old files are memory-mapped and streamed in chunks, so a corpus larger than memory converts
in one pass. The new files are written under temporary names and renamed into place, the ``.ds``
last: an interrupted conversion leaves no ``.ds`` file behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from nanotron_recover.data.nanoset import fingerprint_line
from nanotron_recover.data.preprocess import NanosetSummary, summarize_nanoset
from nanotron_recover.errors import InputError

OLD_TOKENS_FILE = "tokens.bin"
OLD_INDEX_FILE = "index.json"
CONVERTED_FILE = "00000_converted.ds"
_OLD_DTYPES = ("uint16", "uint32")
# Tokens per chunk: 64 MiB of uint32 ids in memory at a time.
_CHUNK_TOKENS = 1 << 24


def read_old_index(folder: str | Path) -> dict[str, Any]:
    """``folder/index.json`` of an old-format corpus, checked against its ``tokens.bin``.

    InputError, one line, if the folder cannot be converted.
    """
    folder = Path(folder)
    path = folder / OLD_INDEX_FILE
    if not path.is_file():
        raise InputError(f"{str(folder)!r} is not an old-format corpus folder: it has no {OLD_INDEX_FILE}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({' '.join(str(e).splitlines())})") from None
    if not isinstance(index, dict):
        raise InputError(f"{path} is not a corpus index (a JSON object)")
    for key, kind in (("num_tokens", int), ("vocab_size", int), ("eos_token_id", int), ("tokenizer", str)):
        if not isinstance(index.get(key), kind) or isinstance(index.get(key), bool):
            raise InputError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    if index.get("dtype") not in _OLD_DTYPES:
        raise InputError(f"{path}: dtype {index.get('dtype')!r} is not one of {', '.join(_OLD_DTYPES)}")
    if index.get("complete") is not True:
        raise InputError(
            f"{path} says the corpus is not complete (its preprocess was interrupted): finish it with the "
            "version that started it, or tokenize the text again with `nanotron-recover preprocess`"
        )
    tokens = folder / OLD_TOKENS_FILE
    if not tokens.is_file():
        raise InputError(f"{str(folder)!r} has {OLD_INDEX_FILE} but no {OLD_TOKENS_FILE}")
    need = index["num_tokens"] * np.dtype(index["dtype"]).itemsize
    if tokens.stat().st_size != need:
        raise InputError(
            f"{tokens} holds {tokens.stat().st_size} bytes, but {OLD_INDEX_FILE} says {index['num_tokens']} "
            f"{index['dtype']} tokens ({need} bytes): the corpus is damaged"
        )
    if index["num_tokens"] == 0:
        raise InputError(f"{str(folder)!r} holds no tokens: nothing to convert")
    return index


def convert_corpus(old: str | Path, new: str | Path, *, tokenizer: str | None = None) -> NanosetSummary:
    """Write the old-format corpus at ``old`` as a Nanoset folder ``new``; its summary.

    ``tokenizer`` replaces the name the old index records (e.g. when the tokenizer folder has
    moved): it is what the metadata says. The index's tokenizer fingerprint, if it has one, is kept
    whatever the name: it is what training compares with the config's tokenizer.
    """
    import humanize  # datatrove's own dependency, and how its metadata writes the count in words

    old, new = Path(old), Path(new)
    index = read_old_index(old)
    name = tokenizer if tokenizer is not None else index["tokenizer"]
    if "\n" in name or not name:
        raise InputError(f"tokenizer name {name!r} must be one non-empty line")
    num_tokens, eos = index["num_tokens"], index["eos_token_id"]
    token_size = 4 if index["vocab_size"] > 65536 else 2  # datatrove's rule, from the vocabulary size
    out_dtype = np.dtype("<u4") if token_size == 4 else np.dtype("<u2")
    if new.exists() and not new.is_dir():
        raise InputError(f"{str(new)!r} is a file, not a folder")
    if new.is_dir() and any(new.glob("*.ds")):
        raise InputError(f"{str(new)!r} already holds a Nanoset (*.ds files): choose an empty or new folder")
    new.mkdir(parents=True, exist_ok=True)

    final = new / CONVERTED_FILE
    paths = {suffix: Path(f"{final}{suffix}") for suffix in ("", ".index", ".metadata")}
    temps = {suffix: path.with_name(f".{path.name}.tmp") for suffix, path in paths.items()}
    tokens = np.memmap(old / OLD_TOKENS_FILE, dtype=np.dtype(index["dtype"]).newbyteorder("<"), mode="r")
    try:
        with open(temps[""], "wb") as ids_out, open(temps[".index"], "wb") as ends_out:
            for start in range(0, num_tokens, _CHUNK_TOKENS):
                chunk = np.asarray(tokens[start : start + _CHUNK_TOKENS])
                if out_dtype.itemsize < chunk.dtype.itemsize and int(chunk.max()) > np.iinfo(out_dtype).max:
                    raise InputError(
                        f"{old / OLD_TOKENS_FILE} holds id {int(chunk.max())}, more than the uint16 ids of a "
                        f"{index['vocab_size']}-id vocabulary allow: the index's vocab_size is wrong"
                    )
                ids_out.write(chunk.astype(out_dtype, copy=False).tobytes())
                ends = np.flatnonzero(chunk == eos).astype("<u8") + np.uint64(start + 1)
                ends_out.write(ends.tobytes())
            if int(tokens[-1]) != eos:
                ends_out.write(np.array([num_tokens], dtype="<u8").tobytes())  # a last document cut short
        # The format of datatrove's TokenizedFile.write_final_metadata, exactly, and the fingerprint.
        lines = [f"{name}|{token_size}", str(num_tokens), humanize.metric(num_tokens, unit="T")]
        fingerprint = index.get("tokenizer_fingerprint")
        if isinstance(fingerprint, str) and fingerprint.startswith("sha256:"):
            lines.append(fingerprint_line(fingerprint))
        temps[".metadata"].write_text("\n".join(lines), encoding="utf-8")
        for suffix in (".index", ".metadata", ""):  # the .ds last: readers look for *.ds
            os.replace(temps[suffix], paths[suffix])
    finally:
        del tokens
        for temp in temps.values():
            temp.unlink(missing_ok=True)
    return summarize_nanoset(new)
