"""MetricsWriter: what a new writer keeps of the file, read from its end."""

import json

import pytest

from nanotron_recover.errors import InputError
from nanotron_recover.logging import metrics as metrics_module
from nanotron_recover.logging.metrics import MetricsWriter, read_metrics


def _write(path, steps, tail: str = "") -> str:
    text = "".join(json.dumps({"step": s, "loss": 1.0 / s, "pad": "x" * (s % 13)}) + "\n" for s in steps)
    path.write_text(text + tail)
    return text


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
@pytest.mark.parametrize("keep_to", [None, 0, 1, 17, 39, 40])
def test_a_new_writer_keeps_the_records_up_to_its_step_byte_for_byte(tmp_path, monkeypatch, block, keep_to):
    monkeypatch.setattr(metrics_module, "_BLOCK", block)  # every block boundary, and lines across them
    path = tmp_path / "metrics.jsonl"
    full = _write(path, range(1, 41))
    writer = MetricsWriter(path, truncate_after_step=keep_to)
    last = 40 if keep_to is None else keep_to
    assert writer.last_step == last
    writer.write({"step": last + 1})
    writer.write({"step": last})  # a step already in the file is skipped
    writer.close()
    kept = "".join(line + "\n" for line in full.splitlines()[:last])
    assert path.read_text() == kept + json.dumps({"step": last + 1}) + "\n"


@pytest.mark.parametrize("torn", ['{"step": 4', "{", "garbage"])
def test_a_torn_last_line_is_dropped(tmp_path, torn):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3], tail=torn)
    writer = MetricsWriter(path)
    assert writer.last_step == 3
    writer.write({"step": 4})
    writer.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_a_complete_last_record_without_its_newline_is_kept_and_ended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2], tail=json.dumps({"step": 3}))
    writer = MetricsWriter(path)
    assert writer.last_step == 3
    writer.write({"step": 4})
    writer.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_blank_lines_are_no_records_and_a_missing_file_is_an_empty_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2], tail="\n  \n")
    assert MetricsWriter(path).last_step == 2
    fresh = MetricsWriter(tmp_path / "sub" / "metrics.jsonl")
    assert fresh.last_step == 0
    fresh.write({"step": 1})
    fresh.close()
    assert read_metrics(tmp_path / "sub") == [{"step": 1}]


def test_a_bad_line_before_the_last_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\nnot json\n" + json.dumps({"step": 2}) + "\n")
    # Dropping step 2 reads back over the bad line.
    with pytest.raises(InputError, match="metrics.jsonl: the line at byte 12 is not a JSON record"):
        MetricsWriter(path, truncate_after_step=1)


def test_opening_reads_the_end_of_the_file_only(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _write(path, range(1, 20_001))
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(s) or real_loads(s, *a, **k))
    reads = []
    real_open = type(path).open

    def counting_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "b" in mode:
            real_read = f.read
            f.read = lambda n=-1: reads.append(n) or real_read(n)  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(type(path), "open", counting_open)
    # Dropping steps parses only the records it drops and the one it keeps (the kept bytes are
    # copied, not parsed).
    writer = MetricsWriter(path, truncate_after_step=19_995)
    writer.close()
    assert writer.last_step == 19_995
    assert len(parsed) == 6  # of 20,000
    # Dropping nothing reads one block from the end, and parses one record.
    parsed.clear()
    reads.clear()
    writer = MetricsWriter(path)
    writer.close()
    assert writer.last_step == 19_995
    assert len(parsed) == 1
    assert sum(reads) <= metrics_module._BLOCK < path.stat().st_size


def test_a_writer_that_drops_nothing_appends_to_the_same_file_and_one_that_drops_replaces_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, range(1, 11))
    inode = path.stat().st_ino
    MetricsWriter(path, truncate_after_step=10).close()
    assert path.stat().st_ino == inode  # nothing copied, nothing renamed
    stale = MetricsWriter(path)  # a writer that is still around when a relaunch cuts the file
    relaunched = MetricsWriter(path, truncate_after_step=7)
    assert path.stat().st_ino != inode  # a reader following the file sees it replaced
    stale.write({"step": 11})  # lands in the file the cut replaced, which nobody reads
    relaunched.write({"step": 8, "redone": True})
    stale.close()
    relaunched.close()
    assert [(r["step"], r.get("redone")) for r in read_metrics(path)][-2:] == [(7, None), (8, True)]
