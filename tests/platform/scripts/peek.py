"""What a child learns of the trainer's environment: `peek(pid)` reads `/proc/<pid>/environ` and
says "denied" (permission error), "secret" (the test's secret is in it) or "blank" (readable, no
secret). Used as a reward function, by the MCP server below and by sandboxed programs."""
import os

SECRET = "mrl-test-secret-4f1c"


def peek(pid: int) -> str:
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            data = f.read()
    except PermissionError:
        return "denied"
    except OSError as e:
        return f"error {e.errno}"
    return "secret" if SECRET.encode() in data else "blank"


def reward(pid: int) -> dict:
    """A reward function: what it saw of its parent's environment (the pool's worker's parent is
    the trainer), and of the pid it was given."""
    return {"parent": peek(os.getppid()), "given": peek(pid)}


if __name__ == "__main__":   # an MCP stdio server with one tool, `peek`
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("peek", log_level="CRITICAL")

    @server.tool()
    def parent_environ() -> str:
        """What this server reads of the trainer's environment (`PEEK_PID`: the trainer, which
        need not be the parent: mrl may start the server under a relay)."""
        return peek(int(os.environ.get("PEEK_PID", os.getppid())))

    server.run("stdio")
