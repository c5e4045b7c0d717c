"""A reward function for the sandbox-escape tests: runs a program in the code sandbox from inside
a reward worker (where `mrl train` runs them: Landlock-restricted) and returns its stdout."""
from mrl.reward.code_sandbox import Limits, run_sandboxed


def run_program(program: str, scratch_mb: int = 64) -> str:
    r = run_sandboxed({"main.py": program}, ["main.py"], b"", Limits(wall_s=20.0, cpu_s=10, scratch_mb=scratch_mb,
                                                                     file_size_mb=64))
    return r.stdout.decode(errors="replace") if r.status in ("ok", "error") else f"{r.status}: {r.stderr_tail[-300:]!r}"
