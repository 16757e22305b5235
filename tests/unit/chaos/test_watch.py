"""JsonlTail and RunWatch: following metrics.jsonl as the job appends to it, cuts it and replaces it."""

import json
import os

from nanotron_recover.chaos.watch import JsonlTail, RunWatch


def _line(step: int, replicas: int = 3) -> str:
    return json.dumps({"step": step, "time": 1000.0 + step, "replicas": replicas}) + "\n"


def _steps(records) -> list[int]:
    return [r["step"] for r in records]


def test_appended_records_are_new_once_and_a_torn_line_waits_for_its_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == ([], False)  # no file yet
    path.write_text("".join(_line(s) for s in (1, 2, 3)))
    new, dropped = tail.poll()
    assert _steps(new) == [1, 2, 3] and not dropped
    half = _line(4)[:9]
    with path.open("a") as f:
        f.write(half)
    assert tail.poll() == ([], False)
    with path.open("a") as f:
        f.write(_line(4)[9:])
    new, dropped = tail.poll()
    assert _steps(new) == [4] and not dropped
    assert _steps(tail.records) == [1, 2, 3, 4]


def test_a_file_cut_in_place_keeps_what_precedes_the_cut_and_what_follows_is_new(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s) for s in range(1, 7)))
    tail = JsonlTail(path)
    tail.poll()
    with path.open("a") as f:
        f.write(_line(7)[:5])  # a torn line, read as partial
    tail.poll()
    # A relaunch keeps steps 1-4 (cut in place, the same file) and commits 5 again.
    os.truncate(path, sum(len(_line(s)) for s in range(1, 5)))
    new, dropped = tail.poll()
    assert new == [] and dropped
    assert _steps(tail.records) == [1, 2, 3, 4]
    with path.open("a") as f:
        f.write(_line(5, replicas=2))
    new, dropped = tail.poll()
    assert _steps(new) == [5] and new[0]["replicas"] == 2 and not dropped
    # A cut that drops only the torn line (every record kept) drops nothing seen.
    with path.open("a") as f:
        f.write('{"step"')
    tail.poll()
    os.truncate(path, path.stat().st_size - len('{"step"'))
    assert tail.poll() == ([], False)
    assert _steps(tail.records) == [1, 2, 3, 4, 5]


def test_a_replaced_file_is_read_again_whole_and_none_of_it_is_new(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s) for s in (1, 2, 3)))
    tail = JsonlTail(path)
    tail.poll()
    aside = tmp_path / "aside"
    aside.write_text("".join(_line(s) for s in (1, 2)))
    os.replace(aside, path)
    assert tail.poll() == ([], True)
    assert _steps(tail.records) == [1, 2]


def test_the_watch_counts_a_commit_after_a_cut_and_records_the_drop(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s) for s in range(1, 6)))
    watch = RunWatch(tmp_path)
    watch.poll()
    assert [c.step for c in watch.commits] == [1, 2, 3, 4, 5]
    # A relaunch cuts steps 4 and 5 when it starts, and commits step 4 seconds later.
    os.truncate(path, sum(len(_line(s)) for s in range(1, 4)))
    watch.poll()
    assert watch.last_step == 3
    assert [(a, b) for _, a, b in watch.step_drops] == [(5, 3)]
    with path.open("a") as f:
        f.write(_line(4, replicas=2))
    watch.poll()
    assert watch.last_step == 4
    assert [(c.step, c.replicas) for c in watch.commits][-2:] == [(5, 3), (4, 2)]
