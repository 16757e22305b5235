"""Tiny CPU gloo worlds for tests of the parallel building blocks.

``run_world(worker, n, tmp_path)`` forks ``n`` processes (torch.multiprocessing, start method
"fork": the children start in milliseconds because torch is already imported), joins them in one
gloo world through a FileStore under ``tmp_path`` and calls ``worker(rank, n, *args)`` on each with
one torch thread. Every rank's return value comes back to the test (``torch.save``/``torch.load``
through a file), so the assertions run in the test process. A rank that raises writes its traceback
next to the store; as soon as any rank exits non-zero, or the deadline passes, the remaining ranks
are killed (only the processes started here, by handle) and the test fails with every traceback.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds a collective may wait for a peer before gloo gives up: a deadlock fails fast.
COLLECTIVE_TIMEOUT_S = 30.0


def _entry(
    worker: Callable[..., Any], rank: int, world_size: int, folder: str, args: tuple[Any, ...]
) -> None:
    out = Path(folder)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(str(out / "store"), world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        result = worker(rank, world_size, *args)
        dist.barrier()  # nobody tears the world down while a peer still talks to it
        dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        os._exit(1)


def run_world(
    worker: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    args: tuple[Any, ...] = (),
    timeout_s: float = 60.0,
) -> list[Any]:
    """``[worker(0, n, *args), ..., worker(n-1, n, *args)]``, each computed on its own rank."""
    folder = Path(tmp_path) / f"world-{time.monotonic_ns()}"
    folder.mkdir(parents=True)
    context = mp.get_context("fork")
    procs = [
        context.Process(target=_entry, args=(worker, rank, world_size, str(folder), args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    problem = None
    try:
        while problem is None:
            running = [p for p in procs if p.exitcode is None]
            failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                problem = f"rank(s) {failed} exited with {[procs[r].exitcode for r in failed]}"
            elif not running:
                break
            elif time.monotonic() > deadline:
                problem = f"the world of {world_size} did not finish within {timeout_s:.0f}s"
            else:
                wait([p.sentinel for p in running], timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    if problem is not None:
        stories = "\n".join(f"--- {f.name}\n{f.read_text()}" for f in sorted(folder.glob("rank*.error")))
        pytest.fail(f"{problem}\n{stories or '(no traceback written)'}")
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
