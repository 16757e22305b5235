"""The state transfer of a re-join over real MPI, with tensors larger than the TCP eager limit.

Each tensor goes as parts below the limit (``ft/transport.py``); the receivers must rebuild the
donor's state byte for byte, over the TCP transport the cluster uses.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from nanotron_recover.launcher import mpirun_command
from tests.helpers.mpirun_utils import check, run_process

WORKER = Path(__file__).resolve().parents[4] / "tests" / "helpers" / "mpi_workers" / "transfer_worker.py"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI with ULFM) not available"),
]


def test_a_state_larger_than_the_eager_limit_arrives_whole(tmp_path: Path) -> None:
    cmd = mpirun_command(3, [sys.executable, str(WORKER), "--out", str(tmp_path)])
    cmd[cmd.index("^ofi")] = "tcp,self"  # the ranks share a host: force the transport the cluster uses
    check(run_process(cmd, timeout=120))
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    assert all(d["ok"] for d in records.values())
    for r in (1, 2):
        assert records[r]["equal"], f"rank {r} received another state"
        assert records[r]["names"] == ["big", "one_part", "half", "empty"]
        assert records[r]["meta"] == {"step": 42}
    assert records[0]["bytes"] == records[1]["bytes"] + records[2]["bytes"]  # one copy per receiver
