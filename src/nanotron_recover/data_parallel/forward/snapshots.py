"""Snapshots in node memory: every rank's full training state after a committed step, kept in the
node's shared memory so that a job relaunched after a node loss starts from it without disk.

Every data-parallel replica holds the same model and optimizer state, so the state a lost node held
always exists on another node while one replica of each ``(pp, tp)`` coordinate survives. After the
commit of every ``recover.snapshot.interval``-th step each rank exports its state (what a re-join
transfers: parameters, fp32 masters, AdamW moments and step counts, RNG; ``engines/state.py``) and
writes it under ``recover.snapshot.dir`` (default ``/dev/shm/nanotron-recover``), on a thread, off
the critical path, while the next step computes: the copy must be finished before the next
optimizer step changes the state (:meth:`NodeSnapshots.wait_exported`).

One copy per byte: the export hands over the live tensors (``export_state(copy=False)``) and the
thread copies them straight into the slot's ``state.bin``, mapped into memory once and kept mapped
across steps, so its pages are allocated once per run, not per step. (An export into fresh CPU
tensors, then a ``write`` of them, cost 6x more per step on a 2-core machine: new pages twice.)

Layout: ``<dir>/<run_id>/c<coordinate>/r<replica>/slot<0|1>/`` with ``state.bin`` (the tensors'
bytes in layout order), ``meta.pkl`` (layout, engine meta) and ``published.json`` (step, bytes,
generation, layout id), written last with an atomic rename. A write goes into the older slot and
first removes that slot's ``published.json``: a torn write (the node loses power, the process is
killed) never destroys the newest published snapshot, and a slot without ``published.json`` is
never read. A snapshot is read only if its run id and layout id are this run's.

Room is reserved before a byte is written. A slot is a file mapped into memory; a write through a
mapping into a file system that has run out of pages (a container's 64 MiB ``/dev/shm``, a node's
tmpfs filled by another job) is not an error the write can return: the kernel sends SIGBUS and the
rank dies. So the slot's pages are allocated first (``posix_fallocate``, after a ``statvfs`` check
of the free space); a slot that does not fit is a skipped snapshot (:class:`SnapshotSkipped`, with
the space needed and free), never a dead rank, and the job goes on with its older snapshots and the
disk checkpoint.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import pickle
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...engines.state import EngineState, dtype_from_name

PUBLISHED = "published.json"


class SnapshotSkipped(Exception):
    """A snapshot not written because its slot does not fit (no room, or over ``max_mb``): the
    job goes on, relaunches use an older snapshot or the disk checkpoint."""


@dataclass(frozen=True)
class Published:
    """A complete snapshot found on this node."""

    path: Path
    step: int
    nbytes: int
    replica: int
    generation: int


class NodeSnapshots:
    """This rank's snapshots: written by :meth:`write`, found by :meth:`available`, read by :meth:`load`.

    ``coordinate`` is the rank's place inside a replica (its local rank), the same on every replica;
    ``replica`` the replica that writes (several replicas on one node write side by side, and a
    relaunched rank may read any replica's snapshot of its coordinate)."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        layout_id: str,
        coordinate: int,
        replica: int,
        generation: int = 0,
        max_bytes: int | None = None,
        may_publish: Any = None,
    ) -> None:
        self.run_root = Path(root) / run_id
        self.layout_id, self.coordinate, self.replica = layout_id, coordinate, replica
        self.generation, self.max_bytes = generation, max_bytes
        # Asked right before a snapshot is published: False for a process fenced off the job.
        self.may_publish = may_publish or (lambda: True)
        self._thread: threading.Thread | None = None
        self._exported = threading.Event()
        self._exported.set()
        self.error: BaseException | None = None  # of the last write: a snapshot is best effort
        self.written: list[int] = []  # steps published by this process, in order
        self._maps: dict[Path, mmap.mmap] = {}  # state.bin of each slot, mapped once

    # -- writing -----------------------------------------------------------------------------
    def _mine(self) -> Path:
        return self.run_root / f"c{self.coordinate}" / f"r{self.replica}"

    def write(self, step: int, export: Any, asynchronous: bool = True) -> None:
        """Export (``export()`` -> :class:`EngineState`) and publish the state of committed ``step``.

        With ``asynchronous`` both run on a thread; call :meth:`wait_exported` before the state
        changes (the next optimizer step). The previous write is finished first."""
        self.wait()
        self.error = None
        self._exported.clear()
        if not asynchronous:
            self._export_and_publish(step, export)
            return
        self._thread = threading.Thread(
            target=self._export_and_publish, args=(step, export), name="node-snapshot", daemon=True
        )
        self._thread.start()

    def wait_exported(self) -> None:
        """Block until the state being snapshotted has been copied (the live state may change)."""
        self._exported.wait()

    def wait(self) -> None:
        """Block until the write in flight is published (or failed: :attr:`error`)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _export_and_publish(self, step: int, export: Any) -> None:
        try:
            try:
                # The export may be the live tensors: copied into the slot before the event is set.
                state: EngineState = export()
                target = self._copy_into_slot(state)
            finally:
                self._exported.set()
            self._publish(target, step, state)
            self.written.append(step)
        except BaseException as error:  # noqa: BLE001 - reported through .error, never raised in a thread
            self.error = error

    def _copy_into_slot(self, state: EngineState) -> Path:
        """The state's bytes into the older slot's ``state.bin`` (its ``published.json`` removed
        first); the slot."""
        nbytes = state.nbytes()
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise SnapshotSkipped(
                f"node snapshot skipped: {nbytes / 2**20:.1f} MiB exceeds recover.snapshot.max_mb "
                f"({self.max_bytes / 2**20:.1f} MiB)"
            )
        mine = self._mine()
        slots = [mine / "slot0", mine / "slot1"]
        steps = [_read_published(s) for s in slots]
        # The older (or unpublished) slot takes the new snapshot; the newest stays intact meanwhile.
        target = (
            slots[0]
            if steps[0] is None or (steps[1] is not None and steps[0]["step"] <= steps[1]["step"])
            else slots[1]
        )
        target.mkdir(parents=True, exist_ok=True)
        (target / PUBLISHED).unlink(missing_ok=True)
        mapped = self._mapped(target / "state.bin", nbytes)
        offset = 0
        for tensor in state.tensors.values():
            n = tensor.numel() * tensor.element_size()
            if n:
                dst = torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=offset)
                dst.copy_(_byte_view(tensor))
            offset += n
        return target

    def _mapped(self, path: Path, nbytes: int) -> mmap.mmap:
        """``path`` (created or resized to ``nbytes``) mapped shared into memory, kept for the next
        write into the same slot."""
        mapped = self._maps.get(path)
        if mapped is not None and len(mapped) == nbytes and path.exists():
            return mapped
        if mapped is not None:
            mapped.close()
            del self._maps[path]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _reserve(fd, path, nbytes)
            mapped = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._maps[path] = mapped
        return mapped

    def _publish(self, target: Path, step: int, state: EngineState) -> None:
        """The slot's metadata, then its ``published.json`` by an atomic rename, unless fenced."""
        nbytes = state.nbytes()
        with open(target / "meta.pkl", "wb") as f:
            pickle.dump({"layout": state.layout(), "meta": state.meta}, f)
        record = {
            "step": step,
            "nbytes": nbytes,
            "replica": self.replica,
            "generation": self.generation,
            "layout_id": self.layout_id,
        }
        if not self.may_publish():
            raise PermissionError("not publishing a snapshot: this process no longer belongs to the job")
        tmp = target / f"{PUBLISHED}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, target / PUBLISHED)

    # -- reading -----------------------------------------------------------------------------
    def available(self) -> list[Published]:
        """Every complete snapshot of this coordinate on this node, any replica's, newest first."""
        found = []
        for slot in sorted(self.run_root.glob(f"c{self.coordinate}/r*/slot*")):
            record = _read_published(slot)
            if record is None or record.get("layout_id") != self.layout_id:
                continue
            if (slot / "state.bin").stat().st_size != record["nbytes"]:
                continue
            found.append(
                Published(
                    slot,
                    int(record["step"]),
                    int(record["nbytes"]),
                    int(record["replica"]),
                    int(record["generation"]),
                )
            )
        return sorted(found, key=lambda p: -p.step)

    def load(self, step: int) -> EngineState:
        """The state of ``step`` from this node's snapshot (:meth:`available` must list it)."""
        snapshot = next((p for p in self.available() if p.step == step), None)
        if snapshot is None:
            raise FileNotFoundError(
                f"no snapshot of step {step} for coordinate {self.coordinate} under {self.run_root}"
            )
        with open(snapshot.path / "meta.pkl", "rb") as f:
            saved = pickle.load(f)
        data = (snapshot.path / "state.bin").read_bytes()
        tensors, offset = {}, 0
        for name, shape, dtype in saved["layout"]:
            t = torch.empty(tuple(shape), dtype=dtype_from_name(dtype))
            n = t.numel() * t.element_size()
            if n:
                t.view(-1).view(torch.uint8).copy_(
                    torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
                )
            tensors[name] = t
            offset += n
        return EngineState(tensors, saved["meta"])

    def remove_run(self) -> None:
        """Remove this run's snapshots on this node (the run completed or was cancelled)."""
        self.wait()
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        shutil.rmtree(self.run_root, ignore_errors=True)


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Size the open slot file ``fd`` to ``nbytes`` with every page allocated, or raise
    :class:`SnapshotSkipped` (the file emptied again, so a failed reservation holds no memory).

    A sparse file (``ftruncate`` alone) mapped and written into a full tmpfs kills the writer with
    SIGBUS; pages reserved here can always be written."""
    held = os.fstat(fd).st_blocks * 512
    vfs = os.statvfs(path.parent)
    free = vfs.f_bavail * vfs.f_frsize
    if nbytes - held > free:
        os.ftruncate(fd, 0)
        raise SnapshotSkipped(
            f"node snapshot skipped: it needs {nbytes / 2**20:.1f} MiB and {path.parent} has "
            f"{(free + held) / 2**20:.1f} MiB free (raise the size of that file system, point "
            "recover.snapshot.dir elsewhere, or set recover.snapshot.interval: 0)",
        )
    os.ftruncate(fd, nbytes)
    if not nbytes:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a file system that cannot reserve: the free-space check above is all there is
        os.ftruncate(fd, 0)
        raise SnapshotSkipped(
            f"node snapshot skipped: could not reserve {nbytes / 2**20:.1f} MiB in {path.parent} "
            f"({os.strerror(error.errno or 0)})",
        ) from error


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor on its own device (a view when it is contiguous)."""
    t = tensor.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def _read_published(slot: Path) -> dict | None:
    try:
        return json.loads((slot / PUBLISHED).read_text())
    except (OSError, ValueError):
        return None
