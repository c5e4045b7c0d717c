"""Start every kind of child the trainer starts and report what each reads of the trainer's
`/proc/<pid>/environ` (see peek.py). Run with the secret in the environment:

    SECRET_TOKEN=mrl-test-secret-4f1c python secret_children.py protected|unprotected

`protected` first does what `python -m mrl` does first (`mrl.platform.lifetime.boot`). Prints one
JSON object: child kind -> "denied" | "blank" | "secret", plus what the trainer itself still sees."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(mode: str) -> None:
    if mode == "protected":
        from mrl.platform.lifetime import boot

        boot()
    me = os.getpid()
    out = {}
    from mrl.reward.pool import Call, RewardPool

    with RewardPool([f"{HERE / 'peek.py'}:reward"], workers=1, timeout_s=60) as pool:
        got = pool.run([Call(f"{HERE / 'peek.py'}:reward", (me,), {})])[0]
    out["reward_worker"] = got.value["given"] if got.error is None else f"error {got.message}"
    out["reward_worker_parent"] = got.value["parent"] if got.error is None else f"error {got.message}"

    from mrl.rollout.tool_servers.mcp_tools import EventLoopThread, MCPToolServer

    loop = EventLoopThread()
    server = MCPToolServer("peek", "mcp_stdio", loop, command=sys.executable, args=(str(HERE / "peek.py"),),
                           env={"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PEEK_PID": str(me)}, connect_timeout_s=60)
    try:
        out["mcp_stdio_server"] = server.call("parent_environ", {}, 10_000).strip()
    finally:
        server.close()
        loop.close()

    from mrl.reward.code_sandbox import Limits, run_sandboxed

    program = (HERE / "peek.py").read_text().split("\n\ndef reward")[0] + f"\nprint(peek({me}))\n"
    ran = run_sandboxed({"main.py": program}, ["main.py"], b"", Limits(wall_s=30, cpu_s=20))
    out["code_sandbox"] = ran.stdout.decode().strip() or f"{ran.status}: {ran.stderr_tail.decode()[-200:]}"

    child = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import peek, os; "
                            "print(peek.peek(os.getppid()))"], env={}, capture_output=True, text=True)
    out["plain_child"] = child.stdout.strip() or child.stderr[-200:]

    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    out["dumpable"] = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)   # PR_GET_DUMPABLE
    out["trainer_os_environ"] = os.environ.get("SECRET_TOKEN")
    out["trainer_getenv"] = (libc.getenv(b"SECRET_TOKEN") or b"").decode()
    out["inheriting_child"] = subprocess.run([sys.executable, "-c", "import os; print(os.environ['SECRET_TOKEN'])"],
                                             capture_output=True, text=True).stdout.strip()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
