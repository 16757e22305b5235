"""MPI worker for tests/integration/ft/test_ulfm.py: agreements while another thread makes progress.

Run under ``mpirun --with-ft ulfm`` on 3 ranks. Every rank pins itself to CPU 0, where rank 0 also
starts two busy processes (so that a rank is often preempted in the middle of an agreement), and a
helper thread polls ``MPI_Test`` on a receive on another communicator without pause, as the
failure watch does every 50 ms. The main thread runs ``--agreements`` agreements of ``0x1FFF``,
each of which must return ``0x1FFF``. ``bare``: the helper polls at any time; ``fixed``: it keeps
out while the main thread is inside an agreement (``ulfm.agreement``). Each rank prints one JSON
line: how many agreements returned another value, and the first few of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HOG = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("bare", "fixed"))
    ap.add_argument("--agreements", type=int, required=True)
    ap.add_argument("--hog-s", type=float, default=120.0)
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})
    from nanotron_recover.ft.ulfm import MPI, agreement, helper_done, helper_may_progress

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    other = world.Dup()
    hogs = []
    if world.Get_rank() == 0:
        pin = lambda: os.sched_setaffinity(0, {0})  # noqa: E731
        for _ in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", HOG.format(s=args.hog_s)], preexec_fn=pin))
    stop = threading.Event()

    def helper() -> None:
        request = other.Irecv(bytearray(1), source=MPI.ANY_SOURCE, tag=77)
        while not stop.is_set():
            time.sleep(0)  # hand the interpreter over, as the failure watch's wait does
            if args.mode == "fixed":
                if not helper_may_progress():
                    continue
                try:
                    request.Test()
                finally:
                    helper_done()
            else:
                request.Test()

    threading.Thread(target=helper, daemon=True).start()
    world.Barrier()
    wrong = []
    for i in range(args.agreements):
        if args.mode == "fixed":
            with agreement():
                value = world.Agree(0x1FFF)
        else:
            value = world.Agree(0x1FFF)
        if value != 0x1FFF:
            wrong.append([i, value])
    stop.set()
    for hog in hogs:
        hog.kill()
        hog.wait()
    print(json.dumps({"rank": world.Get_rank(), "wrong": len(wrong), "first": wrong[:3]}), flush=True)
    world.Barrier()
    os._exit(0)  # no MPI_Finalize (ulfm.py)


if __name__ == "__main__":
    main()
