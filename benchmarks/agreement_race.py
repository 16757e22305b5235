"""How often Open MPI's agreement returns a wrong value while another thread makes progress.

Runs ``tests/helpers/mpi_workers/agreement_race_worker.py`` on 3 ranks (with two busy processes
beside them), the failure watch polling every ``--poll-s``: ``bare``, the watch without its side of
the lock (it polls at any time); ``fixed``, the watch as it is, keeping out while the main thread is
inside an agreement (``nanotron_recover.ft.ulfm.agreement``). Every agreement contributes ``0x1FFF``
on every rank, so any other result is wrong. See docs/architecture.md, section 10.

    python benchmarks/agreement_race.py --agreements 20000 --runs 3

Writes ``benchmarks/results/agreement_race.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import describe, machine_info, markdown_table, write_report

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "mpi_workers" / "agreement_race_worker.py"


def run(mode: str, agreements: int, poll_s: float, timeout_s: float) -> dict:
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun (Open MPI with ULFM) not found")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm", "--bind-to", "none"]
    cmd += ["--mca", "coll", "^han,cuda", "--mca", "btl", "tcp,self", "-n", "3", sys.executable, str(WORKER)]
    cmd += [mode, "--agreements", str(agreements), "--poll-s", str(poll_s), "--hog-s", str(timeout_s)]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
    )
    ranks = [json.loads(line[line.index("{") :]) for line in done.stdout.splitlines() if '"wrong"' in line]
    if len(ranks) != 3:
        raise SystemExit(
            f"{mode}: {len(ranks)} ranks reported (exit {done.returncode}): {done.stderr[-2000:]}"
        )
    return {"seconds": time.perf_counter() - t0, "ranks": sorted(ranks, key=lambda r: r["rank"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agreements", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--poll-s", type=float, default=0.0001)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    results: dict = {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)}, "modes": {}}
    for mode in ("bare", "fixed"):
        results["modes"][mode] = [
            run(mode, args.agreements, args.poll_s, args.timeout_s) for _ in range(args.runs)
        ]
    lines = [
        "# Wrong agreements while another thread makes MPI progress",
        "",
        describe(results["machine"]),
        "",
    ]
    lines += [
        f"`python benchmarks/agreement_race.py --agreements {args.agreements} --runs {args.runs}`: "
        "3 ranks and two busy processes, the failure watch polling `MPI_Test` every "
        f"{args.poll_s * 1000:g} ms; every agreement should return `0x1fff`.",
        "",
    ]
    rows = []
    for mode, what in (
        ("bare", "polls at any time"),
        ("fixed", "keeps out during agreements"),
    ):
        for i, r in enumerate(results["modes"][mode]):
            wrong = [x["wrong"] for x in r["ranks"]]
            first = next((f"`{v:#x}`" for x in r["ranks"] for _, v in x["first"]), "-")
            rows.append([mode, what, i + 1, " / ".join(map(str, wrong)), first, f"{r['seconds']:.0f}"])
    lines += markdown_table(
        ["mode", "failure watch", "run", "wrong agreements (rank 0 / 1 / 2)", "a wrong value", "seconds"],
        rows,
    )
    write_report(args.out, "agreement_race", results, lines)


if __name__ == "__main__":
    main()
