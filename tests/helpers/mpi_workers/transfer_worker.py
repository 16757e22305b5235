"""MPI worker for tests/integration/data_parallel/forward/test_state_transfer.py: one state transfer.

Run on 3 ranks under mpirun, one per replica of a DP communicator: replica 0 is the donor, 1 and 2
re-join. The donor's state mixes a tensor of several TCP eager limits (cut into parts on the
wire), one of exactly one part, a bfloat16 one and an empty one. Every rank writes
``<out>/rank<r>.json``: whether the transfer succeeded and whether what it received equals the
donor's state, byte for byte.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nanotron_recover.atomic_file import write_text_atomically
from nanotron_recover.data_parallel.forward.state_transfer import transfer_state
from nanotron_recover.engines.state import EngineState
from nanotron_recover.ft.transport import eager_bytes
from nanotron_recover.ft.ulfm import MPI


def donor_state() -> EngineState:
    g = torch.Generator().manual_seed(7)
    big = 2 * eager_bytes() // 4 + 12345  # three parts, the last one partial
    return EngineState(
        {
            "big": torch.randn(big, generator=g),
            "one_part": torch.randn(eager_bytes() // 8, generator=g, dtype=torch.float64),
            "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0),
        },
        {"step": 42},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    result = transfer_state(comm, rank, donors=[0], rejoining=[1, 2], export=donor_state)
    record = {"rank": rank, "ok": result.ok, "bytes": result.state_bytes}
    if result.received is not None:
        want = donor_state()
        got = result.received
        record["meta"] = got.meta
        record["names"] = list(got.tensors)
        record["equal"] = all(
            torch.equal(got.tensors[n].view(torch.uint8), want.tensors[n].view(torch.uint8))
            for n in want.tensors
        )
    write_text_atomically(args.out / f"rank{rank}.json", json.dumps(record))
    comm.Barrier()


if __name__ == "__main__":
    main()
