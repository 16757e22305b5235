"""Hosts lost on the job's own word (``lost_hosts.py``): a new incident that lost ranks makes the
supervisor probe their hosts; one that does not answer is named, once."""

from __future__ import annotations

import json
from pathlib import Path

from nanotron_recover.ft.processes import ProcessInfo
from nanotron_recover.ft.suspects import note_suspects
from nanotron_recover.lost_hosts import LostHostWatch


def write_ranks(run_dir: Path, hosts: list[str]) -> None:
    table = [{"rank": r, "host": h, "pid": 1000 + r, "replica": r} for r, h in enumerate(hosts)]
    (run_dir / "ranks.json").write_text(json.dumps(table))


def incident(
    run_dir: Path,
    kind: str,
    failed_ranks: list[int],
    partial: bool = False,
    failed_hosts: list[str] | None = None,
) -> None:
    record = {"step": 4, "kind": kind, "failed_ranks": failed_ranks}
    if failed_hosts is not None:
        record["failed_hosts"] = failed_hosts
    line = json.dumps(record)
    with open(run_dir / "incidents.jsonl", "a") as f:
        f.write(line[: len(line) // 2] if partial else line + "\n")


class Probe:
    def __init__(self, answering: list[str]):
        self.answer, self.calls = answering, 0

    def __call__(self) -> list[str]:
        self.calls += 1
        return list(self.answer)


def test_a_hang_whose_host_is_silent_names_the_host_once(tmp_path):
    write_ranks(tmp_path, ["a", "b", "c"])
    probe = Probe(["a", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe)
    assert watch.poll() is None and probe.calls == 0  # nothing happened: nothing probed
    incident(tmp_path, "hang", [1])
    assert watch.poll() == "hosts b of ranks the job lost do not answer"
    assert watch.last_answering == ["a", "c"]
    assert watch.poll() is None  # said once


def test_the_lost_host_is_the_incidents_not_the_rank_tables_after_a_rejoin(tmp_path):
    # Rank 1 failed on b (cut off); its replacement re-joined on the spare d before the supervisor
    # polled, and the rank table now says rank 1 is on d, which answers. The incident's own hosts
    # name b, which does not: the job is relaunched without it.
    write_ranks(tmp_path, ["a", "d", "c"])
    probe = Probe(["a", "c", "d"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c", "d"], probe)
    incident(tmp_path, "crash", [1], failed_hosts=["b"])
    assert watch.poll() == "hosts b of ranks the job lost do not answer"
    # Without the incident's hosts the table is the fallback, and names d, which answers.
    watch2 = LostHostWatch(tmp_path, ["a", "b", "c", "d"], probe)
    incident(tmp_path, "crash", [1])
    assert watch2.poll() is None


def test_a_rank_lost_on_a_healthy_host_costs_no_relaunch(tmp_path):
    write_ranks(tmp_path, ["a", "b", "c"])
    probe = Probe(["a", "b", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe)
    incident(tmp_path, "crash", [2])
    assert watch.poll() is None and probe.calls == 1
    assert watch.poll() is None and probe.calls == 1  # the same incident is not probed again


def test_other_kinds_earlier_incidents_and_half_written_lines_are_not_probed(tmp_path):
    write_ranks(tmp_path, ["a", "b"])
    incident(tmp_path, "hang", [1])  # an earlier launch's incident
    probe = Probe(["a"])
    watch = LostHostWatch(tmp_path, ["a", "b"], probe)
    incident(tmp_path, "rejoin", [1])
    incident(tmp_path, "io", [1])
    assert watch.poll() is None and probe.calls == 0
    incident(tmp_path, "hang", [1], partial=True)
    assert watch.poll() is None and probe.calls == 0
    with open(tmp_path / "incidents.jsonl", "a") as f:
        f.write("1]}\n")  # the rest of that line: now complete but not JSON
    assert watch.poll() is None and probe.calls == 0
    incident(tmp_path, "hang", [1])
    assert watch.poll() == "hosts b of ranks the job lost do not answer"


def test_a_host_outside_the_allocation_is_never_named(tmp_path):
    write_ranks(tmp_path, ["a", "elsewhere"])
    probe = Probe(["a"])
    watch = LostHostWatch(tmp_path, ["a", "b"], probe)
    incident(tmp_path, "hang", [1])
    assert watch.poll() is None and probe.calls == 0


def test_a_probe_that_raises_names_no_host_and_says_so_once(tmp_path):
    write_ranks(tmp_path, ["a", "b", "c"])
    lines: list[str] = []

    def probe() -> list[str]:
        raise OSError("srun not found")

    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe, log=lines.append)
    incident(tmp_path, "hang", [1])
    assert watch.poll() is None and watch.last_answering is None
    assert watch.poll() is None  # the same incident is not probed again
    assert lines == ["probing hosts b failed (OSError: srun not found): none counted lost"]


def test_a_process_named_failed_is_probed_before_any_incident(tmp_path):
    # A survivor named rank 1's process on b the moment it learned it failed; no incident yet
    # (the other survivor waits in the reduction until the link is back). b does not answer.
    write_ranks(tmp_path, ["a", "b", "c"])
    probe = Probe(["a", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe)
    note_suspects(tmp_path, [ProcessInfo(1, "b", 1001, None)], my_host="c")
    note_suspects(tmp_path, [ProcessInfo(1, "b", 1001, None)], my_host="a")  # a second survivor
    assert watch.poll() == "hosts b of ranks the job lost do not answer" and probe.calls == 1
    assert watch.poll() is None and probe.calls == 1  # each name is probed once


def test_names_of_earlier_launches_and_of_answering_hosts_cost_no_relaunch(tmp_path):
    write_ranks(tmp_path, ["a", "b", "c"])
    note_suspects(tmp_path, [ProcessInfo(2, "c", 1002, None)], my_host="a")  # an earlier launch's
    probe = Probe(["a", "b", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe)
    assert watch.poll() is None and probe.calls == 0
    note_suspects(tmp_path, [ProcessInfo(1, "b", 1001, None)], my_host="a")  # killed on a healthy b
    assert watch.poll() is None and probe.calls == 1
    # A later process on the same host is a new name, probed again.
    note_suspects(tmp_path, [ProcessInfo(1, "b", 2001, None)], my_host="a")
    assert watch.poll() is None and probe.calls == 2
    # This launch's process that got the pid an earlier launch's named process had is new too.
    note_suspects(tmp_path, [ProcessInfo(2, "c", 1002, None)], my_host="a")
    assert watch.poll() is None and probe.calls == 3


def test_a_stalled_job_names_a_host_of_its_rank_table_that_does_not_answer(tmp_path):
    # A spawned process on d was cut off: nobody watches it, so no incident and no suspect name
    # it. The job commits nothing; asked, d does not answer. A host lost before this launch (e,
    # not in the table) is not named again, and the same host is named once.
    write_ranks(tmp_path, ["a", "d", "c"])
    probe = Probe(["a", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c", "d", "e"], probe)
    assert watch.poll() is None and probe.calls == 0
    assert watch.poll_stalled() == "hosts d of the job do not answer while it commits no step"
    assert watch.last_answering == ["a", "c"]
    assert watch.poll_stalled() is None


def test_a_stalled_job_on_answering_hosts_is_left_to_its_bounds(tmp_path):
    write_ranks(tmp_path, ["a", "b", "c"])
    probe = Probe(["a", "b", "c"])
    watch = LostHostWatch(tmp_path, ["a", "b", "c"], probe)
    assert watch.poll_stalled() is None and probe.calls == 1
    (tmp_path / "ranks.json").write_text("not json")
    assert watch.poll_stalled() is None and probe.calls == 1  # no table: nothing to ask about


def test_a_stalled_job_whose_probe_raises_names_no_host(tmp_path):
    write_ranks(tmp_path, ["a", "b"])

    def broken() -> list[str]:
        raise RuntimeError("sinfo vanished")

    lines: list[str] = []
    watch = LostHostWatch(tmp_path, ["a", "b"], broken, log=lines.append)
    assert watch.poll_stalled() is None
    assert lines == ["probing hosts a, b failed (RuntimeError: sinfo vanished): none counted lost"]
