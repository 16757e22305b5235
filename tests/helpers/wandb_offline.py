"""Reading an offline W&B run back from the ``.wandb`` file it writes.

The reader decodes the run file itself (wandb 0.2x+ no longer ships a Python reader): a 7-byte file
header, then records in the LevelDB log format (32 KiB blocks, each chunk with a
``<crc32, length, type>`` header, records split into FIRST/MIDDLE/LAST chunks across blocks), each
record a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks_to_records(buf: bytes) -> list[bytes]:
    assert buf[:4] == b":W&B", "not a W&B run file"
    records, parts, pos = [], [], _HEADER
    while pos + _HEADER <= len(buf):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", buf[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        data = buf[pos + _HEADER : pos + _HEADER + length]
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pos += _HEADER + length
        parts.append(data)
        if kind in (_FULL, _LAST):
            records.append(b"".join(parts))
            parts = []
    return records


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """The run's name/group, config, history by step, and final summary from its .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out: dict[str, Any] = {"history": {}, "summary": {}, "config": {}, "run": None}
    for data in _chunks_to_records(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = rec.run
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in rec.history.item
            }
            out["history"][row["_step"]] = row
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        out["last"] = kind
    out["dir"] = path.parent
    assert out.get("last") == "exit", "RunLogger.finish() returned before the run file was complete"
    return out
