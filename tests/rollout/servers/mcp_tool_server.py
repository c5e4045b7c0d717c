"""An MCP server for the tool-server tests and benchmark, written with the official SDK's `MCPServer`
(mcp 2.x's FastMCP).

    python mcp_tool_server.py stdio            # speaks MCP over stdin/stdout
    python mcp_tool_server.py http PORT        # streamable HTTP at http://127.0.0.1:PORT/mcp

Tools: `lookup(key)` (a secret per key, what the toy task asks for), `add(a, b)`, `sleepy(seconds)`,
`boom()` (raises), `big(n)` (n characters) and `exit_now()` (the process dies mid-call).
`PID_FILE` (env): where the process writes its pid; `WITHOUT_FILE` (env): a file that, when it
exists at start, names tools (one per line) this process does not offer (a restart that lost one);
`HANG_FILE` (env): a file that, when it exists at start, makes the process hang before serving.
"""
from __future__ import annotations

import os
import sys

import anyio

from mcp.server.mcpserver import MCPServer

SECRETS = {"alpha": "7", "beta": "3", "gamma": "9"}

server = MCPServer("mrl-test-tools", log_level="CRITICAL")


@server.tool()
def lookup(key: str) -> str:
    """The secret digit stored under `key`."""
    if key not in SECRETS:
        raise ValueError(f"no secret named {key!r}")
    return SECRETS[key]


@server.tool()
def add(a: int, b: int) -> int:
    """a + b."""
    return a + b


@server.tool()
async def sleepy(seconds: float) -> str:
    """Sleeps `seconds` then answers (without blocking the server's other calls)."""
    await anyio.sleep(seconds)
    return "awake"


@server.tool()
def boom() -> str:
    """Always fails."""
    raise RuntimeError("the tool broke")


@server.tool()
def big(n: int) -> str:
    """A string of `n` characters."""
    return "x" * n


@server.tool()
def exit_now() -> str:
    """Kills the server process while the call is in flight."""
    os._exit(3)


if __name__ == "__main__":
    if os.environ.get("PID_FILE"):   # the exit test checks this process is gone
        with open(os.environ["PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
    if os.environ.get("HANG_FILE") and os.path.exists(os.environ["HANG_FILE"]):
        import time

        time.sleep(3600)
    if os.environ.get("WITHOUT_FILE") and os.path.exists(os.environ["WITHOUT_FILE"]):
        with open(os.environ["WITHOUT_FILE"]) as f:
            for name in f.read().split():
                server.remove_tool(name)
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
