"""Tools for multi-turn rollouts: Python functions named `path/file.py:function`, run with a timeout.

Each call runs in its own short-lived process (forked from a forkserver, so it starts in
milliseconds and inherits no trainer state): a tool that hangs is killed when its timeout
expires, one that raises or crashes its process becomes an error message for the model, and
neither can stop the rollout. Calls of one turn run in parallel.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mrl.errors import UserError
from mrl.reward.function import source_file, split_ref


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """`text` is what the model sees; `status` is "ok", "error" or "timeout"."""

    text: str
    status: str
    seconds: float


def _load(ref: str):
    target, func = split_ref(ref)  # checked by ToolRunner
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"mrl_tool_{Path(target).stem}", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, func)


def _run_in_child(ref: str, arguments: dict, conn) -> None:
    try:
        result = _load(ref)(**arguments)
        text = result if isinstance(result, str) else json.dumps(result)
        conn.send(("ok", text))
    except BaseException as e:  # noqa: BLE001 - the model sees any failure as text
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


class ToolRunner:
    """Runs the job's tools by name, each call in a killable process with a timeout."""

    def __init__(self, refs: Sequence[str], timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.refs: dict[str, str] = {}
        for ref in refs:
            parts = split_ref(ref)
            if parts is None:
                raise UserError(f"rollout.multi_turn.tools: {ref!r} is not 'path/to/file.py:function' or 'module:function'")
            path = source_file(parts[0])
            if path is None or not path.is_file():
                raise UserError(f"rollout.multi_turn.tools: {parts[0]!r} not found (paths are relative to the working directory)")
            if parts[1] in self.refs:
                raise UserError(f"rollout.multi_turn.tools: two tools are named {parts[1]!r}")
            self.refs[parts[1]] = str(path) + ":" + parts[1] if parts[0].endswith(".py") else ref
        self._ctx = mp.get_context("forkserver")

    @property
    def names(self) -> list[str]:
        return list(self.refs)

    def schemas(self) -> list[dict]:
        """OpenAI function-tool schemas of the tools, for the chat template's `tools=`."""
        from mrl.rollout.tool_schema import function_schema

        return [function_schema(ref) for ref in self.refs.values()]

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run `calls` in parallel; results in call order."""
        started = []
        for call in calls:
            ref = self.refs.get(call.name)
            if ref is None:
                started.append(ToolResult(f"error: unknown tool {call.name!r} (tools: {', '.join(self.refs)})", "error", 0.0))
                continue
            recv, send = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=_run_in_child, args=(ref, call.arguments, send), daemon=True)
            proc.start()
            send.close()
            started.append((call, proc, recv, time.monotonic()))
        return [s if isinstance(s, ToolResult) else self._collect(*s) for s in started]

    def _collect(self, call: ToolCall, proc, recv, t0: float) -> ToolResult:
        remaining = max(0.0, self.timeout_s - (time.monotonic() - t0))
        try:
            if recv.poll(remaining):
                try:
                    status, text = recv.recv()
                except EOFError:  # the process died without answering (killed, os._exit, segfault)
                    proc.join(1.0)
                    status, text = "error", f"tool process exited with code {proc.exitcode}"
                return ToolResult(text if status == "ok" else f"error: {call.name}: {text}", status, time.monotonic() - t0)
            return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout", time.monotonic() - t0)
        finally:
            recv.close()
            if proc.is_alive():
                proc.kill()
            proc.join()
