"""The TCP eager limit every process of a job shares, and the cut of large buffers below it."""

from __future__ import annotations

import pytest

from nanotron_recover import launcher
from nanotron_recover.ft import transport
from nanotron_recover.ft.transport import TCP_EAGER_LIMIT_BYTES, eager_bytes, eager_slices


def test_slices_cover_the_buffer_once_each_below_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMPI_MCA_btl_tcp_eager_limit", raising=False)
    limit = eager_bytes()
    assert TCP_EAGER_LIMIT_BYTES - 4096 < limit < TCP_EAGER_LIMIT_BYTES  # room left for headers
    for n, itemsize in [
        (1, 4),
        (limit // 4, 4),
        (limit // 4 + 1, 4),
        (10_000_019, 4),
        (3 * limit, 1),
        (999_983, 8),
    ]:
        parts = eager_slices(n, itemsize)
        covered = [i for p in parts for i in range(p.start, p.stop)]
        assert covered == list(range(n)), (n, itemsize)
        assert all((p.stop - p.start) * itemsize <= limit for p in parts)
        assert len(parts) == -(-n * itemsize // (limit // itemsize * itemsize))


def test_an_empty_buffer_still_makes_one_call() -> None:
    assert eager_slices(0, 4) == [slice(0, 0)]


def test_a_limit_set_for_the_job_is_the_one_cut_by(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_MCA_btl_tcp_eager_limit", str(64 << 10))
    parts = eager_slices(1 << 20, 4)
    assert max((p.stop - p.start) * 4 for p in parts) <= (64 << 10) - 1024
    monkeypatch.setenv("OMPI_MCA_btl_tcp_eager_limit", "not a number")  # Open MPI would refuse it
    assert eager_bytes() == TCP_EAGER_LIMIT_BYTES - 1024


def test_the_launch_line_and_each_process_set_the_same_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMPI_MCA_btl_tcp_eager_limit", raising=False)
    flags = launcher.mpirun_command(4, ["prog"], heartbeat=(1, 5))
    i = flags.index("btl_tcp_eager_limit")
    name, value = transport.eager_limit_env()
    assert flags[i - 1] == "--mca" and flags[i + 1] == value == str(TCP_EAGER_LIMIT_BYTES)
    assert name == "OMPI_MCA_btl_tcp_eager_limit"
    plain = launcher.mpirun_command(4, ["prog"], ft=False)
    assert plain[plain.index("btl_tcp_eager_limit") + 1] == value  # the baseline's ranks too


def test_a_limit_already_in_the_environment_wins_on_the_launch_line_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Spawned processes inherit the environment, launched ranks get the mpirun line: one value for
    # both, since a receiver's buffers are sized by its own limit.
    monkeypatch.setenv("OMPI_MCA_btl_tcp_eager_limit", str(1 << 20))
    flags = launcher.mpirun_command(4, ["prog"])
    assert flags[flags.index("btl_tcp_eager_limit") + 1] == str(1 << 20)
    assert transport.eager_limit_env() == ("OMPI_MCA_btl_tcp_eager_limit", str(1 << 20))
    assert eager_bytes() == (1 << 20) - 1024
