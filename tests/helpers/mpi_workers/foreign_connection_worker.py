"""MPI worker for tests/integration/ft/test_rank_fixes.py: a connection from another launch.

Run under ``mpirun --mca btl tcp,self`` on 2 ranks, MPI imported through ``nanotron_recover.ft.ulfm``
(which loads the rank fixes when the launch names them). Rank 1 writes its TCP transport's listening
ports to ``<out>/ports``; rank 0 dials each and sends the transport's handshake (process name, then
the magic string, ``mca_btl_tcp_endpoint_hs_msg_t`` in opal/mca/btl/tcp/btl_tcp_endpoint.h) with
the name of a process of another job family, as a process of an earlier launch would. Rank 1 makes
progress meanwhile, then both reduce over ``MPI_COMM_WORLD`` and write ``<out>/rank<r>.txt``: the
sum and how many connections they refused.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import time
from pathlib import Path


def listening_ports() -> list[int]:
    """This process's listening TCP ports (IPv4), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.append(int(fields[1].split(":")[1], 16))
    return ports


def main() -> None:
    out = Path(sys.argv[1])
    from nanotron_recover.ft import rank_fixes
    from nanotron_recover.ft.ulfm import MPI

    world = MPI.COMM_WORLD
    world.Barrier()
    if world.Get_rank() == 1:
        (out / "ports").write_text(" ".join(map(str, listening_ports())))
    world.Barrier()
    if world.Get_rank() == 0:
        pal = ctypes.CDLL("libopen-pal.so.80", mode=os.RTLD_NOLOAD)
        my_job = (ctypes.c_uint32 * 2).in_dll(pal, "opal_process_info")[0]  # my_name comes first
        foreign = (my_job ^ 0x5A5A0000) & 0xFFFFFFFF  # another job family (the upper 16 bits)
        for port in map(int, (out / "ports").read_text().split()):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(struct.pack("=II", foreign, 1) + b"OPAL-TCP-BTL".ljust(16, b"\0"))
                s.settimeout(3)
                try:
                    s.recv(64)
                except TimeoutError:
                    pass
    deadline = time.time() + 4
    while time.time() < deadline:
        world.Iprobe()  # progress, so that rank 1 handles the connection
        time.sleep(0.05)
    total = world.allreduce(1)
    (out / f"rank{world.Get_rank()}.txt").write_text(f"allreduce {total} refused {rank_fixes.refused()}")
    world.Barrier()
    os._exit(0)  # no MPI_Finalize (ulfm.py)


if __name__ == "__main__":
    main()
