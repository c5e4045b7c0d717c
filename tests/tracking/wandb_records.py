"""Read back the records of an offline wandb run file (`run-<id>.wandb`), for tests.

wandb 0.31 no longer ships a Python reader (its Go core writes the file), so this reads the
format itself: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then LevelDB-log records in
32 KiB blocks (`<checksum u32, length u16, type u8>` headers; FULL=1, FIRST=2, MIDDLE=3, LAST=4;
a block tail shorter than a header is zero padding), each payload a `wandb_internal_pb2.Record`.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<IHB")


def payloads(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pending, at = [], b"", 7
    while at + HEADER.size <= len(data):
        left = BLOCK - at % BLOCK
        if left < HEADER.size:   # zero padding at the block's end
            at += left
            continue
        _, length, kind = HEADER.unpack_from(data, at)
        at += HEADER.size
        chunk, at = data[at:at + length], at + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
            pending = b""
    return out


def records(path: str | Path) -> dict:
    """{"history": [{key: value}, ...], "config": {key: value}, "run": Record.run} of a run file.

    A file without its closing `exit` record is still being written (read back too early): that is
    an assertion error saying so, not a short history."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, config, run, ended = [], {}, None, False
    for raw in payloads(path):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            run = r.run
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "exit":
            ended = True
    assert ended, f"{path} has no exit record: wandb has not finished writing it"
    return {"history": history, "config": config, "run": run}
