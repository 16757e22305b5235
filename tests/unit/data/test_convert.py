"""``convert-corpus``: an old ``tokens.bin`` + ``index.json`` corpus becomes a Nanoset folder.

The reference for "datatrove's exact format" is datatrove itself: the same documents tokenized by
its ``DocumentTokenizer`` (no shuffling) must give the same ``.ds`` and ``.ds.index`` bytes and the
same ``.ds.metadata`` text as the conversion of the old corpus holding them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import nanotron_recover.data.convert as convert_mod
from nanotron_recover.cli import main as cli_main
from nanotron_recover.data.convert import CONVERTED_FILE, convert_corpus
from nanotron_recover.data.preprocess import summarize_nanoset
from nanotron_recover.errors import InputError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x + 1  # a comment\n",
    "Unicode survives: naïve café — 東京 🚀, and    odd   spacing .",
    "Return the number of items in a container. " * 20,
    "last",
]


def write_old(
    folder: Path, docs: list[list[int]], *, vocab_size: int, eos: int, dtype: str = "uint16", **extra
) -> Path:
    """An old-format corpus folder, as the old writer left it: ids + eos per document, and its index."""
    folder.mkdir(parents=True)
    ids = [i for doc in docs for i in doc]
    np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tofile(folder / "tokens.bin")
    index = {
        "format_version": 1,
        "num_tokens": len(ids),
        "num_documents": len(docs),
        "vocab_size": vocab_size,
        "dtype": dtype,
        "tokenizer": "old-tokenizer",
        "eos_token_id": eos,
        "complete": True,
        "source": {"dataset": "json"},
        "resume": {"rows_read": len(docs)},
        "tokenizer_fingerprint": None,
        **extra,
    }
    (folder / "index.json").write_text(json.dumps(index, indent=2))
    return folder


def nanoset(folder: Path) -> tuple[np.ndarray, np.ndarray, str]:
    ds = folder / CONVERTED_FILE
    size = int(Path(f"{ds}.metadata").read_text().splitlines()[0].rsplit("|", 1)[1])
    ids = np.fromfile(ds, dtype="<u2" if size == 2 else "<u4")
    return ids, np.fromfile(f"{ds}.index", dtype="<u8"), Path(f"{ds}.metadata").read_text()


def test_conversion_is_what_document_tokenizer_writes(local_dataset, tmp_path):
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    tok_file = str(local_dataset.tokenizer_dir / "tokenizer.json")  # datatrove loads a file by itself
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    LocalPipelineExecutor(
        [
            JsonlReader(str(tmp_path / "in")),
            DocumentTokenizer(
                str(tmp_path / "datatrove"),
                tokenizer_name_or_path=tok_file,
                eos_token="</s>",
                shuffle_documents=False,
            ),
        ],
        logging_dir=str(tmp_path / "logs"),
    ).run()
    (reference,) = sorted((tmp_path / "datatrove").glob("*.ds"))

    tok = AutoTokenizer.from_pretrained(local_dataset.tokenizer_dir)
    docs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in TEXTS]
    old = write_old(tmp_path / "old", docs, vocab_size=len(tok), eos=tok.eos_token_id)
    summary = convert_corpus(old, tmp_path / "new", tokenizer=tok_file)

    new = tmp_path / "new" / CONVERTED_FILE
    assert new.read_bytes() == reference.read_bytes()
    assert Path(f"{new}.index").read_bytes() == Path(f"{reference}.index").read_bytes()
    assert Path(f"{new}.metadata").read_text() == Path(f"{reference}.metadata").read_text()
    assert (summary.num_tokens, summary.num_documents) == (sum(map(len, docs)), len(TEXTS))
    assert (summary.tokenizer, summary.token_size, summary.files) == (tok_file, 2, (new,))
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        CONVERTED_FILE,
        f"{CONVERTED_FILE}.index",
        f"{CONVERTED_FILE}.metadata",
    ]


def test_the_old_index_fingerprint_is_recorded_whatever_the_name(tmp_path):
    fp = "sha256:" + "5e" * 32
    old = write_old(tmp_path / "old", [[5, 6, 1], [7, 1]], vocab_size=100, eos=1, tokenizer_fingerprint=fp)
    summary = convert_corpus(old, tmp_path / "new", tokenizer="moved/tokenizer")
    _, _, metadata = nanoset(tmp_path / "new")
    assert metadata.splitlines() == ["moved/tokenizer|2", "5", "5.00 T", f"tokenizer_fingerprint={fp}"]
    assert (summary.tokenizer, summary.tokenizer_fingerprint) == ("moved/tokenizer", fp)
    # No fingerprint in the index: none in the metadata (training then loads the tokenizer it names).
    assert (
        convert_corpus(
            write_old(tmp_path / "bare", [[5, 1]], vocab_size=100, eos=1), tmp_path / "b2"
        ).tokenizer_fingerprint
        is None
    )


def test_chunks_do_not_change_a_byte(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(2, 500, size=int(n))) + [1] for n in rng.integers(1, 40, size=50)]
    old = write_old(tmp_path / "old", docs, vocab_size=512, eos=1)
    whole = convert_corpus(old, tmp_path / "whole")
    monkeypatch.setattr(convert_mod, "_CHUNK_TOKENS", 7)  # boundaries everywhere, eos at chunk edges
    chunked = convert_corpus(old, tmp_path / "chunked")
    for a, b in zip(chunked.files, whole.files, strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert Path(f"{a}.index").read_bytes() == Path(f"{b}.index").read_bytes()
    ids, ends, metadata = nanoset(tmp_path / "chunked")
    assert ids.tolist() == [i for d in docs for i in d]
    assert ends.tolist() == np.cumsum([len(d) for d in docs]).tolist()
    assert metadata.splitlines()[0] == "old-tokenizer|2" and whole.num_documents == 50


def test_cut_short_last_document_ends_at_the_last_token(tmp_path):
    old = write_old(tmp_path / "old", [[5, 6, 1], [7, 8, 9]], vocab_size=100, eos=1)  # old --max-tokens cut
    summary = convert_corpus(old, tmp_path / "new")
    ids, ends, _ = nanoset(tmp_path / "new")
    assert ids.tolist() == [5, 6, 1, 7, 8, 9] and ends.tolist() == [3, 6]
    assert (summary.num_tokens, summary.num_documents) == (6, 2)


@pytest.mark.parametrize(
    "vocab_size, dtype, token_size",
    [(65536, "uint32", 2), (70000, "uint32", 4), (300, "uint16", 2)],
)
def test_token_size_follows_datatroves_rule(tmp_path, vocab_size, dtype, token_size):
    top = vocab_size - 1
    old = write_old(tmp_path / "old", [[top, 3, 0], [top - 1, 0]], vocab_size=vocab_size, eos=0, dtype=dtype)
    summary = convert_corpus(old, tmp_path / "new", tokenizer="some/tokenizer")
    ids, ends, metadata = nanoset(tmp_path / "new")
    assert summary.token_size == token_size and ids.itemsize == token_size
    assert ids.tolist() == [top, 3, 0, top - 1, 0] and ends.tolist() == [3, 5]
    assert metadata.splitlines()[:2] == [f"some/tokenizer|{token_size}", "5"]


def _damage(old: Path, case: str) -> None:
    index = json.loads((old / "index.json").read_text())
    if case == "incomplete":
        index["complete"] = False
    elif case == "bad dtype":
        index["dtype"] = "int8"
    elif case == "missing field":
        del index["eos_token_id"]
    elif case == "truncated tokens":
        (old / "tokens.bin").write_bytes((old / "tokens.bin").read_bytes()[:-2])
    elif case == "not json":
        (old / "index.json").write_text("{ not json")
        return
    elif case == "no index":
        (old / "index.json").unlink()
        return
    elif case == "empty":
        index["num_tokens"] = 0
        (old / "tokens.bin").write_bytes(b"")
    elif case == "id too large":
        index["dtype"] = "uint32"
        index["vocab_size"] = 500
        np.asarray([3, 70000, 1], dtype="<u4").tofile(old / "tokens.bin")
        index["num_tokens"] = 3
    (old / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "case, message",
    [
        ("incomplete", "not complete"),
        ("bad dtype", "dtype 'int8'"),
        ("missing field", "'eos_token_id' is missing"),
        ("truncated tokens", "the corpus is damaged"),
        ("not json", "is not valid JSON"),
        ("no index", "not an old-format corpus folder"),
        ("empty", "holds no tokens"),
        ("id too large", "holds id 70000"),
    ],
)
def test_bad_old_corpus_is_a_one_line_input_error(tmp_path, case, message):
    old = write_old(tmp_path / "old", [[5, 6, 1], [7, 1]], vocab_size=100, eos=1)
    _damage(old, case)
    with pytest.raises(InputError, match=message) as info:
        convert_corpus(old, tmp_path / "new")
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "new").glob("*.ds")) if (tmp_path / "new").exists() else True


def test_a_folder_that_already_holds_a_nanoset_is_refused(tmp_path):
    old = write_old(tmp_path / "old", [[5, 6, 1]], vocab_size=100, eos=1)
    convert_corpus(old, tmp_path / "new")
    before = (tmp_path / "new" / CONVERTED_FILE).read_bytes()
    with pytest.raises(InputError, match="already holds a Nanoset"):
        convert_corpus(old, tmp_path / "new")
    assert (tmp_path / "new" / CONVERTED_FILE).read_bytes() == before


def test_cli_convert_corpus(tmp_path, capsys):
    old = write_old(tmp_path / "old", [[5, 6, 1], [7, 1]], vocab_size=100, eos=1)
    assert cli_main(["convert-corpus", str(old), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "5 tokens in 2 documents" in out and "old-tokenizer" in out
    assert summarize_nanoset(tmp_path / "new").num_tokens == 5
    assert cli_main(["convert-corpus", str(old), str(tmp_path / "other"), "--tokenizer", "moved/tok"]) == 0
    assert summarize_nanoset(tmp_path / "other").tokenizer == "moved/tok"
    capsys.readouterr()
    assert cli_main(["convert-corpus", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "index.json" in err[0]
    assert err[0].startswith("nanotron-recover convert-corpus: error:")
