"""Tools on MCP servers, through the official `mcp` SDK: a subprocess speaking MCP on stdio, or a
streamable-HTTP endpoint.

The SDK is asyncio; the rollout loop is not. Each `ToolRunner` owns one `EventLoopThread` (a
daemon thread running an asyncio loop); every MCP server of the runner holds its session there in
one long-lived task (the SDK's transports are async context managers that must be entered and
left by the same task), and calls are coroutines submitted to that loop and waited on with the
server's timeout. Closing is bounded: the session tasks are told to leave, given a few seconds,
then cancelled, and the thread is a daemon, so a stuck server cannot hold a worker at exit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from mrl.errors import UserError
from mrl.rollout.tool_servers.base import ServerError, ToolCallError, ToolServer, normalize_schema, select_tools
from mrl.rollout.tool_servers.stdio_cap import TOO_LARGE

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


class EventLoopThread:
    """An asyncio loop in a daemon thread; `submit(coro, timeout)` runs a coroutine on it and waits."""

    def __init__(self, name: str = "mrl-mcp"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def future(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def submit(self, coro, timeout_s: float) -> Any:
        """`coro`'s result; `TimeoutError` after `timeout_s` (the coroutine is then cancelled)."""
        fut = self.future(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def cancel_rest():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S) if tasks else None

        try:
            self.future(cancel_rest()).result(CLOSE_TIMEOUT_S + 1)
        except Exception:   # noqa: BLE001 - closing must not raise; the thread is a daemon
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


def _text_of(result) -> str:
    """The text the model sees of a `CallToolResult`: its text parts joined; other parts named;
    the structured content as JSON when there is no text."""
    parts = []
    for item in result.content or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and getattr(item.resource, "text", None) is not None:
            parts.append(item.resource.text)
        else:
            parts.append(f"[{kind or type(item).__name__} content]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


MAX_RESTARTS = 3   # reconnects tried per MCP server per run (each bounded by its connect_timeout_s)
MAX_MESSAGE_BYTES = 8 << 20   # one message from an MCP server (a line on stdio, a body line or SSE event on HTTP)


class MCPToolServer(ToolServer):
    """An MCP server (`kind` "mcp_stdio": `command` + `args` + `env`; "mcp_http": `url`), connected
    and listed on construction, its session held on `loop` until `close()`.

    A session that fails (the stdio process exited, the HTTP session broke) or lets a call time
    out (it may be stuck) is seen by the call that meets it, a server error or a timeout;
    `revive()`, run by the runner before each later call, then opens a fresh session (a new
    process for stdio) within `connect_timeout_s`, at most `MAX_RESTARTS` times per run, and
    re-checks the listing: a tool the new session no longer offers is a server error on each call
    to it. An answer over `MAX_MESSAGE_BYTES` is a server error that leaves the session up."""

    def __init__(self, name: str, kind: str, loop: EventLoopThread, *, url: Optional[str] = None,
                 command: Optional[str] = None, args: tuple[str, ...] = (), env: Optional[dict[str, str]] = None,
                 cwd: Optional[str] = None, headers: Optional[dict[str, str]] = None, allow: tuple[str, ...] = (),
                 timeout_s: float = 30.0, connect_timeout_s: float = 30.0, concurrency: int = 8):
        self.name, self.kind, self.loop = name, kind, loop
        self.timeout_s, self.connect_timeout_s, self.concurrency = timeout_s, connect_timeout_s, concurrency
        self.restart_s = connect_timeout_s
        self.where = url if kind == "mcp_http" else " ".join([command or "", *args])
        self._spec = (kind, url, command, args, env, cwd, headers)
        self._client = None
        self._closing: Optional[asyncio.Event] = None
        self._holder: Optional[concurrent.futures.Future] = None
        self._lost: Optional[str] = None   # why the session ended while in use
        self._generation = 0               # sessions opened so far; a failure of an older one is stale
        self._failed = False               # a call met a dead session: the next call restarts it
        self._restarts_tried = 0
        self._missing: set[str] = set()    # listed tools a restarted session no longer offers
        self._lock = threading.Lock()
        self._closed = False
        if kind == "mcp_stdio" and not _runnable(command or "", cwd, env):
            # checked here: the server starts under the stdio_cap relay, which could only say so on stderr
            raise UserError(f"rollout.multi_turn.servers: MCP server {name!r} ({self.where}): cannot list its tools: "
                            f"cannot start {command!r}: not an executable file or a command on PATH")
        try:
            offered = self._open(connect_timeout_s)
            self.schemas = select_tools(name, offered, allow)
        except TimeoutError:
            self.close()
            raise UserError(f"rollout.multi_turn.servers: MCP server {name!r} ({self.where}): no tool listing "
                            f"within connect_timeout_s = {connect_timeout_s:g} s") from None
        except BaseException as e:   # noqa: BLE001 - any failure to connect is the one line
            self.close()
            raise UserError(f"rollout.multi_turn.servers: MCP server {name!r} ({self.where}): cannot list its "
                            f"tools: {_describe(e)}") from None

    @staticmethod
    def _transport(kind, url, command, args, env, cwd, headers):
        """A fresh transport target (an httpx client cannot be reused once its session closed).
        Every message from the server is capped at `MAX_MESSAGE_BYTES`: a stdio server runs under
        the `stdio_cap` relay, an HTTP one through `mcp_http_cap.capped_client`."""
        if kind == "mcp_stdio":
            from mcp.client.stdio import StdioServerParameters

            relay = [sys.executable, "-I", str(Path(__file__).with_name("stdio_cap.py")), str(MAX_MESSAGE_BYTES), "--"]
            return StdioServerParameters(command=relay[0], args=[*relay[1:], command, *args],
                                         env=dict(env or {}) or None, cwd=cwd)
        from mcp.client.streamable_http import streamable_http_client

        from mrl.rollout.tool_servers.mcp_http_cap import capped_client

        return streamable_http_client(url, http_client=capped_client(headers, MAX_MESSAGE_BYTES),
                                      max_sse_event_size=MAX_MESSAGE_BYTES)

    def _open(self, timeout_s: float) -> list[dict]:
        """Open a session (replacing the current one) and list its tools; `TimeoutError` after
        `timeout_s`, or the connection's exception. The session is current once listed."""
        ready: concurrent.futures.Future = concurrent.futures.Future()
        closing = asyncio.Event()
        holder = self.loop.future(self._hold(self._transport(*self._spec), ready, closing))
        self._retire()
        self._closing, self._holder = closing, holder
        try:
            client, offered = ready.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._retire()
            holder.cancel()   # still connecting: stop it (a stdio transport kills its process)
            raise TimeoutError(f"no tool listing within connect_timeout_s = {timeout_s:g} s") from None
        except BaseException:
            self._retire()
            holder.cancel()
            raise
        self._client, self._lost, self._generation = client, None, self._generation + 1
        return offered

    def _retire(self) -> None:
        """Tell the current session to leave, without waiting (its exit runs on the loop)."""
        closing = self._closing
        self._client, self._closing, self._holder = None, None, None
        if closing is not None and not self.loop.loop.is_closed():
            self.loop.loop.call_soon_threadsafe(closing.set)

    async def _hold(self, target, ready: concurrent.futures.Future, closing: asyncio.Event) -> None:
        """Open the session, put (client, tools) into `ready`, keep the session until `closing`."""
        from mcp import Client

        client = None
        try:
            async with Client(target) as client:
                offered, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    for tool in page.tools:
                        offered.append(normalize_schema({"name": tool.name, "description": tool.description or "",
                                                         "parameters": tool.input_schema}, "tools/list"))
                    cursor = page.next_cursor
                    if not cursor:
                        break
                if not ready.done():
                    ready.set_result((client, offered))
                await closing.wait()
        except BaseException as e:   # noqa: BLE001 - reported to the opener or to later calls
            if not ready.done():
                ready.set_exception(e)
            elif not closing.is_set() and self._client is client:
                self._lost = _describe(e)
                log.warning("tool server %r: MCP session lost: %s", self.name, self._lost)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if client is not None and self._client is client:
                self._client = None

    def revive(self) -> bool:
        """Restart the session if a call found it dead and restarts are left; True when this call
        restarted it. A restart that fails (or times out at `connect_timeout_s`) spends one of the
        `MAX_RESTARTS` and raises `ServerError`."""
        if not self._failed:
            return False
        with self._lock:
            if not self._failed or self._closed or self._restarts_tried >= MAX_RESTARTS:
                return False
            self._restarts_tried += 1
            try:
                offered = self._open(self.connect_timeout_s)
            except BaseException as e:   # noqa: BLE001 - the server stays down until the next try
                why = str(e) if isinstance(e, TimeoutError) else _describe(e)
                log.warning("tool server %r: restart %d of %d failed: %s", self.name, self._restarts_tried,
                            MAX_RESTARTS, why)
                raise ServerError(f"restart failed: {why}") from None
            self._failed = False
            names = {s["function"]["name"] for s in offered}
            self._missing = {n for n in self.tool_names if n not in names}
            log.warning("tool server %r: restarted (%d of %d)%s", self.name, self._restarts_tried, MAX_RESTARTS,
                        f"; it no longer offers {', '.join(sorted(self._missing))}" if self._missing else "")
            return True

    async def _call(self, tool: str, arguments: dict):
        client = self._client
        if client is None:
            raise ServerError(f"MCP session closed{': ' + self._lost if self._lost else ''}")
        return await client.call_tool(tool, arguments, read_timeout_seconds=self.timeout_s)

    def call(self, tool: str, arguments: dict, max_bytes: int) -> str:
        if tool in self._missing:
            raise ServerError(f"the restarted server no longer offers {tool!r}")
        generation = self._generation
        try:
            result = self.loop.submit(self._call(tool, arguments), self.timeout_s)
        except TimeoutError:
            self._fail(generation)   # a session that let a call time out may be stuck: restart it
            raise
        except Exception as e:   # noqa: BLE001 - transport and protocol failures
            if TOO_LARGE in str(e):   # the relay or the capped transport refused one answer: the session is fine
                raise ServerError(f"the answer is over {MAX_MESSAGE_BYTES} bytes (MAX_MESSAGE_BYTES)") from None
            if not isinstance(e, ServerError) and "timed out" in str(e).lower():
                self._fail(generation)
                raise TimeoutError(str(e)) from None
            self._fail(generation)
            if isinstance(e, ServerError):
                raise
            raise ServerError(_describe(e)) from None
        text = _text_of(result)
        if result.is_error:
            raise ToolCallError(text)
        return text

    def _fail(self, generation: int) -> None:
        """Mark the session for a restart by the next call (unless a newer one replaced it)."""
        if generation == self._generation:
            self._failed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            holder = self._holder
            self._retire()
        if holder is not None:
            try:
                holder.result(CLOSE_TIMEOUT_S)
            except BaseException:   # noqa: BLE001 - a slow or failed exit; the loop's close cancels it
                holder.cancel()


def _runnable(command: str, cwd: Optional[str], env: Optional[dict]) -> bool:
    """Whether `command` names an executable (a path, relative to `cwd`, or a name on the server's PATH)."""
    if os.sep in command and cwd and not os.path.isabs(command):
        command = os.path.join(cwd, command)
    return shutil.which(command, path=(env or {}).get("PATH", os.environ.get("PATH"))) is not None


def _describe(e: BaseException) -> str:
    """One line for an exception (an `ExceptionGroup` from the SDK's task groups: its first leaf)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
