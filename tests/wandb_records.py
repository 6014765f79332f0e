"""Reads the records of an offline W&B run file (`run-<id>.wandb`), for tests.

wandb 0.31 ships no Python reader (its writer lives in the Go `wandb-core`). The file is a
7-byte header (":W&B", magic 0xBEE1, version 0) followed by 32 KiB blocks of chunks, each
with a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle,
4 last), as in LevelDB's log format; a chunk never straddles a block, and a block tail too
short for a header is padding. Each whole record is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += room  # zero padding to the end of the block
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """Every logged row, as {key: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def run_id(path: Path) -> str:
    return next(r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run")
