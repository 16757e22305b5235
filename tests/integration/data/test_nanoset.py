"""Nanoset folders (datatrove's format) as micro-batches: the sampling rule, blends, stages, checks.

Folders are written with datatrove's own ``TokenizedFile`` (the writer ``DocumentTokenizer`` uses),
so what is read here is byte for byte what datatrove writes. Each folder's tokens live in their own
id range, so every row of a micro-batch says which folder and which sample it came from.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from datatrove.pipeline.tokens.tokenizer import TokenizedFile
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.config import NanosetDatasetsArgs, load_config
from nanotron_recover.data.microbatches import build_microbatch_source
from nanotron_recover.data.nanoset import NanosetMicroBatches, blend_counts, summarize_nanoset
from nanotron_recover.data.stages import DataStages
from nanotron_recover.errors import InputError

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_cpu.yaml"
VOCAB = 1024
L = 7  # samples are windows of 8 tokens


def write_nanoset(
    folder: Path, samples: int, base: int, *, files: int = 1, tokenizer: str = "tok"
) -> np.ndarray:
    """A folder whose file f holds ``samples // files`` windows (plus a short tail that is never
    read); token values encode (folder base, file, sample, position). Returns each sample's first token."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(base)
    firsts = []
    per_file = samples // files
    for f in range(files):
        out = TokenizedFile(
            str(folder), f"{f:05d}_data.ds", tokenizer_name_or_path=tokenizer, save_final_metadata=True
        )
        tokens = [base + (f * per_file + s) % 400 for s in range(per_file) for _ in range(L + 1)]
        firsts += tokens[:: L + 1]
        tokens += [base] * 3  # a tail shorter than a window
        # Documents of random lengths: windows cross document ends, as in a real corpus.
        cuts = np.sort(rng.choice(np.arange(1, len(tokens)), size=min(10, len(tokens) - 1), replace=False))
        for doc in np.split(np.array(tokens), cuts):
            out.write([int(t) for t in doc], None)
        out.close()
    return np.array(firsts)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nanosets")
    write_nanoset(root / "a", 30, base=0, files=2)  # 30 samples over 2 files
    write_nanoset(root / "b", 20, base=500)
    return {"a": root / "a", "b": root / "b"}


def source(paths, weights=None, *, mbs=1, seed=3, first_id=0) -> NanosetMicroBatches:
    return NanosetMicroBatches(
        [summarize_nanoset(p) for p in paths],
        weights,
        micro_batch_size=mbs,
        sequence_length=L,
        seed=seed,
        vocab_size=VOCAB,
        first_id=first_id,
    )


def row_origin(row: torch.Tensor) -> tuple[str, int]:
    """(folder, sample) a row was read from, decoded from its token values."""
    first = int(row[0])
    assert torch.all(row == first), "a row is one sample: its tokens are all equal"
    return ("a", first) if first < 500 else ("b", first - 500)


def test_single_folder_reads_every_sample_once_per_epoch(folders):
    src = source([folders["a"]], mbs=3)
    assert src.sizes == [30] and src.counts == [30]
    rows = torch.cat([src.get(m) for m in range(20)])  # 60 slots = two epochs
    assert rows.shape == (60, L + 1) and rows.dtype == torch.int64
    first, second = [[row_origin(r)[1] for r in rows[e * 30 : (e + 1) * 30]] for e in (0, 1)]
    assert sorted(first) == list(range(30)) and sorted(second) == list(range(30))
    assert first != second, "each pass over the folder has its own order"


def test_rows_are_datatrove_samples(folders):
    """Through datatrove's own reader: row == DatatroveFolderDataset[sample]."""
    from datatrove.utils.dataset import DatatroveFolderDataset

    ds = DatatroveFolderDataset(str(folders["b"]), seq_len=L, recursive=False, shuffle=False)
    src = source([folders["b"]])
    for m in range(25):
        _, sample = src.locate(m)
        assert torch.equal(src.get(m)[0], ds[sample]["input_ids"])


def test_weighted_blend_has_the_exact_proportions_every_epoch(folders):
    src = source([folders["a"], folders["b"]], [0.8, 0.2], mbs=5)
    assert src.epoch_slots == 50 and src.counts == [40, 10]
    origins = [row_origin(r) for m in range(20) for r in src.get(m)]  # 100 slots = 2 epochs
    for epoch in (origins[:50], origins[50:]):
        assert Counter(name for name, _ in epoch) == {"a": 40, "b": 10}
    # Each folder is read through before any sample repeats: a's 30 samples are its first 30 uses,
    # b's 20 samples are its first 20 uses (epochs 0 and 1).
    uses = {name: [s for n, s in origins if n == name] for name in ("a", "b")}
    assert sorted(uses["a"][:30]) == list(range(30))
    assert sorted(uses["b"][:20]) == list(range(20))
    # Mixed through the epoch, not in blocks: b shows up in both halves of epoch 0.
    assert {"b"} <= {n for n, _ in origins[:25]} and {"b"} <= {n for n, _ in origins[25:50]}


def test_a_folder_list_is_weighted_by_size_and_weights_can_be_given_either_way(folders):
    paths = [folders["a"], folders["b"]]
    assert source(paths).counts == [30, 20]
    as_mapping = NanosetDatasetsArgs(dataset_folder={str(folders["a"]): 1.0, str(folders["b"]): 3.0})
    as_list = NanosetDatasetsArgs(dataset_folder=[str(p) for p in paths], dataset_weights=[1, 3])
    kwargs = {"vocab_size": VOCAB, "micro_batch_size": 2, "sequence_length": L, "seed": 0}
    a, b = build_microbatch_source(as_mapping, **kwargs), build_microbatch_source(as_list, **kwargs)
    assert a.counts == b.counts == [13, 37]  # 12.5 and 37.5 of 50: the tie goes to the first folder
    assert all(torch.equal(a.get(m), b.get(m)) for m in range(30))


def test_blend_counts_by_largest_remainder():
    assert blend_counts([1, 1, 1], 10) == [4, 3, 3]
    assert blend_counts([0.5, 0.3, 0.2], 7) == [4, 2, 1]
    assert blend_counts([1e-9, 1], 5) == [0, 5]
    assert sum(blend_counts([0.37, 0.21, 0.42], 1001)) == 1001


@settings(max_examples=20, deadline=None)
@given(
    ids=st.lists(st.integers(0, 300), min_size=1, max_size=10),
    seed=st.integers(0, 2**32),
    mbs=st.integers(1, 5),
    weighted=st.booleans(),
)
def test_get_is_a_pure_function_of_the_id(folders, ids, seed, mbs, weighted):
    """Every id read by a brand-new source (another process) equals the id read by a shared source
    in any order, with repeats and cache evictions."""
    paths, weights = [folders["a"], folders["b"]], ([0.3, 0.7] if weighted else None)
    shared = source(paths, weights, mbs=mbs, seed=seed)
    for m in ids:
        assert torch.equal(shared.get(m), source(paths, weights, mbs=mbs, seed=seed).get(m))


def test_stage_starts_at_its_own_first_id(folders):
    """data_stages switch at start_training_step, and a later stage reads from its slot 0."""
    stages = (
        "data_stages=["
        f"{{name: one, start_training_step: 1, data: {{seed: 5, dataset: {{dataset_folder: {folders['a']}}}}}}},"
        f"{{name: two, start_training_step: 4, data: {{seed: 5, dataset: {{dataset_folder: {folders['b']}}}}}}}]"
    )
    cfg = load_config(TINY, [stages, "tokens.sequence_length=7", f"model.model_config.vocab_size={VOCAB}"])
    data = DataStages(cfg)
    data.open_all()
    b = cfg.microbatches_per_step  # dp 2 * 4 accumulation = 8
    assert data.first_id(4) == 3 * b
    step3 = [row_origin(r)[0] for m in range(2 * b, 3 * b) for r in data.for_step(3).get(m)]
    step4 = [row_origin(r)[0] for m in range(3 * b, 4 * b) for r in data.for_step(4).get(m)]
    assert set(step3) == {"a"} and set(step4) == {"b"}
    alone = source([folders["b"]], mbs=cfg.tokens.micro_batch_size, seed=5)
    assert torch.equal(data.for_step(4).get(3 * b), alone.get(0))
    assert data.for_step(9) is data.for_step(4)
    with pytest.raises(ValueError, match="before this stage's first id"):
        data.for_step(4).get(3 * b - 1)


def copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def _damage_tail(folder: Path) -> None:
    ds = folder / "00000_data.ds"
    ds.write_bytes(ds.read_bytes()[:-2])


def _damage_odd(folder: Path) -> None:
    ds = folder / "00000_data.ds"
    ds.write_bytes(ds.read_bytes() + b"\x00")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: shutil.rmtree(f), "does not exist: tokenize a corpus into it"),
        (
            lambda f: [p.unlink() for p in f.glob("*.ds")],
            "holds no Nanoset files \\(\\*.ds\\): tokenize a corpus",
        ),
        (lambda f: (f / "00000_data.ds.metadata").unlink(), "00000_data.ds has no 00000_data.ds.metadata"),
        (lambda f: (f / "00000_data.ds.index").unlink(), "00000_data.ds has no 00000_data.ds.index"),
        (
            _damage_tail,
            "is damaged or truncated: 324 bytes of 2-byte ids, metadata says 163 tokens, its index ends at 163",
        ),
        (_damage_odd, "is damaged or truncated: 327 bytes of 2-byte ids"),
        (lambda f: (f / "00000_data.ds.metadata").write_text("gpt2|2\n"), "is not datatrove metadata"),
    ],
    ids=["missing", "no-ds", "no-metadata", "no-index", "truncated", "odd-bytes", "bad-metadata"],
)
def test_a_damaged_folder_is_refused_in_one_line(folders, tmp_path, damage, expected):
    folder = copy(folders["b"], tmp_path)
    damage(folder)
    with pytest.raises(InputError, match=expected) as info:
        summarize_nanoset(folder)
    assert "\n" not in str(info.value)


def test_old_corpus_format_points_to_convert(tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"\x00\x00")
    with pytest.raises(InputError, match="convert-corpus"):
        summarize_nanoset(tmp_path)


def test_mixed_tokenizers_are_refused(tmp_path):
    write_nanoset(tmp_path / "m", 4, base=0, tokenizer="gpt2")
    other = TokenizedFile(
        str(tmp_path / "m"), "00009_x.ds", tokenizer_name_or_path="llama", save_final_metadata=True
    )
    other.write([1] * 20, None)
    other.close()
    with pytest.raises(
        InputError, match="was written with tokenizer 'llama' \\(2-byte ids\\) but 00000_data.ds with 'gpt2'"
    ):
        summarize_nanoset(tmp_path / "m")


def test_tokenizer_and_metadata_fields_are_checked(folders):
    kwargs = {"vocab_size": VOCAB, "micro_batch_size": 1, "sequence_length": L, "seed": 0}
    ds = NanosetDatasetsArgs(dataset_folder=str(folders["a"]))
    build_microbatch_source(ds, tokenizer_name_or_path="tok", **kwargs)
    with pytest.raises(
        InputError, match="was tokenized with 'tok', not tokenizer.tokenizer_name_or_path 'gpt2'"
    ):
        build_microbatch_source(ds, tokenizer_name_or_path="gpt2", **kwargs)
    for field, value, expected in [
        ("tokenizer_name", "gpt2", "not tokenizer_name 'gpt2'"),
        ("token_size_in_bytes", 4, "stores 2-byte tokens, not token_size_in_bytes 4"),
        ("vocab_size", VOCAB + 1, "vocab_size 1025 exceeds model_config.vocab_size 1024"),
    ]:
        bad = NanosetDatasetsArgs(dataset_folder=str(folders["a"]), **{field: value})
        with pytest.raises(InputError, match=expected):
            build_microbatch_source(bad, **kwargs)


def test_local_tokenizer_copies_are_the_same_tokenizer(local_dataset, tmp_path):
    """A folder made with one copy of a local tokenizer trains with another copy of it."""
    twin = tmp_path / "tokenizer"
    shutil.copytree(local_dataset.tokenizer_dir, twin)
    ds = NanosetDatasetsArgs(dataset_folder=str(local_dataset.corpus_dir))
    kwargs = {"vocab_size": 512, "micro_batch_size": 1, "sequence_length": 8, "seed": 0}
    build_microbatch_source(ds, tokenizer_name_or_path=str(twin / "tokenizer.json"), **kwargs)
    with pytest.raises(InputError, match="cannot be loaded here to compare contents"):
        build_microbatch_source(ds, tokenizer_name_or_path="gpt2-not-cached-here", **kwargs)


def test_the_fingerprint_line_is_read_and_must_agree_within_a_folder(tmp_path):
    from nanotron_recover.data.nanoset import read_metadata, record_fingerprint

    write_nanoset(tmp_path / "f", 4, base=0, files=2)
    files = sorted((tmp_path / "f").glob("*.ds"))
    assert summarize_nanoset(tmp_path / "f").tokenizer_fingerprint is None  # as datatrove writes it
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    record_fingerprint(files[0], a)
    datatrove_lines = Path(f"{files[1]}.metadata").read_text().splitlines()
    assert Path(f"{files[0]}.metadata").read_text().splitlines() == [
        *datatrove_lines,
        f"tokenizer_fingerprint={a}",
    ]
    assert read_metadata(files[0]).tokenizer_fingerprint == a
    # A folder resumed across versions may record it in some files only.
    assert summarize_nanoset(tmp_path / "f").tokenizer_fingerprint == a
    record_fingerprint(files[1], b)
    with pytest.raises(
        InputError,
        match="00001_data.ds records tokenizer fingerprint sha256:bbbbbbbbbbbb but 00000_data.ds "
        "sha256:aaaaaaaaaaaa, under one name 'tok': one folder, one tokenizer",
    ):
        summarize_nanoset(tmp_path / "f")
    record_fingerprint(files[1], a)  # replaced, not added
    assert Path(f"{files[1]}.metadata").read_text().count("tokenizer_fingerprint=") == 1
    assert summarize_nanoset(tmp_path / "f").tokenizer_fingerprint == a


def test_samples_outside_the_model_vocabulary_are_refused(folders):
    src = NanosetMicroBatches(
        [summarize_nanoset(folders["b"])], None, micro_batch_size=1, sequence_length=L, seed=0, vocab_size=500
    )
    with pytest.raises(InputError, match="holds token id 5\\d\\d >= model vocab_size 500"):
        src.get(0)


def test_folder_smaller_than_one_sample_is_refused(folders):
    with pytest.raises(InputError, match="holds no sample of sequence_length \\+ 1 = 201 tokens"):
        NanosetMicroBatches(
            [summarize_nanoset(folders["b"])],
            None,
            micro_batch_size=1,
            sequence_length=200,
            seed=0,
            vocab_size=VOCAB,
        )


def test_local_dataset_is_a_nanoset_of_the_local_tokenizer(local_dataset):
    """The offline corpus that tests, demo and benchmarks train on is a datatrove Nanoset."""
    folder = summarize_nanoset(local_dataset.corpus_dir)
    assert folder.token_size == 2 and folder.num_tokens > 100_000
    ds = NanosetDatasetsArgs(dataset_folder=str(local_dataset.corpus_dir))
    src = build_microbatch_source(
        ds,
        vocab_size=512,
        micro_batch_size=2,
        sequence_length=64,
        seed=0,
        tokenizer_name_or_path=str(local_dataset.tokenizer_dir),
    )
    batch = src.get(7)
    assert batch.shape == (2, 65) and int(batch.max()) < 512


# -- end to end: DocumentTokenizer -> Nanoset folders -> a blended, staged run, with a fault -------
@pytest.mark.mpi
def test_blended_staged_nanoset_trains_and_recovers_forward(tmp_path, local_dataset):
    """Two folders tokenized by datatrove's DocumentTokenizer (through `tokenize_to_nanoset`), one
    stage on the first folder, then a 70/30 blend from step 4. The run with a replica killed in the
    blended stage consumes the same ids with the same losses as the plain run."""
    import json

    from nanotron_recover.data import stdlib_docstring_texts
    from nanotron_recover.data.preprocess import tokenize_to_nanoset
    from nanotron_recover.logging import read_incidents, read_metrics
    from tests.helpers.curves import assert_replicas_identical, assert_same_curve
    from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

    texts = stdlib_docstring_texts(max_chars=400_000)
    for name, part in (("a", texts[0::2]), ("b", texts[1::2])):
        jsonl = tmp_path / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        tokenize_to_nanoset([jsonl], tmp_path / name, str(local_dataset.tokenizer_dir))
        assert summarize_nanoset(tmp_path / name).num_tokens > 20_000
    stages = (
        "data_stages=["
        f"{{name: one, start_training_step: 1, data: {{seed: 7, dataset: {{dataset_folder: {tmp_path / 'a'}}}}}}},"
        f"{{name: blend, start_training_step: 4, data: {{seed: 7, dataset: {{dataset_folder: "
        f"{{{tmp_path / 'a'}: 0.7, {tmp_path / 'b'}: 0.3}}}}}}}}]"
    )
    steps = 6

    def train(run_dir: Path, extra: list[str]) -> list[dict]:
        args = ["train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(run_dir)]
        sets = [
            *layout(1, 1, 4, 2),
            stages,
            f"tokens.train_steps={steps}",
            f"tokenizer.tokenizer_name_or_path={local_dataset.tokenizer_dir}",
            "checkpoints.save_final_state=false",
            *extra,
        ]
        check(run_cli(args + [a for s in sets for a in ("--set", s)], nproc=4, timeout=300))
        return read_metrics(run_dir)

    plain = train(tmp_path / "plain", [])
    fault = [{"step": 5, "replica": 2, "phase": "forward", "microbatch": 1}]
    faulty = train(tmp_path / "recover", ["recover.enabled=true", f"recover.faults={json.dumps(fault)}"])
    assert [r["step"] for r in faulty] == list(range(1, steps + 1))
    assert_same_curve(faulty, plain)
    assert_replicas_identical(tmp_path / "recover", [0, 1, 3])
    assert [i["step"] for i in read_incidents(tmp_path / "recover")] == [5]
