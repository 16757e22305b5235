"""A tokenizer is identified by content: any spelling of one tokenizer is accepted, another is refused.

Tokenizers are built here, offline: the stdlib-docstring BPE of the ``local_dataset`` fixture (512 ids)
and another one trained on the same text with 300 ids. ``check_same_tokenizer`` is given what a
Nanoset folder's metadata records (the spelling, the fingerprint or none) and the spelling of the
config.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanotron_recover.data import tokenization
from nanotron_recover.data.local_corpus import build_local_tokenizer
from nanotron_recover.data.tokenization import (
    check_same_tokenizer,
    fingerprint_of,
    load_tokenizer,
    short_fingerprint,
    tokenizer_fingerprint,
)
from nanotron_recover.errors import InputError

SETTING = "tokenizer.tokenizer_name_or_path"
WHERE = "dataset folder 'data/x'"


def check(recorded: str, fingerprint: str | None, wanted: str) -> None:
    check_same_tokenizer(recorded, fingerprint, wanted, where=WHERE, setting=SETTING, remedy="do this")


def refusal(recorded: str, fingerprint: str | None, wanted: str) -> str:
    with pytest.raises(InputError) as info:
        check(recorded, fingerprint, wanted)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{WHERE} was tokenized with {recorded!r}")
    assert message.endswith("; do this")
    return message


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    """Fingerprints are cached per process: every test loads what it names itself."""
    tokenization._fingerprint_of.cache_clear()
    yield
    tokenization._fingerprint_of.cache_clear()


@pytest.fixture(scope="module")
def tok(local_dataset, tmp_path_factory) -> Path:
    """A private copy of the ``local_dataset`` tokenizer, in a folder of its own (for relative paths)."""
    root = tmp_path_factory.mktemp("tok")
    return Path(shutil.copytree(local_dataset.tokenizer_dir, root / "tokenizer"))


@pytest.fixture(scope="module")
def fp(tok) -> str:
    from transformers import AutoTokenizer

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tok))


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """The same BPE trained on the same text with another vocabulary size: another tokenizer."""
    return build_local_tokenizer(tmp_path_factory.mktemp("other") / "tokenizer", vocab_size=300)


def test_a_saved_folders_tokenizer_json_loads_as_the_folder(tok, fp, tmp_path):
    from_file = load_tokenizer(str(tok / "tokenizer.json"), offline=True)
    assert (from_file.eos_token, from_file.eos_token_id, len(from_file)) == ("</s>", 1, 512)
    assert tokenizer_fingerprint(from_file) == fp
    # A tokenizer.json on its own declares no eos: it loads, but is not the same tokenizer.
    (tmp_path / "bare").mkdir()
    bare = shutil.copy(tok / "tokenizer.json", tmp_path / "bare" / "tokenizer.json")
    alone = load_tokenizer(str(bare), offline=True)
    assert alone.eos_token_id is None and len(alone) == 512
    assert tokenizer_fingerprint(alone) != fp


@pytest.mark.parametrize(
    "wanted",
    [
        "{tok}",
        "{tok}/tokenizer.json",
        "{tok}/",
        "tokenizer",
        "tokenizer/tokenizer.json",
        "./tokenizer/",
        "../{parent}/tokenizer",
        "{twin}",
        "{twin}/tokenizer.json",
    ],
)
@pytest.mark.parametrize("recorded", ["{tok}", "{tok}/tokenizer.json", "tokenizer/tokenizer.json"])
def test_any_spelling_of_the_same_tokenizer_is_accepted(tok, fp, tmp_path, monkeypatch, recorded, wanted):
    twin = Path(shutil.copytree(tok, tmp_path / "twin"))  # a copy elsewhere is the same tokenizer too
    monkeypatch.chdir(tok.parent)  # relative spellings are relative to where training starts
    names = {"tok": tok, "parent": tok.parent.name, "twin": twin}
    check(recorded.format(**names), fp, wanted.format(**names))


def test_the_folders_own_spelling_is_accepted_without_loading(monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("nothing should be loaded")

    monkeypatch.setattr(tokenization, "load_tokenizer", no_loading)
    check("meta-llama/Llama-2-7b-hf", "sha256:" + "0" * 64, "meta-llama/Llama-2-7b-hf")
    check("no/such/tokenizer", None, "no/such/tokenizer")


def test_a_hub_id_in_the_local_cache_is_the_same_tokenizer_as_its_folder(tok, fp, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # The Hugging Face cache layout: models--<org>--<name>/{refs/main, snapshots/<commit>/...}.
    repo = tmp_path / "hub" / "models--local-org--stdlib-bpe"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = Path(shutil.copytree(tok, repo / "snapshots" / commit))
    (snapshot / "config.json").write_text("{}")  # AutoTokenizer reads a model config beside it
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    check(str(tok), fp, "local-org/stdlib-bpe")
    check("local-org/stdlib-bpe", fp, str(tok / "tokenizer.json"))
    assert fingerprint_of("local-org/not-cached")[0] is None


def test_a_tokenizer_with_another_vocabulary_size_is_refused_naming_both(tok, fp, other):
    other_fp = tokenizer_fingerprint(load_tokenizer(str(other), offline=True))
    assert other_fp != fp
    for recorded, wanted in [
        (str(tok), str(other)),
        (str(tok / "tokenizer.json"), str(other / "tokenizer.json")),
    ]:
        message = refusal(recorded, fp, wanted)
        assert message == (
            f"{WHERE} was tokenized with {recorded!r} ({short_fingerprint(fp)}), not {SETTING} {wanted!r} "
            f"({short_fingerprint(other_fp)}), a different tokenizer; do this"
        )
    assert short_fingerprint(fp) == fp[:19] and len(fp) == len("sha256:") + 64


def test_a_config_tokenizer_that_cannot_be_loaded_is_refused_saying_so(tok, fp, tmp_path):
    missing = str(tmp_path / "no-such-tokenizer")
    assert refusal(str(tok), fp, missing).endswith(
        "not be loaded here to compare contents (no such file or folder); do this"
    )
    assert "nor a Hugging Face id in this machine's cache (looked up offline)" in refusal(
        str(tok), fp, "local-org/not-cached"
    )


def test_a_folder_without_fingerprint_is_compared_by_loading_what_it_names(tok, fp, other, monkeypatch):
    monkeypatch.chdir(tok.parent)
    check(str(tok / "tokenizer.json"), None, "tokenizer")
    message = refusal("tokenizer", None, str(other))
    other_fp = tokenizer_fingerprint(load_tokenizer(str(other), offline=True))
    assert (
        f"({short_fingerprint(fp)}), not {SETTING} {str(other)!r} ({short_fingerprint(other_fp)})" in message
    )


def test_a_folder_without_fingerprint_naming_what_cannot_be_loaded_is_compared_by_name(
    tok, tmp_path, monkeypatch
):
    # A folder that is no tokenizer (moved away and replaced, say): only its spellings can be compared.
    (tmp_path / "was-a-tokenizer").mkdir()
    monkeypatch.chdir(tmp_path)
    check("was-a-tokenizer", None, str(tmp_path / "was-a-tokenizer"))
    check(str(tmp_path / "was-a-tokenizer") + "/", None, "./was-a-tokenizer")
    message = refusal("was-a-tokenizer", None, str(tok))
    assert f"not {SETTING} {str(tok)!r}, by name: the folder records no tokenizer fingerprint and " in message
    assert "'was-a-tokenizer' cannot be loaded here to compare contents" in message
    assert "by name" in refusal("gone/tokenizer", None, str(tok))
