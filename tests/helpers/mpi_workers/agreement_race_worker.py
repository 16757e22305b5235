"""MPI worker for tests/integration/ft/test_ulfm.py: agreements while another thread makes progress.

Run under ``mpirun --with-ft ulfm`` on 3 ranks; rank 0 also starts two busy processes, so that a
rank is often preempted in the middle of an agreement. The other thread making MPI progress is the
product's failure watch (``ft/watch.py``) on a duplicate of the world, polling every ``--poll-s``
(0.1 ms: the race is rare, and every poll is a chance for it). The main thread runs agreements of
``0x1FFF``, each of which must return ``0x1FFF``, in rounds of ``--round``.

- ``bare``: the watch without its side of the lock (it polls whenever its period says), and plain
  ``Agree`` calls.
- ``fixed``: the watch as it is, and every agreement under ``ulfm.agreement``.

The ranks run ``--agreements`` agreements, or with ``--until-wrong`` stop after the first round in
which any rank got a wrong value (summed with an ``Allreduce`` after each round): the race's rate
depends on the machine, so the test looks for it rather than counting it over a fixed number. Each
rank prints one JSON line: how many agreements it ran, how many returned another value, and the
first few of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HOG = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("bare", "fixed"))
    ap.add_argument("--agreements", type=int, required=True)
    ap.add_argument("--round", type=int, default=500)
    ap.add_argument("--poll-s", type=float, default=0.0001)
    ap.add_argument("--until-wrong", action="store_true")
    ap.add_argument("--hog-s", type=float, default=120.0)
    args = ap.parse_args()
    from nanotron_recover.ft import watch as watch_module
    from nanotron_recover.ft.ulfm import MPI, agreement

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    other = world.Dup()
    hogs = []
    if world.Get_rank() == 0:
        for _ in range(2):
            hogs.append(subprocess.Popen([sys.executable, "-c", HOG.format(s=args.hog_s)]))
    if args.mode == "bare":
        # The failure watch without its side of the lock: it polls whenever its period says.
        watch_module.helper_may_progress = lambda: True
        watch_module.helper_done = lambda: None
    watch = watch_module.FailureWatch(other, poll_s=args.poll_s)
    world.Barrier()
    wrong, ran, seen = [], 0, 0
    while ran < args.agreements and not (args.until_wrong and seen):
        for _ in range(min(args.round, args.agreements - ran)):
            if args.mode == "fixed":
                with agreement():
                    value = world.Agree(0x1FFF)
            else:
                value = world.Agree(0x1FFF)
            if value != 0x1FFF:
                wrong.append([ran, value])
            ran += 1
        if args.until_wrong:
            total = bytearray(len(wrong).to_bytes(8, "little"))
            world.Allreduce(MPI.IN_PLACE, [total, MPI.INT64_T], op=MPI.SUM)
            seen = int.from_bytes(total, "little")
    watch.stop()
    for hog in hogs:
        hog.kill()
        hog.wait()
    print(
        json.dumps({"rank": world.Get_rank(), "ran": ran, "wrong": len(wrong), "first": wrong[:3]}),
        flush=True,
    )
    world.Barrier()
    os._exit(0)  # no MPI_Finalize (ulfm.py)


if __name__ == "__main__":
    main()
