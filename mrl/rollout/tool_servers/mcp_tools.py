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
import threading
from typing import Any, Optional

from mrl.errors import UserError
from mrl.rollout.tool_servers.base import ServerError, ToolCallError, ToolServer, normalize_schema, select_tools

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


class MCPToolServer(ToolServer):
    """An MCP server (`kind` "mcp_stdio": `command` + `args` + `env`; "mcp_http": `url`), connected
    and listed on construction, its session held on `loop` until `close()`."""

    def __init__(self, name: str, kind: str, loop: EventLoopThread, *, url: Optional[str] = None,
                 command: Optional[str] = None, args: tuple[str, ...] = (), env: Optional[dict[str, str]] = None,
                 cwd: Optional[str] = None, headers: Optional[dict[str, str]] = None, allow: tuple[str, ...] = (),
                 timeout_s: float = 30.0, connect_timeout_s: float = 30.0, concurrency: int = 8):
        self.name, self.kind, self.loop = name, kind, loop
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.where = url if kind == "mcp_http" else " ".join([command or "", *args])
        self._target = self._transport(kind, url, command, args, env, cwd, headers)
        self._client = None
        self._closing: Optional[asyncio.Event] = None
        self._holder: Optional[concurrent.futures.Future] = None
        self._lost: Optional[str] = None   # why the session ended while in use
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._holder = loop.future(self._hold(ready))
        try:
            offered = ready.result(connect_timeout_s)
            self.schemas = select_tools(name, offered, allow)
        except concurrent.futures.TimeoutError:
            self.close()
            raise UserError(f"rollout.multi_turn.servers: MCP server {name!r} ({self.where}): no tool listing "
                            f"within connect_timeout_s = {connect_timeout_s:g} s") from None
        except BaseException as e:   # noqa: BLE001 - any failure to connect is the one line
            self.close()
            raise UserError(f"rollout.multi_turn.servers: MCP server {name!r} ({self.where}): cannot list its "
                            f"tools: {_describe(e)}") from None

    @staticmethod
    def _transport(kind, url, command, args, env, cwd, headers):
        if kind == "mcp_stdio":
            from mcp.client.stdio import StdioServerParameters

            return StdioServerParameters(command=command, args=list(args), env=dict(env or {}) or None, cwd=cwd)
        if headers:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            return streamable_http_client(url, http_client=create_mcp_http_client(headers=dict(headers)))
        return url

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        """Open the session, list the tools into `ready`, keep the session until `close()`."""
        from mcp import Client

        self._closing = asyncio.Event()
        try:
            async with Client(self._target) as client:
                offered, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    for tool in page.tools:
                        offered.append(normalize_schema({"name": tool.name, "description": tool.description or "",
                                                         "parameters": tool.input_schema}, "tools/list"))
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self._client = client
                if not ready.done():
                    ready.set_result(offered)
                await self._closing.wait()
        except BaseException as e:   # noqa: BLE001 - reported to the waiting constructor or to later calls
            self._client = None
            if not ready.done():
                ready.set_exception(e)
            elif self._closing is not None and not self._closing.is_set():
                self._lost = _describe(e)
                log.warning("tool server %r: MCP session lost: %s", self.name, self._lost)
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _call(self, tool: str, arguments: dict):
        client = self._client
        if client is None:
            raise ServerError(f"MCP session closed{': ' + self._lost if self._lost else ''}")
        return await client.call_tool(tool, arguments, read_timeout_seconds=self.timeout_s)

    def call(self, tool: str, arguments: dict, max_bytes: int) -> str:
        try:
            result = self.loop.submit(self._call(tool, arguments), self.timeout_s)
        except (TimeoutError, ServerError):
            raise
        except Exception as e:   # noqa: BLE001 - transport and protocol failures
            if "timed out" in str(e).lower():
                raise TimeoutError(str(e)) from None
            raise ServerError(_describe(e)) from None
        text = _text_of(result)
        if result.is_error:
            raise ToolCallError(text)
        return text

    def close(self) -> None:
        if self._closing is not None and not self._closing.is_set():
            self.loop.loop.call_soon_threadsafe(self._closing.set)
        if self._holder is not None:
            try:
                self._holder.result(CLOSE_TIMEOUT_S)
            except BaseException:   # noqa: BLE001 - a slow or failed exit; the loop's close cancels it
                self._holder.cancel()
            self._holder = None


def _describe(e: BaseException) -> str:
    """One line for an exception (an `ExceptionGroup` from the SDK's task groups: its first leaf)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
