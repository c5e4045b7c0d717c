"""A relay between an MCP stdio server and the MCP SDK that caps the size of each message.

The SDK reads a stdio server's stdout a line (one JSON-RPC message) at a time, buffering the
whole line whatever its size: a server answering 100 MB is read whole into the trainer. mrl
starts such a server under this relay instead (`python -I stdio_cap.py LIMIT -- command args...`,
stdlib only, so it starts in milliseconds and imports nothing of the job): the server inherits the
relay's stdin, its stdout comes through here, and a line longer than LIMIT bytes is not passed
on; its first bytes are searched for the message's `"id"` and a JSON-RPC error carrying
`TOO_LARGE` takes its place, so the call fails at once (a tool server error the runner counts)
instead of the model seeing a cut message. The relay holds at most LIMIT bytes. It ends with
the server (same exit status); the SDK stops both together (they share a process group).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

TOO_LARGE = "mrl: the tool server's answer is over"
_ID = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.){0,200}"|-?\d{1,30})')
_PROBE = 4096   # bytes of an oversized line searched for its id


def refusal(head: bytes, limit: int) -> bytes:
    """The JSON-RPC error line that replaces an oversized message (empty when it has no id)."""
    m = _ID.search(head[:_PROBE])
    if m is None:
        return b""
    error = {"code": -32001, "message": f"{TOO_LARGE} {limit} bytes (mrl's cap on one MCP message)"}
    return b'{"jsonrpc": "2.0", "id": ' + m.group(1) + b', "error": ' + json.dumps(error).encode() + b"}\n"


def relay(src: int, dst: int, limit: int) -> None:
    """Copy lines from fd `src` to fd `dst` until EOF, replacing each line over `limit` bytes."""
    line, dropping, head = bytearray(), False, b""
    while True:
        chunk = os.read(src, 1 << 16)
        if not chunk:
            break
        while chunk:
            end = chunk.find(b"\n")
            piece, chunk = (chunk, b"") if end < 0 else (chunk[:end + 1], chunk[end + 1:])
            if not dropping:
                if len(line) + len(piece) > limit + 1:   # + 1: the newline is not the message
                    dropping, head = True, bytes(line[:_PROBE]) + piece[:_PROBE]
                    line.clear()
                else:
                    line += piece
            if end >= 0:
                if dropping:
                    _write(dst, refusal(head, limit))
                    dropping = False
                elif line:
                    _write(dst, bytes(line))
                    line.clear()
    if line and not dropping:
        _write(dst, bytes(line))


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: stdio_cap.py LIMIT -- command [args...]", file=sys.stderr)
        return 2
    limit, command = int(argv[0]), argv[2:]
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE)
    except OSError as e:
        print(f"cannot start {command[0]}: {e}", file=sys.stderr)
        return 127
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    try:
        relay(child.stdout.fileno(), sys.stdout.fileno(), limit)
    except BrokenPipeError:
        child.terminate()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
