"""The tokenizer side of the data: loading a tokenizer and identifying it by content.

* :func:`load_tokenizer` wraps ``AutoTokenizer.from_pretrained`` (optionally offline-only). It is
  the one loader of the project: preprocessing hands the loaded tokenizer's ``tokenizers`` backend
  to datatrove (:mod:`.preprocess`), and training and evaluation load the same name the same way.
* :func:`tokenizer_fingerprint` identifies a tokenizer by *content* -- its vocabulary, its BPE
  merges, ``len(tokenizer)`` and its eos id -- so data can be checked against a tokenizer
  wherever it was loaded from (a hub id, a cache, a copied folder). The serialization of
  ``tokenizer.json`` is deliberately not hashed as is: it also holds truncation/padding state
  and changes shape between ``tokenizers`` releases, which would make the same tokenizer look
  different after an upgrade.

* :func:`check_same_tokenizer` is how training decides that a Nanoset folder was made with the
  config's tokenizer: by that fingerprint, which ``preprocess`` and ``convert-corpus`` record in the
  folder's ``.ds.metadata`` (:data:`FINGERPRINT_KEY`), so any spelling of one tokenizer -- a hub id,
  its folder, the ``tokenizer.json`` in it, a relative or an absolute path, a copy -- is accepted,
  and another tokenizer is refused naming both. See its docstring for folders that record no
  fingerprint.

Encoding itself is datatrove's (``DocumentTokenizer``); nothing here is on the trainer's hot
path, and ``transformers`` is imported lazily (only when a spelling must be loaded to compare).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from nanotron_recover.errors import InputError

# The .ds.metadata line (after datatrove's three) that records the tokenizer's content fingerprint.
FINGERPRINT_KEY = "tokenizer_fingerprint"
_HF_TOKENIZER_FILE = "tokenizer.json"
_HF_CONFIG_FILE = "tokenizer_config.json"


def load_tokenizer(name_or_path: str, *, offline: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)``; ``offline`` only looks at local files and the cache.

    A path to a file is a ``tokenizer.json`` (datatrove and Nanotron's preprocessing take one): the
    ``tokenizer.json`` of a saved tokenizer folder (one with ``tokenizer_config.json``) loads that
    folder, so both spellings give the same tokenizer, eos included; any other file loads alone,
    as a fast tokenizer that declares no special tokens (so no eos: its fingerprint differs from
    that of a saved folder holding the same file).
    """
    path = Path(name_or_path)
    if path.is_file():
        if not (path.name == _HF_TOKENIZER_FILE and (path.parent / _HF_CONFIG_FILE).is_file()):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        name_or_path = str(path.parent)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=offline)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """``sha256:<hex>`` of the tokenizer's vocabulary, merges, ``len(tokenizer)`` and eos id (see module docstring)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    merges = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        if model.get("merges") is not None:
            # Older tokenizers releases store a merge as "a b", newer ones as ["a", "b"].
            merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    payload = {"vocab": vocab, "merges": merges, "len": len(tokenizer), "eos": tokenizer.eos_token_id}
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def short_fingerprint(fingerprint: str) -> str:
    """``sha256:`` and the first 12 hex digits: enough to tell two tokenizers apart in a message."""
    algorithm, _, digest = fingerprint.partition(":")
    return f"{algorithm}:{digest[:12]}" if digest else fingerprint[:19]


def fingerprint_of(name_or_path: str) -> tuple[str | None, str]:
    """(the fingerprint of the tokenizer ``name_or_path`` names, loaded offline, ``""``), or
    (None, why it cannot be loaded here). Cached per process and working directory."""
    return _fingerprint_of(os.getcwd(), str(name_or_path))


@functools.lru_cache(maxsize=32)
def _fingerprint_of(cwd: str, name_or_path: str) -> tuple[str | None, str]:
    local = Path(name_or_path).expanduser().exists()
    if not local and name_or_path.startswith(("/", ".", "~")):
        return None, "no such file or folder"
    try:
        return tokenizer_fingerprint(load_tokenizer(str(Path(name_or_path).expanduser()), offline=True)), ""
    except Exception as e:  # whatever transformers raises for a name it cannot load offline
        if not local:
            return None, "not a local path, nor a Hugging Face id in this machine's cache (looked up offline)"
        text = " ".join(str(e).split())
        return None, (text[:117] + "...") if len(text) > 120 else (text or type(e).__name__)


def _location(name_or_path: str) -> str:
    """A spelling reduced to what it names on this machine: an existing local path resolved (a saved
    folder's ``tokenizer.json`` to the folder), anything else (a hub id) as written."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return name_or_path
    path = path.resolve()
    if path.name == _HF_TOKENIZER_FILE and (path.parent / _HF_CONFIG_FILE).is_file():
        path = path.parent
    return str(path)


def check_same_tokenizer(
    recorded: str, recorded_fingerprint: str | None, wanted: str, *, where: str, setting: str, remedy: str
) -> None:
    """Raise an :class:`InputError`, one line, unless ``wanted`` names the tokenizer a folder was
    tokenized with: ``recorded`` (its spelling in the folder's metadata) and ``recorded_fingerprint``.

    * The same spelling is the same tokenizer: accepted without loading anything.
    * Otherwise ``wanted`` is loaded (offline: local files and the Hugging Face cache) and its
      fingerprint compared with the recorded one: equal is accepted, whatever the spellings; a
      different tokenizer is refused naming both spellings and short fingerprints; a ``wanted``
      that cannot be loaded here is refused saying so.
    * A folder that records no fingerprint (written before they were recorded, or by another
      tool) is compared the same way after loading ``recorded``; if that cannot be loaded either,
      only the names are compared (two spellings of one local path are the same), and a
      refusal says that it compared names only.

    ``where`` names the folder, ``setting`` the config field ``wanted`` comes from, and ``remedy``
    ends the message (what to do instead).
    """
    if recorded == wanted:
        return
    known = recorded_fingerprint
    if known is None:
        known, why_recorded = fingerprint_of(recorded)
        if known is None:
            if _location(recorded) == _location(wanted):
                return
            raise InputError(
                f"{where} was tokenized with {recorded!r}, not {setting} {wanted!r}, by name: the folder "
                f"records no tokenizer fingerprint and {recorded!r} cannot be loaded here to compare "
                f"contents ({why_recorded}); {remedy}"
            )
    found, why_wanted = fingerprint_of(wanted)
    if found is None:
        raise InputError(
            f"{where} was tokenized with {recorded!r} ({short_fingerprint(known)}), and {setting} "
            f"{wanted!r} cannot be loaded here to compare contents ({why_wanted}); {remedy}"
        )
    if found != known:
        raise InputError(
            f"{where} was tokenized with {recorded!r} ({short_fingerprint(known)}), not {setting} "
            f"{wanted!r} ({short_fingerprint(found)}), a different tokenizer; {remedy}"
        )


def default_workers() -> int:
    """The cores this process may run on (affinity-aware, unlike a bare ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
