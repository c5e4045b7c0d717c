"""Tools for multi-turn rollouts: Python functions named `path/file.py:function`, run with a
timeout, and the tools of HTTP and MCP servers (mrl/rollout/tool_servers/).

A function call runs in its own short-lived process (forked from a forkserver, so it starts in
milliseconds and inherits no trainer state): a tool that hangs is killed when its timeout
expires, one that raises or crashes its process becomes an error message for the model, and
neither can stop the rollout. A server call runs in a thread of that server's pool (at most its
`concurrency` at once) and is abandoned at the server's `timeout_s`. Calls of one turn run in
parallel. Every failure (timeout, tool error, server error, unknown tool) and every answer cut at
`max_result_bytes` becomes text the model sees, with its kind in `ToolResult` for the metrics.

The interface the multi-turn loop uses: `ToolRunner.schemas()` (OpenAI function-tool schemas, for
the chat template's `tools=`), `ToolRunner.run([ToolCall]) -> [ToolResult]`, `tool_counts`.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import multiprocessing as mp
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from mrl.errors import UserError
from mrl.reward.function import source_file, split_ref


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """`text` is what the model sees; `status` is "ok", "error" or "timeout". `error` says which
    failure: "tool" (the tool raised or reported an error; a function's process crashed), "server"
    (the server was unreachable, answered HTTP 5xx or garbage, or its process died), "unknown"
    (no such tool), "malformed" (the call could not be parsed), "timeout"; "" when ok. `truncated`:
    the answer was longer than the runner's `max_result_bytes` and was cut. `restarted`: the
    server had died and was restarted for this call (`ToolServer.revive`)."""

    text: str
    status: str
    seconds: float
    error: str = ""
    truncated: bool = False
    restarted: bool = False


COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_server_errors", "tool_truncated", "tool_server_restarts")


def tool_counts(results: Sequence[ToolResult]) -> dict[str, int]:
    """Per-conversation counts for `Response.info`: calls, errors (every non-timeout failure, the
    server errors included), timeouts, server errors, truncated answers, server restarts."""
    return {"tool_calls": len(results),
            "tool_errors": sum(r.status == "error" for r in results),
            "tool_timeouts": sum(r.status == "timeout" for r in results),
            "tool_server_errors": sum(r.error == "server" for r in results),
            "tool_truncated": sum(r.truncated for r in results),
            "tool_server_restarts": sum(r.restarted for r in results)}


METRICS = {"tool_calls": "tools/calls", "tool_errors": "tools/errors", "tool_timeouts": "tools/errors_timeout",
           "tool_server_errors": "tools/errors_server", "tool_truncated": "tools/truncated",
           "tool_server_restarts": "tools/server_restarts"}


def tool_metrics(responses) -> dict[str, float]:
    """A step's tool metrics: the `tool_counts` of its responses summed (empty when none has them)."""
    infos = [r.info for r in responses if r.info and "tool_calls" in r.info]
    if not infos:
        return {}
    return {name: float(sum(i.get(key, 0) for i in infos)) for key, name in METRICS.items()}


def _cut(text: str, max_bytes: int) -> tuple[str, bool]:
    """`text` within `max_bytes` UTF-8 bytes, with a note of what was cut; (text, whether cut)."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text, False
    return data[:max_bytes].decode(errors="ignore") + f"\n[truncated: the answer is longer than {max_bytes} bytes]", True


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
    """Runs the job's tools by name: functions each in a killable process with a timeout, server
    tools on their servers. `schemas()` lists them all for the chat template."""

    def __init__(self, refs: Sequence[str] = (), timeout_s: float = 10.0, *, servers: Sequence = (),
                 loop=None, max_result_bytes: int = 65536):
        """`servers`: connected `ToolServer`s (mrl/rollout/tool_servers), owned from here on, with
        `loop` their MCP event-loop thread; both are closed by `close()` (or at exit)."""
        self.timeout_s = timeout_s
        self.max_result_bytes = max_result_bytes
        self.refs: dict[str, str] = {}
        self.servers = list(servers)
        self._finalizer = weakref.finalize(self, _close, self.servers, loop, [])
        try:
            self._add_functions(refs)
            self._server_of: dict[str, Any] = {}
            for server in self.servers:
                for name in server.tool_names:
                    other = self._server_of.get(name)
                    if other is not None or name in self.refs:
                        owner = f"server {other.name!r}" if other is not None else "rollout.multi_turn.tools"
                        raise UserError(f"rollout.multi_turn.servers: tool {name!r} of server {server.name!r} is also "
                                        f"offered by {owner}; leave it out of one (its `tools` allowlist)")
                    self._server_of[name] = server
        except BaseException:
            self.close()
            raise
        self._pools = {s.name: concurrent.futures.ThreadPoolExecutor(s.concurrency, thread_name_prefix=f"mrl-tool-{s.name}")
                       for s in self.servers}
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close, self.servers, loop, list(self._pools.values()))
        self._function_schemas: Optional[list[dict]] = None
        self._ctx = mp.get_context("forkserver")

    def _add_functions(self, refs: Sequence[str]) -> None:
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

    @classmethod
    def from_config(cls, cfg) -> "ToolRunner":
        """The tools of a `rollout.multi_turn` section: its functions, its `[[servers]]` and the
        servers of verl's tool file, connected and listed now (a server that cannot be reached, or
        a tool name two of them share, is one `UserError` line naming the server)."""
        from mrl.rollout.tool_servers import close_servers, connect_servers

        servers, loop = connect_servers(cfg)
        try:
            return cls(cfg.tools, cfg.tool_timeout_s, servers=servers, loop=loop,
                       max_result_bytes=cfg.max_tool_result_bytes)
        except BaseException:
            close_servers(servers, loop)
            raise

    @property
    def names(self) -> list[str]:
        return list(self.refs) + [n for s in self.servers for n in s.tool_names]

    def schemas(self) -> list[dict]:
        """Every tool as an OpenAI function-tool schema (`{"type": "function", "function": {name,
        description, parameters}}`), functions first then each server's in listing order: what a
        chat template's `tools=` takes. Functions' schemas are read from their source once
        (`tool_schema.function_schema`: signature and docstring, without importing it)."""
        if self._function_schemas is None:
            from mrl.rollout.tool_schema import function_schema

            self._function_schemas = [function_schema(ref) for ref in self.refs.values()]
        return [*self._function_schemas, *(schema for s in self.servers for schema in s.schemas)]

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run `calls` in parallel; results in call order."""
        started = []
        for call in calls:
            ref, server = self.refs.get(call.name), self._server_of.get(call.name)
            if ref is not None:
                recv, send = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(target=_run_in_child, args=(ref, call.arguments, send), daemon=True)
                proc.start()
                send.close()
                started.append((call, proc, recv, time.monotonic()))
            elif server is not None:
                began: list[float] = []
                fut = self._pools[server.name].submit(self._call_server, server, call, began)
                started.append((call, server, fut, began))
            else:
                started.append(ToolResult(f"error: unknown tool {call.name!r} (tools: {', '.join(self.names)})",
                                          "error", 0.0, "unknown"))
        out = []
        for s in started:
            if isinstance(s, ToolResult):
                out.append(s)
            elif len(s) == 4 and isinstance(s[2], concurrent.futures.Future):
                out.append(self._await_server(*s))
            else:
                out.append(self._collect(*s))
        return out

    def _capped(self, res: ToolResult) -> ToolResult:
        text, cut = _cut(res.text, self.max_result_bytes)
        return replace(res, text=text, truncated=True) if cut else res

    def _call_server(self, server, call: ToolCall, began: list) -> ToolResult:
        from mrl.rollout.tool_servers.base import ServerError, ToolCallError

        began.append(t0 := time.monotonic())
        restarted = False
        try:
            restarted = server.revive()
            text = server.call(call.name, call.arguments, self.max_result_bytes)
            return self._capped(ToolResult(text, "ok", time.monotonic() - t0, restarted=restarted))
        except TimeoutError:
            return ToolResult(f"error: {call.name} timed out after {server.timeout_s:g} s", "timeout",
                              time.monotonic() - t0, "timeout", restarted=restarted)
        except ToolCallError as e:
            return self._capped(ToolResult(f"error: {call.name}: {e}", "error", time.monotonic() - t0, "tool",
                                           restarted=restarted))
        except ServerError as e:
            return ToolResult(f"error: {call.name}: tool server {server.name!r} failed: {e}", "error",
                              time.monotonic() - t0, "server", restarted=restarted)
        except Exception as e:   # noqa: BLE001 - whatever a client library raises is the server's failure
            return ToolResult(f"error: {call.name}: tool server {server.name!r} failed: {type(e).__name__}: {e}",
                              "error", time.monotonic() - t0, "server", restarted=restarted)

    def _await_server(self, call: ToolCall, server, fut: concurrent.futures.Future, began: list) -> ToolResult:
        """The call's result; a call that overruns its server's timeout by `GRACE_S` once running
        (its client did not stop it) is abandoned as a timeout; a server that may first restart
        (`revive`) gets its `restart_s` more. Time queued for the server's concurrency does
        not count."""
        limit = server.timeout_s + server.restart_s + GRACE_S
        while True:
            wait = limit - (time.monotonic() - began[0]) if began else limit
            try:
                return fut.result(max(wait, 0.0))
            except concurrent.futures.TimeoutError:
                if began and time.monotonic() - began[0] >= limit:
                    return ToolResult(f"error: {call.name} timed out after {server.timeout_s:g} s", "timeout",
                                      time.monotonic() - began[0], "timeout")

    def _collect(self, call: ToolCall, proc, recv, t0: float) -> ToolResult:
        remaining = max(0.0, self.timeout_s - (time.monotonic() - t0))
        try:
            if recv.poll(remaining):
                try:
                    status, text = recv.recv()
                except EOFError:  # the process died without answering (killed, os._exit, segfault)
                    proc.join(1.0)
                    status, text = "error", f"tool process exited with code {proc.exitcode}"
                if status == "ok":
                    return self._capped(ToolResult(text, status, time.monotonic() - t0))
                return self._capped(ToolResult(f"error: {call.name}: {text}", status, time.monotonic() - t0, "tool"))
            return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout",
                              time.monotonic() - t0, "timeout")
        finally:
            recv.close()
            if proc.is_alive():
                proc.kill()
            proc.join()

    def close(self) -> None:
        """Close the servers (their sessions, subprocesses, loop thread); bounded, idempotent."""
        self._finalizer()


GRACE_S = 2.0   # past a server's timeout, how long the runner waits for its client to give up


def _close(servers, loop, pools) -> None:
    from mrl.rollout.tool_servers import close_servers

    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    close_servers(servers, loop)
