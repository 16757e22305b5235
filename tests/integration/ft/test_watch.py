"""``ft/watch.py``: the failure watch makes no MPI call while the main thread is inside an agreement.

Runs in a child process (importing ``ft.watch`` initializes MPI) with a stand-in communicator
whose receive request records, on every ``Test``, whether the main thread was inside
``ulfm.agreement`` at that moment. That Open MPI's agreements go wrong without this is shown in
``tests/integration/ft/test_ulfm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

# A launch communicator as the watch uses it: ``Request`` is the pending receive, ``Failed`` the
# group ``Get_failed`` returns.
_STAND_IN = """
def stand_in_comm(Request, Failed=None):
    class Comm:
        def Dup(self): return self
        def Set_errhandler(self, handler): pass
        def Get_group(self): return None
        def Get_size(self): return 3
        def Irecv(self, buf, source, tag): return Request()
        def Get_failed(self): return Failed()
        def Ack_failed(self): pass
    return Comm()
"""

_CHILD = (
    _STAND_IN
    + """
import json, threading, time
from nanotron_recover.ft import ulfm, watch

inside = threading.Event()
tests = {"outside": 0, "inside": 0}

class Request:
    def Test(self):
        tests["inside" if inside.is_set() else "outside"] += 1
        return False

w = watch.FailureWatch(stand_in_comm(Request), poll_s=0.001)
time.sleep(0.3)
before = tests["outside"]
with ulfm.agreement():
    inside.set()
    time.sleep(0.5)
    inside.clear()
time.sleep(0.3)
w.stop()
print(json.dumps({"before": before, "inside": tests["inside"], "after": tests["outside"] - before}))
"""
)


def test_the_watch_keeps_out_of_mpi_while_the_main_thread_agrees():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    polls = json.loads(done.stdout.strip().splitlines()[-1])
    # It polls before and after (every 1 ms), never during the agreement's 0.5 s.
    assert polls["before"] > 0 and polls["after"] > 0, polls
    assert polls["inside"] == 0, polls


_NAMING_CHILD = (
    _STAND_IN
    + """
import json, threading, time
from mpi4py import MPI
from nanotron_recover.ft import ulfm, watch

failed = []  # the ranks this process's MPI has marked failed (Get_failed's group)
inside = threading.Event()
report = threading.Event()  # the pending receive completes with an error (a failure reported)
calls = []

class Failed:
    def Get_size(self): return len(failed)
    def Translate_ranks(self, ranks, group): return [failed[i] for i in ranks]
    def Free(self): pass

class Request:
    def Test(self):
        assert not inside.is_set(), "progress inside an agreement"
        if report.is_set():
            report.clear()
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        return False

w = watch.FailureWatch(stand_in_comm(Request, Failed), poll_s=0.001)
w.subscribe(lambda ranks, when: calls.append(("acting", ranks, inside.is_set())))
w.subscribe_during_agreement(lambda ranks, when: calls.append(("naming", ranks, inside.is_set())))
with ulfm.agreement():
    inside.set()
    time.sleep(0.2)
    failed.append(2)  # the main thread's progress in the agreement marked rank 2 failed
    time.sleep(0.3)
    inside.clear()
time.sleep(0.1)
report.set()  # the next poll outside the agreement learns it the usual way
time.sleep(0.3)
w.stop()
print(json.dumps({"calls": calls, "known": sorted(w.known_failed())}))
"""
)


def test_the_watch_names_a_failure_while_the_main_thread_agrees_without_progress():
    """A frozen rank's peers wait in an agreement: their detector marks it failed during that
    agreement, and the watch names it then (once, to the naming callbacks only); the acting
    callbacks learn it at the first poll after the agreement, as before."""
    done = subprocess.run([sys.executable, "-c", _NAMING_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Exception in thread" not in done.stderr, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Named once, inside the agreement; acted on after it, at the poll that acknowledges it.
    assert seen["calls"] == [["naming", [2], True], ["acting", [2], False]], seen
    assert seen["known"] == [2], seen
