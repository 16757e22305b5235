"""Snapshots in node memory: every rank's full training state after a committed step, kept in the
node's shared memory so that a job relaunched after a node loss starts from it without disk.

Every data-parallel replica holds the same model and optimizer state, so the state a lost node held
always exists on another node while one replica of each ``(pp, tp)`` coordinate survives. After the
commit of every ``recover.snapshot.interval``-th step each rank exports its state (what a re-join
transfers: parameters, fp32 masters, AdamW moments and step counts, RNG; ``engines/state.py``) and
writes it under ``recover.snapshot.dir`` (default ``/dev/shm/nanotron-recover-{uid}``), on a thread,
off the critical path, while the next step computes: the copy must be finished before the next
optimizer step changes the state (:meth:`NodeSnapshots.wait_exported`).

One copy per byte: the export hands over the live tensors (``export_state(copy=False)``) and the
thread copies them straight into the slot's ``state.bin``, mapped into memory once and kept mapped
across steps, so its pages are allocated once per run, not per step. (An export into fresh CPU
tensors, then a ``write`` of them, cost 6x more per step on a 2-core machine: new pages twice.)
A restore maps ``state.bin`` read-only and copies each tensor once out of the mapping: no copy of
the whole file is ever held besides the state itself. On CUDA the state first goes device to host on
a side stream into a pinned buffer kept across steps, ordered after the commit by an event, and the
next optimizer step's kernels after the copy (:mod:`.snapshot_copy`); the slot is written from that
buffer once the copy is done. On CPU there is no such buffer: the live tensors go into the slot.

Private to its user. ``/dev/shm`` is shared by every user of a node, so the folder (``{uid}`` in its
name is replaced by the user's id) is created ``0700`` and checked before every use
(:func:`private_root`): a real directory, not a symlink, owned by this user, mode ``0700`` (fixed
when it is ours). A folder that fails the check is refused in one line: the rank's snapshots are
skipped with a warning (:class:`SnapshotDirRefused`), never written into another user's folder, and
the rank trains on. Every file is opened with ``O_NOFOLLOW``, and nothing read back is code: the
metadata is JSON (:func:`encode_meta`), never pickle.

Layout: ``<dir>/<run_id>/c<coordinate>/r<replica>/slot<0|1>/`` with ``state.bin`` (the tensors'
bytes in layout order), ``meta.json`` (layout, engine meta) and ``published.json`` (step, bytes,
generation, layout id), written last with an atomic rename. A write first removes its slot's
``published.json``: a torn write (the node loses power, the process is killed) never destroys the
newest published snapshot, and a slot without ``published.json`` is never read. The slot written is
the older by ``(generation, step)``: after a relaunch the previous generation's snapshots (which may
have a higher step than the steps being redone) are replaced first, and the newest snapshot of this
generation is never the one overwritten. A snapshot is read only if its run id and layout id are
this run's and its metadata parses and matches its size.

Room is reserved before a byte is written. A slot is a file mapped into memory; a write through a
mapping into a file system that has run out of pages (a container's 64 MiB ``/dev/shm``, a node's
tmpfs filled by another job) is not an error the write can return: the kernel sends SIGBUS and the
rank dies. So the slot's pages are allocated first (``posix_fallocate``, after a ``statvfs`` check
of the free space); a slot that does not fit is a skipped snapshot (:class:`SnapshotSkipped`, with
the space needed and free), never a dead rank, and the job goes on with its older snapshots and the
disk checkpoint.

Half the folder by default. Without ``recover.snapshot.max_mb`` a snapshot is skipped the same way
when the two slots of every rank of the node (this rank's state times :data:`SLOTS` times the ranks
on the node, ``OMPI_COMM_WORLD_LOCAL_SIZE``) would take more than :data:`DEFAULT_SHARE` of the
folder's room, measured once, at this process's first snapshot: the free space plus what this run's
folder already holds there (an earlier generation's slots, or another rank's of this node that got
there first, are reused, not added). The node's shared memory is also the memory its processes run
in: snapshots that would fill it leave the ranks to the OOM killer.

Fenced first. A process that no longer belongs to the job (an older generation of a relaunched job:
``may_publish`` answers False) touches no slot: it is asked before a slot's ``published.json`` is
removed (:class:`SnapshotFenced`, a skipped snapshot) and again before one is published.

Removed when the job ends for good. A snapshot is tens of GB of a node's RAM that outlives every
process of the job, so :func:`remove_run_snapshots` removes one run's folder on this host (from the
run id alone, without a live :class:`NodeSnapshots`; ``nanotron-recover snapshots clean`` and the
Slurm job script's last step call it on every node), only inside the private folder, never through
a symlink. A rank removes them itself when its job completes or stops without a relaunch
(:meth:`NodeSnapshots.remove_run`, called by ``mode.py``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...engines.state import EngineState, dtype_from_name, dtype_name
from .snapshot_copy import DeviceCopy, StagedCopy, byte_view

# The folder's names, as this module always offered them.
from .snapshot_folder import (  # noqa: F401
    Removed,
    SnapshotDirRefused,
    SnapshotFenced,
    SnapshotSkipped,
    existing_private_root,
    held,
    private_root,
    remove_run_snapshots,
    run_folder,
    snapshot_dir,
)

PUBLISHED = "published.json"
SLOTS = 2  # slot0 and slot1 of each rank: a write goes into the older one
# Without recover.snapshot.max_mb the snapshots of a node may take at most this share of the
# folder's room (free space and what the run holds there) at the first snapshot: /dev/shm is the
# node's memory, and the other half is left to the ranks and to the pinned staging buffers on CUDA.
DEFAULT_SHARE = 0.5
META = "meta.json"
STATE = "state.bin"
# Opened files never follow a symlink (a link planted in a shared folder would redirect the write).
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def node_ranks(env: Any = None) -> int:
    """The ranks of this job on this node (``OMPI_COMM_WORLD_LOCAL_SIZE`` under ``mpirun``,
    ``LOCAL_WORLD_SIZE`` under torchrun; 1 when neither is set)."""
    env = os.environ if env is None else env
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        try:
            value = int(env.get(name, ""))
        except ValueError:
            continue
        if value > 0:
            return value
    return 1


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

    ``root`` is ``recover.snapshot.dir`` (``{uid}`` replaced; checked by :func:`private_root` before
    each use). ``coordinate`` is the rank's place inside a replica (its local rank), the same on
    every replica; ``replica`` the replica that writes (several replicas on one node write side by
    side, and a relaunched rank may read any replica's snapshot of its coordinate). ``max_bytes``
    caps one slot (``recover.snapshot.max_mb``); None applies the default of :data:`DEFAULT_SHARE`
    of the folder's room over the ``ranks_per_node`` ranks of the node (None: :func:`node_ranks`)."""

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        layout_id: str,
        coordinate: int,
        replica: int,
        generation: int = 0,
        max_bytes: int | None = None,
        may_publish: Any = None,
        ranks_per_node: int | None = None,
    ) -> None:
        self.root = snapshot_dir(root)
        self.run_root = self.root / run_id
        self.layout_id, self.coordinate, self.replica = layout_id, coordinate, replica
        self.generation, self.max_bytes = generation, max_bytes
        # Asked before a slot is touched and again right before it is published (the removal of
        # the run's snapshots asks it too): False for a process fenced off the job.
        self.may_publish = may_publish or (lambda: True)
        self._thread: threading.Thread | None = None
        self._exported = threading.Event()
        self._exported.set()
        self.error: BaseException | None = None  # of the last write: a snapshot is best effort
        self.refused: SnapshotDirRefused | None = None  # the folder, when the last check refused it
        # Steps published by this process: how many and the last. A count, not a list of steps: a
        # snapshot is published every step, and a list grew for the life of the process.
        self.published = 0
        self.last_published: int | None = None
        self._maps: dict[Path, mmap.mmap] = {}  # state.bin of each slot, mapped once
        self.ranks_per_node = node_ranks() if ranks_per_node is None else max(1, ranks_per_node)
        # Without max_bytes: (the cap, its reason), decided at the first snapshot (_default_cap).
        self.default_cap: tuple[int, str] | None = None
        self.copier: DeviceCopy | None = None  # CUDA: the side stream and pinned buffer, made lazily
        self.last_copy: StagedCopy | None = None  # CUDA: the device-to-host copy of the last write

    def _checked_root(self) -> Path:
        """The folder, checked (:func:`private_root`); raises :class:`SnapshotDirRefused`."""
        try:
            root = private_root(self.root)
        except SnapshotDirRefused as refused:
            self.refused = refused
            raise
        self.refused = None
        return root

    # -- writing -----------------------------------------------------------------------------
    def _mine(self) -> Path:
        return self.run_root / f"c{self.coordinate}" / f"r{self.replica}"

    def write(
        self, step: int, export: Any, asynchronous: bool = True, device: torch.device | None = None
    ) -> None:
        """Export (``export()`` -> :class:`EngineState`) and publish the state of committed ``step``.

        With ``asynchronous`` both run on a thread; call :meth:`wait_exported` before the state
        changes (the next optimizer step). The previous write is finished first. On a CUDA
        ``device`` (the rank's) the state is copied on a side stream after an event recorded here,
        on the caller's compute stream (:mod:`.snapshot_copy`); call this after the optimizer step."""
        self.wait()
        self.error = None
        self.last_copy = None
        self._exported.clear()
        copier = self._copier_for(device)
        committed = copier.committed() if copier is not None else None
        if not asynchronous:
            self._export_and_publish(step, export, copier, committed)
            return
        self._thread = threading.Thread(
            target=self._export_and_publish,
            args=(step, export, copier, committed),
            name="node-snapshot",
            daemon=True,
        )
        self._thread.start()

    def _copier_for(self, device: torch.device | None) -> DeviceCopy | None:
        """The rank's :class:`DeviceCopy` on a CUDA ``device`` (made at its first snapshot), else None."""
        if device is None or device.type != "cuda":
            return None
        if self.copier is None or (device.index is not None and self.copier.device != device):
            self.copier = DeviceCopy(device)
        return self.copier

    def wait_exported(self) -> None:
        """Return once the live state may change (the next optimizer step): on CPU when the thread
        has copied it into the slot; on CUDA when its copies are queued, the compute stream then
        ordered after them (``wait_event``: the kernels that follow, the optimizer's, wait on the
        device, this thread does not)."""
        self._exported.wait()
        staged, copier = self.last_copy, self.copier
        if staged is not None and copier is not None:
            copier.order_compute_after(staged)

    def wait(self) -> None:
        """Block until the write in flight is published (or failed: :attr:`error`)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _export_and_publish(
        self, step: int, export: Any, copier: DeviceCopy | None = None, committed: Any = None
    ) -> None:
        try:
            staged = None
            try:
                # The export may be the live tensors: copied into the slot (CPU), or their copies
                # queued on the side stream (CUDA), before the event is set.
                with copier.on_device() if copier is not None else contextlib.nullcontext():
                    state: EngineState = export()
                    target, mapped = self._prepare_slot(state)
                    tensors = list(state.tensors.values())
                    if copier is None:
                        _fill(mapped, tensors)
                    else:
                        staged = copier.stage(tensors, state.layout(), state.nbytes(), committed)
                        self.last_copy = staged
            finally:
                self._exported.set()
            if staged is not None:
                staged.wait()  # the slot is written from the pinned buffer once the copy landed
                if staged.nbytes:
                    torch.frombuffer(mapped, dtype=torch.uint8, count=staged.nbytes).copy_(staged.buffer)
            self._publish(target, step, state)
            self.published += 1
            self.last_published = step
        except BaseException as error:  # noqa: BLE001 - reported through .error, never raised in a thread
            self.error = error

    def _target_slot(self, slots: list[Path]) -> Path:
        """The slot a new snapshot goes into: an unpublished one (or another layout's), else the
        older by ``(generation, step)``. After a relaunch the steps are redone from an older one:
        ordered by step alone, a newer step of the previous generation would stay in one slot and
        every write would replace the other, the newest good snapshot."""

        def order(slot: Path) -> tuple[int, int, int]:
            record = _read_published(slot)
            if record is None or record.get("layout_id") != self.layout_id:
                return (0, 0, 0)
            try:
                return (1, int(record["generation"]), int(record["step"]))
            except (KeyError, TypeError, ValueError):
                return (0, 0, 0)

        return min(slots, key=order)  # on a tie slot0, the first

    def _prepare_slot(self, state: EngineState) -> tuple[Path, mmap.mmap]:
        """The older slot, its ``published.json`` removed and its ``state.bin`` mapped with room
        for the state's bytes; the slot and the mapping. Nothing is touched by a process fenced off
        the job (:class:`SnapshotFenced`): the slot it would take may hold the newest snapshot of
        the generation that replaced it."""
        nbytes = state.nbytes()
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise SnapshotSkipped(
                f"node snapshot skipped: {nbytes / 2**20:.1f} MiB exceeds recover.snapshot.max_mb "
                f"({self.max_bytes / 2**20:.1f} MiB)"
            )
        if not self.may_publish():
            raise SnapshotFenced(
                "node snapshot skipped: this process no longer belongs to the job (a newer generation runs)"
            )
        root = self._checked_root()
        if self.max_bytes is None:
            cap, why = self._default_cap(root)
            if nbytes > cap:
                raise SnapshotSkipped(
                    f"node snapshot skipped: {SLOTS} slots of {nbytes / 2**20:.1f} MiB x "
                    f"{self.ranks_per_node} ranks of this node need "
                    f"{SLOTS * self.ranks_per_node * nbytes / 2**20:.1f} MiB, {why} (set "
                    "recover.snapshot.max_mb to choose the cap, or recover.snapshot.interval: 0)"
                )
        mine = self._mine()
        target = self._target_slot([mine / "slot0", mine / "slot1"])
        target.mkdir(parents=True, exist_ok=True, mode=0o700)
        (target / PUBLISHED).unlink(missing_ok=True)
        return target, self._mapped(target / STATE, nbytes)

    def _default_cap(self, root: Path) -> tuple[int, str]:
        """Without ``max_bytes``: the largest slot that keeps the node's snapshots within
        :data:`DEFAULT_SHARE` of the folder's room, and the reason in words; decided at the first
        snapshot and kept (a later skip says the same, so it is warned once)."""
        if self.default_cap is None:
            vfs = os.statvfs(root)
            free = vfs.f_bavail * vfs.f_frsize
            held_bytes = held(self.run_root)[1] if self.run_root.is_dir() else 0
            room = free + held_bytes
            share = int(DEFAULT_SHARE * room)
            cap = share // (SLOTS * self.ranks_per_node)
            why = (
                f"more than {DEFAULT_SHARE:.0%} of the {room / 2**20:.1f} MiB free in {root} "
                f"({share / 2**20:.1f} MiB) at the first snapshot"
            )
            self.default_cap = (cap, why)
        return self.default_cap

    def _mapped(self, path: Path, nbytes: int) -> mmap.mmap:
        """``path`` (created or resized to ``nbytes``) mapped shared into memory, kept for the next
        write into the same slot."""
        mapped = self._maps.get(path)
        if mapped is not None and len(mapped) == nbytes and path.exists():
            return mapped
        if mapped is not None:
            mapped.close()
            del self._maps[path]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
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
        meta = {"layout": [list(e) for e in state.layout()], "meta": encode_meta(state.meta)}
        _write_private(target / META, json.dumps(meta).encode())
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
        _write_private(tmp, json.dumps(record).encode())
        os.replace(tmp, target / PUBLISHED)

    # -- reading -----------------------------------------------------------------------------
    def available(self) -> list[Published]:
        """Every complete snapshot of this coordinate on this node, any replica's, newest first.

        Listed only when its ``published.json`` is this layout's, its metadata parses and its
        ``state.bin`` is a regular file of the published size; none when the folder is refused
        (:attr:`refused` says why)."""
        try:
            self._checked_root()
        except SnapshotDirRefused:
            return []
        found = []
        for slot in sorted(self.run_root.glob(f"c{self.coordinate}/r*/slot*")):
            record = _read_published(slot)
            if record is None or record.get("layout_id") != self.layout_id:
                continue
            try:
                snapshot = Published(
                    slot,
                    int(record["step"]),
                    int(record["nbytes"]),
                    int(record["replica"]),
                    int(record["generation"]),
                )
                st = os.lstat(slot / STATE)
                if not stat.S_ISREG(st.st_mode) or st.st_size != snapshot.nbytes:
                    continue
                _read_meta(slot, snapshot.nbytes)
            except (OSError, KeyError, TypeError, ValueError):
                continue  # gone since it was listed, or not a snapshot this code wrote
            found.append(snapshot)
        return sorted(found, key=lambda p: -p.step)

    def load(self, step: int) -> EngineState:
        """The state of ``step`` from this node's snapshot (:meth:`available` must list it).

        ``state.bin`` is mapped read-only and each tensor copied once out of the mapping. Raises
        ``FileNotFoundError`` when no such snapshot is (any longer) here, ``ValueError`` when its
        files do not agree."""
        snapshot = next((p for p in self.available() if p.step == step), None)
        if snapshot is None:
            raise FileNotFoundError(
                f"no snapshot of step {step} for coordinate {self.coordinate} under {self.run_root}"
                + (f" ({self.refused})" if self.refused is not None else "")
            )
        layout, meta = _read_meta(snapshot.path, snapshot.nbytes)
        state = EngineState.empty_like(layout, meta)
        fd = os.open(snapshot.path / STATE, os.O_RDONLY | _NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size != snapshot.nbytes:
                raise ValueError(f"{snapshot.path / STATE} holds {size} bytes, {snapshot.nbytes} published")
            if not size:
                return state
            # A private copy-on-write mapping: writable for torch.frombuffer, never written back.
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            offset = 0
            for t in state.tensors.values():
                n = t.numel() * t.element_size()
                if n:
                    src = torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=offset)
                    t.view(-1).view(torch.uint8).copy_(src)
                    del src  # the mapping can only be closed once no tensor views it
                offset += n
        finally:
            try:
                mapped.close()
            except BufferError:  # a view still held by an exception's frame: unmapped when freed
                pass
        return state

    def remove_run(self) -> Removed | None:
        """Remove this run's snapshots on this node (the job ended for good: completed, or stopped
        without a relaunch): this rank's slots and every other one of the run here, stale slots of
        an earlier generation's replicas included (:func:`remove_run_snapshots`). Every rank of the
        node calls it after its own last write, so the last one leaves nothing. None, and nothing
        removed, for a process fenced off the job (a newer generation may be using them) or a
        folder that is not ours (:attr:`refused`)."""
        self.wait()
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        if not self.may_publish():
            return None
        try:
            return remove_run_snapshots(self.root, self.run_root.name)
        except SnapshotDirRefused as refused:  # never remove anything through a folder not ours
            self.refused = refused
            return None


# -- metadata as JSON ------------------------------------------------------------------------------
# The engine meta holds plain values, tuples (AdamW's betas), bytes (RNG states) and possibly small
# tensors. JSON objects hold them; a value JSON has no form for is an object with one "$" key. A
# dict whose keys are not all plain strings is a "$dict" of pairs, so a "$" key never means two
# things.


def encode_meta(value: Any) -> Any:
    """``value`` as JSON-able data, read back by :func:`decode_meta` (never by pickle)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$tuple": [encode_meta(v) for v in value]}
    if isinstance(value, list):
        return [encode_meta(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_meta(v) for k, v in value.items()}
        return {"$dict": [[encode_meta(k), encode_meta(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        return {
            "$tensor": {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data": base64.b64encode(_byte_view(t).numpy().tobytes()).decode("ascii"),
            }
        }
    raise TypeError(f"a node snapshot cannot hold {type(value).__name__} in the engine meta")


def decode_meta(value: Any) -> Any:
    """Inverse of :func:`encode_meta`; ``ValueError`` on anything it does not write."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_meta(v) for v in value]
    if not isinstance(value, dict):
        raise ValueError(f"unexpected {type(value).__name__} in a snapshot's meta")
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: decode_meta(v) for k, v in value.items()}
    if len(value) != 1:
        raise ValueError(f"malformed tagged value {tags[0]!r} in a snapshot's meta")
    ((tag, inner),) = value.items()
    try:
        if tag == "$bytes":
            return base64.b64decode(inner, validate=True)
        if tag == "$tuple":
            return tuple(decode_meta(v) for v in inner)
        if tag == "$dict":
            return {_hashable(decode_meta(k)): decode_meta(v) for k, v in inner}
        if tag == "$tensor":
            dtype = dtype_from_name(inner["dtype"])
            shape = tuple(int(s) for s in inner["shape"])
            data = bytearray(base64.b64decode(inner["data"], validate=True))
            out = torch.empty(shape, dtype=dtype)
            if len(data) != out.numel() * out.element_size():
                raise ValueError("a tensor in a snapshot's meta does not match its shape")
            if data:
                out.view(-1).view(torch.uint8).copy_(torch.frombuffer(data, dtype=torch.uint8))
            return out
    except (binascii.Error, KeyError, TypeError) as error:
        raise ValueError(f"malformed {tag} in a snapshot's meta: {error}") from error
    raise ValueError(f"unknown tag {tag!r} in a snapshot's meta")


def _hashable(key: Any) -> Any:
    if isinstance(key, (dict, list)):
        raise ValueError("a dict key in a snapshot's meta is not hashable")
    return key


def _read_meta(slot: Path, nbytes: int) -> tuple[list[tuple[str, tuple[int, ...], str]], dict[str, Any]]:
    """A slot's layout and engine meta; ``ValueError`` unless it parses and its layout's tensors
    take exactly ``nbytes`` (``OSError`` when it cannot be read)."""
    try:
        return _parse_meta(slot, nbytes)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{slot / META} is not a snapshot's metadata ({error})") from error


def _parse_meta(slot: Path, nbytes: int) -> tuple[list[tuple[str, tuple[int, ...], str]], dict[str, Any]]:
    saved = json.loads(_read_private(slot / META))
    if not isinstance(saved, dict) or not isinstance(saved.get("layout"), list):
        raise ValueError(f"{slot / META} is not a snapshot's metadata")
    layout, total, names = [], 0, set()
    for entry in saved["layout"]:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ValueError(f"{slot / META}: malformed layout entry {entry!r}")
        name, shape, dtype = entry
        if (
            not isinstance(name, str)
            or name in names
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(f"{slot / META}: malformed layout entry {entry!r}")
        names.add(name)
        numel = 1
        for d in shape:
            numel *= d
        total += numel * dtype_from_name(dtype).itemsize
        layout.append((name, tuple(shape), dtype))
    if total != nbytes:
        raise ValueError(f"{slot / META}: its layout takes {total} bytes, {nbytes} published")
    meta = decode_meta(saved.get("meta", {}))
    if not isinstance(meta, dict):
        raise ValueError(f"{slot / META}: the engine meta is not a mapping")
    return layout, meta


# -- files -----------------------------------------------------------------------------------------
def _write_private(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (created ``0600``, truncated), never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_private(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


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


_byte_view = byte_view  # a module attribute of its own: the kill test slows the copies through it


def _fill(mapped: mmap.mmap, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes, one after the other, into the mapped ``state.bin`` (the CPU path)."""
    offset = 0
    for tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        if n:
            dst = torch.frombuffer(mapped, dtype=torch.uint8, count=n, offset=offset)
            dst.copy_(_byte_view(tensor))
        offset += n


def _read_published(slot: Path) -> dict | None:
    try:
        record = json.loads(_read_private(slot / PUBLISHED))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
