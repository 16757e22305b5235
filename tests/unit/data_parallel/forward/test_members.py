"""Members: who gives a stuck re-join up, and how long a spawned process waits for the members."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanotron_recover.config.recover import RecoverArgs
from nanotron_recover.data_parallel.forward.members import REJOIN_PHASE, Members
from nanotron_recover.data_parallel.forward.rejoin import members_wait_s
from nanotron_recover.outcome import read_abandoned

EXPIRED = f"watchdog: phase {REJOIN_PHASE!r} hung: open for 300.1s, deadline 300.000s"


def state(tmp_path, joining: bool) -> SimpleNamespace:
    # ftc None: a process whose join has not committed writes no failure record.
    return SimpleNamespace(run_dir=tmp_path, generation=0, joining=joining, ftc=None)


def test_a_member_stuck_in_a_join_gives_the_job_up(tmp_path):
    Members(state(tmp_path, joining=False)).on_watchdog_expire(EXPIRED)
    assert read_abandoned(tmp_path) is not None


def test_a_spawned_process_past_its_deadline_does_not_give_the_job_up(tmp_path):
    """It waited on the members (a join they abandoned): only it dies, the job goes on."""
    Members(state(tmp_path, joining=True)).on_watchdog_expire(EXPIRED)
    assert read_abandoned(tmp_path) is None


@pytest.mark.parametrize(
    ("heartbeat_timeout_s", "join_timeout_s", "expected"),
    [(5.0, 300.0, 30.0), (10.0, 300.0, 60.0), (10.0, 45.0, 45.0)],
)
def test_a_spawned_process_waits_for_the_members_a_few_detections(
    heartbeat_timeout_s, join_timeout_s, expected
):
    args = RecoverArgs(heartbeat_timeout_s=heartbeat_timeout_s)
    args.rejoin.join_timeout_s = join_timeout_s
    assert members_wait_s(args) == expected


def test_a_failure_notice_names_the_failed_processes_of_other_hosts_at_once(tmp_path):
    """Before any repair: the supervisor probes their hosts (``ft/suspects.py``)."""
    import socket

    from nanotron_recover.ft.processes import ProcessInfo
    from nanotron_recover.ft.suspects import suspect_names

    here = socket.gethostname()
    processes = [
        ProcessInfo(0, here, 100, None),
        ProcessInfo(1, "elsewhere", 4242, None),
        ProcessInfo(2, here, 102, None),
    ]
    ftc = SimpleNamespace(processes=processes, rank=0, in_ft_operation=True, parked=False)
    s = SimpleNamespace(run_dir=tmp_path, ftc=ftc, my_replica_ranks={0}, joining=False)
    Members(s).on_failure_notice([1, 2], when=0.0)
    assert suspect_names(tmp_path) == {"elsewhere.4242"}  # rank 2 shares this host: the runtime's


def test_only_the_current_generation_marks_removed_processes(tmp_path):
    """A logging rank thawed after its job was relaunched must not mark the new job's processes
    removed (the supervisor's watch and ``check_member`` read those markers)."""
    from nanotron_recover import fencing
    from nanotron_recover.generation import Relaunch, write_relaunch

    peer = SimpleNamespace(host="node-b", pid=4242)
    ftc = SimpleNamespace(parked=False, replica=0, senior_replica=0, local_rank=0, processes=[None, peer])
    s = SimpleNamespace(run_dir=tmp_path, generation=0, joining=False, ftc=ftc)
    members = Members(s)
    members.fence((1,))
    assert fencing.removed_marker(tmp_path, "node-b", 4242).exists()
    fencing.removed_marker(tmp_path, "node-b", 4242).unlink()
    write_relaunch(tmp_path, Relaunch(1, "node_lost", 0.0, 4))  # the job was relaunched since
    members.fence((1,))
    assert not fencing.removed_marker(tmp_path, "node-b", 4242).exists()


def test_naming_suspects_only_names(tmp_path):
    """Called while the main thread is inside an agreement: it writes names and nothing else, even
    for a failed peer of this rank's replica that would make ``on_failure_notice`` leave."""
    from nanotron_recover.ft.processes import ProcessInfo
    from nanotron_recover.ft.suspects import suspect_names

    processes = [
        ProcessInfo(0, "here", 100, None),
        ProcessInfo(1, "elsewhere", 4242, None),
        ProcessInfo(2, "", 0, None),  # lost before the process table was gathered: nothing known
    ]
    ftc = SimpleNamespace(processes=processes, rank=0, in_ft_operation=False, parked=False)
    s = SimpleNamespace(run_dir=tmp_path, ftc=ftc, my_replica_ranks={0, 1}, joining=False, rejoin_on=False)
    Members(s).name_suspects([1, 2], when=0.0)  # on_failure_notice would fail-stop this process here
    assert suspect_names(tmp_path) == {"elsewhere.4242"}
