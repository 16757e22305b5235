"""JsonlTail and RunWatch: following metrics.jsonl as the job appends to it and a new writer cuts it."""

import json

from nanotron_recover.chaos.watch import JsonlTail, RunWatch
from nanotron_recover.logging.metrics import MetricsWriter


def _record(step: int, replicas: int = 3, loss: float = 1.0) -> dict:
    return {"step": step, "time": 1000.0 + step, "replicas": replicas, "loss": loss}


def _steps(records) -> list[int]:
    return [r["step"] for r in records]


def test_appended_records_are_new_once_and_a_torn_line_waits_for_its_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == ([], False)  # no file yet
    path.write_text("".join(json.dumps(_record(s)) + "\n" for s in (1, 2, 3)))
    new, rewritten = tail.poll()
    assert _steps(new) == [1, 2, 3] and not rewritten
    line = json.dumps(_record(4)) + "\n"
    with path.open("a") as f:
        f.write(line[:9])
    assert tail.poll() == ([], False)
    with path.open("a") as f:
        f.write(line[9:])
    new, rewritten = tail.poll()
    assert _steps(new) == [4] and not rewritten
    assert _steps(tail.records) == [1, 2, 3, 4]


def test_a_writer_that_drops_steps_is_seen_even_when_the_redone_steps_came_before_the_poll(tmp_path):
    """A relaunch cuts the steps after the state it restored and commits them again; the watch
    must not keep the old records, even when the new ones, longer, were appended before it looked
    (the file then is no shorter than what it had read)."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsWriter(path)
    for s in range(1, 9):
        first.write(_record(s))
    first.close()
    watch = RunWatch(tmp_path)
    watch.poll()
    assert [c.step for c in watch.commits] == list(range(1, 9))
    relaunched = MetricsWriter(path, truncate_after_step=4)
    for s in range(5, 10):
        relaunched.write({**_record(s, replicas=2, loss=2.0), "extra": "x" * 50})
    relaunched.close()
    watch.poll()
    assert watch.last_step == 9
    assert [(r["step"], r["loss"]) for r in watch.metrics.records] == [(s, 1.0) for s in range(1, 5)] + [
        (s, 2.0) for s in range(5, 10)
    ]
    # What was read again whole is no new commit; the steps appended after it are.
    relaunched = MetricsWriter(path)
    relaunched.write(_record(10, replicas=3))
    relaunched.close()
    watch.poll()
    assert [c.step for c in watch.commits] == list(range(1, 9)) + [10]
