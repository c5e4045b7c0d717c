"""Tool calls per second through the `ToolRunner`, per kind of tool, on this machine.

    python tools/bench/tool_servers.py                     # every kind, a few seconds each
    python tools/bench/tool_servers.py --only http,mcp_stdio --calls 200

Kinds: `http` (mrl's HTTP tool protocol, tests/rollout/servers/http_tool_server.py in its own
process), `mcp_stdio` and `mcp_http` (tests/rollout/servers/mcp_tool_server.py, the official SDK's
MCPServer, over stdio and streamable HTTP), and `function` (a Python function tool, one forked
process per call) for comparison. Each is measured with one call per `run()` (sequential: the
round-trip cost) and with `--batch` calls per `run()` at the server's `concurrency` (a turn of many
conversations). The tool is `add(a, b)`: the figures are the transport's cost, not a tool's.
Prints one line per configuration: calls/s.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mrl.rollout.config import MultiTurnConfig, ToolServerConfig  # noqa: E402
from mrl.rollout.tools import ToolCall, ToolRunner  # noqa: E402

SERVERS = REPO / "tests" / "rollout" / "servers"
KINDS = ("http", "mcp_stdio", "mcp_http", "function")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(script: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVERS / script), *args, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{script} did not start")


def runner_for(kind: str, concurrency: int) -> tuple[ToolRunner, list]:
    procs = []
    if kind == "function":
        return ToolRunner([str(SERVERS.parent / "tools_for_tests.py") + ":structured"]), procs
    if kind == "http":
        proc, port = serve("http_tool_server.py")
        procs.append(proc)
        server = ToolServerConfig(name="bench", kind="http", url=f"http://127.0.0.1:{port}", concurrency=concurrency)
    elif kind == "mcp_http":
        proc, port = serve("mcp_tool_server.py", "http")
        procs.append(proc)
        server = ToolServerConfig(name="bench", kind="mcp_http", url=f"http://127.0.0.1:{port}/mcp",
                                  concurrency=concurrency)
    else:
        server = ToolServerConfig(name="bench", kind="mcp_stdio", command=sys.executable,
                                  args=(str(SERVERS / "mcp_tool_server.py"), "stdio"), concurrency=concurrency)
    return ToolRunner.from_config(MultiTurnConfig(enable=True, servers=(server,))), procs


def measure(kind: str, calls: int, batch: int, concurrency: int) -> None:
    runner, procs = runner_for(kind, concurrency)
    name = "structured" if kind == "function" else "add"
    args = {"a": 2, "b": 3}
    try:
        runner.run([ToolCall(name, args)])   # warm up (connections, forkserver)
        for per_run in (1, batch):
            n = max(calls // per_run, 1) * per_run
            t = time.perf_counter()
            for _ in range(n // per_run):
                results = runner.run([ToolCall(name, args)] * per_run)
                assert all(r.status == "ok" for r in results), results[:1]
            dt = time.perf_counter() - t
            label = "sequential" if per_run == 1 else f"{per_run} per turn, concurrency {concurrency}"
            print(f"{kind:9s} {label:28s}: {n / dt:8.1f} calls/s ({dt / n * 1e3:6.2f} ms/call)", flush=True)
    finally:
        runner.close()
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(KINDS), help="comma-separated kinds: " + ", ".join(KINDS))
    ap.add_argument("--calls", type=int, default=128, help="calls per configuration")
    ap.add_argument("--batch", type=int, default=32, help="calls per run() in the batched configuration")
    ap.add_argument("--concurrency", type=int, default=8, help="the servers' concurrency")
    args = ap.parse_args()
    for kind in args.only.split(","):
        if kind not in KINDS:
            raise SystemExit(f"--only: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        measure(kind, args.calls, args.batch, args.concurrency)


if __name__ == "__main__":
    main()
