"""The httpx2 client of MCP's streamable-HTTP transport, with each message capped in size.

The SDK reads a JSON answer whole (`response.aread()`); its own cap covers SSE events only. This
client's transport fails a response body (`httpx2.StreamError` naming `stdio_cap.TOO_LARGE`) once
a line of it (a JSON body, or a line of an SSE stream) passes the cap, reading nothing past it;
the SDK turns that into the call's JSON-RPC error, which `MCPToolServer.call` reports as a server
error. Redirects: the SDK follows them only within the endpoint's origin, whatever the client
says, so its headers do not reach another host.
"""
from __future__ import annotations

import httpx2
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from mrl.rollout.tool_servers.stdio_cap import TOO_LARGE


class CappedStream(httpx2.AsyncByteStream):
    """A response body that fails once a line of it passes `limit` bytes."""

    def __init__(self, inner, limit: int):
        self._inner, self._limit = inner, limit

    async def __aiter__(self):
        run = 0   # bytes since the last newline
        async for chunk in self._inner:
            first = chunk.find(b"\n")
            if (run + len(chunk) if first < 0 else run + first) > self._limit:
                raise httpx2.StreamError(f"{TOO_LARGE} {self._limit} bytes (mrl's cap on one MCP message)")
            run = run + len(chunk) if first < 0 else len(chunk) - chunk.rfind(b"\n") - 1
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int):
        self._inner, self._limit = inner, limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        response.stream = CappedStream(response.stream, self._limit)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def capped_client(headers: dict | None, limit: int) -> httpx2.AsyncClient:
    """An AsyncClient as the SDK's own (its timeouts), `headers` on every request, bodies capped."""
    return httpx2.AsyncClient(headers=dict(headers or {}),
                              timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
                              transport=CappedTransport(httpx2.AsyncHTTPTransport(), limit))
