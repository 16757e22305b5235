"""``ft/ulfm.py``'s checked agreement: a result with a bit no participant can set ends the job.

Run in a child process (importing ``ft.ulfm`` initializes MPI), on a stand-in communicator whose
``Agree`` returns what the test says and whose ``Abort`` records the call.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import json, sys
from nanotron_recover.ft import ulfm

class Comm:
    def __init__(self, result):
        self.result, self.contributed, self.aborted = result, None, None
    def Agree(self, value):
        self.contributed = value
        return self.result
    def Abort(self, code):
        self.aborted = code

out = {}
for name, result, mine, valid in json.loads(sys.argv[1]):
    comm = Comm(result)
    out[name] = [ulfm.agree(comm, mine, valid, name), comm.contributed, comm.aborted]
print(json.dumps(out))
"""


def _run(cases: list) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_agree_passes_valid_results_and_ends_the_job_on_bits_no_rank_set():
    results, stderr = _run(
        [
            ["step", 0x1FFD, 0x1FFF, 0x1FFF],  # an AND of contributions: within the bits
            ["commit", 0, 1, 1],  # another rank contributed 0
            ["garbage", -0x47505FA8, 0x1FFF, 0x1FFF],  # seen in a campaign
            ["high bit", 0x37838AD8, 1, 1],
            ["not mine", 0x3, 0x1, 0x1FFF],  # a bit this rank did not set, inside the valid ones
        ]
    )
    assert results["step"] == [0x1FFD, 0x1FFF, None]
    assert results["commit"] == [0, 1, None]
    assert [results[k][2] for k in ("garbage", "high bit", "not mine")] == [86, 86, 86], results
    assert "the garbage agreement returned -0x47505fa8, which no rank can have contributed" in stderr
    assert "the high bit agreement returned 0x37838ad8" in stderr
