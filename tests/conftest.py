"""Shared fixtures."""

from __future__ import annotations

import pytest

from nanotron_recover.data.local_corpus import LocalDataset, ensure_local_dataset


@pytest.fixture(scope="session")
def local_dataset(tmp_path_factory: pytest.TempPathFactory) -> LocalDataset:
    """The offline stdlib-docstring tokenizer (vocab 512) and Nanoset corpus (the first docstrings
    that fit in 300k tokens), built once per session.

    Has ``tokenizer_dir`` and ``corpus_dir`` (``Path``); takes a few seconds to build.
    """
    return ensure_local_dataset(tmp_path_factory.mktemp("local_dataset"))


@pytest.fixture(autouse=True)
def _own_fencing_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that runs ``train`` in this process adopts a fencing token (fencing.py) for it; the
    next test starts as a process that adopted none."""
    from nanotron_recover import fencing

    monkeypatch.setattr(fencing, "_mine", None)
    monkeypatch.setattr(fencing, "_adopted", False)
