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

Encoding itself is datatrove's (``DocumentTokenizer``); nothing here is on the trainer's hot
path, and ``transformers`` is imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def load_tokenizer(name_or_path: str, *, offline: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)``; ``offline`` only looks at local files and the cache."""
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


def default_workers() -> int:
    """The cores this process may run on (affinity-aware, unlike a bare ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
