"""Processes a rank learned failed, named in the run directory at once (``ft/suspects.py``)."""

from __future__ import annotations

from nanotron_recover.ft.processes import ProcessInfo
from nanotron_recover.ft.suspects import host_of, note_suspects, suspect_names


def test_only_processes_of_other_hosts_are_named_and_twice_is_once(tmp_path):
    failed = [ProcessInfo(0, "node1.cluster", 11, None), ProcessInfo(1, "node2", 22, None)]
    assert note_suspects(tmp_path, failed, my_host="node2") == ["node1.cluster.11"]
    assert note_suspects(tmp_path, failed, my_host="node3") == ["node1.cluster.11", "node2.22"]
    assert suspect_names(tmp_path) == {"node1.cluster.11", "node2.22"}
    # A host name with dots keeps them; the pid is what follows the last one.
    assert sorted(host_of(n) for n in suspect_names(tmp_path)) == ["node1.cluster", "node2"]


def test_nothing_named_leaves_no_folder(tmp_path):
    assert note_suspects(tmp_path, [ProcessInfo(0, "here", 5, None)], my_host="here") == []
    assert suspect_names(tmp_path) == set() and not (tmp_path / "suspects").exists()
