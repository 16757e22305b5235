"""Atomic replacement of the run directory's small files, between threads of one process."""

from __future__ import annotations

import threading

import pytest

from nanotron_recover.atomic_file import write_text_atomically


def test_two_threads_writing_one_file_at_once_both_rename_a_whole_file(tmp_path):
    """A rank's watchdog and its join watch give a stuck re-join up within milliseconds of each
    other, both writing ``abandoned.json``. Both hold their text aside before either renames (the
    barrier): with one aside name per process, the second truncated the file the first renamed
    into place, and the second's rename failed."""
    path = tmp_path / "abandoned.json"
    both_written = threading.Barrier(2, timeout=10)
    texts = {"watchdog": '{"reason": "watchdog"}\n', "join watch": '{"reason": "join watch"}\n'}
    errors: list[BaseException] = []

    def write(text: str) -> None:
        try:
            write_text_atomically(path, text, before_rename=both_written.wait)
        except BaseException as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert path.read_text() in texts.values()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abandoned.json"]  # no aside file left


def test_a_refused_rename_leaves_the_old_file_and_no_aside_file(tmp_path):
    path = tmp_path / "outcome.json"
    path.write_text("old\n")

    def refuse() -> None:
        raise PermissionError("fenced")

    with pytest.raises(PermissionError):
        write_text_atomically(path, "new\n", before_rename=refuse)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["outcome.json"]
