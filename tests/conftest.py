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
