"""Tools behind an HTTP endpoint, in mrl's small JSON protocol (docs/tools.md):

    GET  <url>/tools  ->  {"tools": [schema, ...]}   (or the bare list)
    POST <url>/call   {"name": "lookup", "arguments": {"key": "alpha"}}
                      ->  {"result": "7"}             (a non-string result is sent back as its JSON)
                      or  {"error": "no such key"}    (the tool failed: the model sees the message)

A schema is OpenAI's function-tool form (`{"type": "function", "function": {name, description,
parameters}}`) or the simple `{name, description, parameters}` one. A 4xx answer carrying
`{"error": ...}` is a tool error too; a refused connection, a 5xx or a reply that is not this JSON
is a server error, and so is an answer over its size cap (the listing: 8 MiB; a call: twice the
runner's `max_result_bytes` plus 4 KiB) or one that redirects to another origin. Requests go
through `mrl.platform.http`: the server's timeout (`connect_timeout_s` for the listing) is the
total deadline of each request, not of each read.
"""
from __future__ import annotations

import json
from typing import Any

from mrl.errors import UserError
from mrl.platform import http
from mrl.rollout.tool_servers.base import ServerError, ToolCallError, ToolServer, normalize_schema, select_tools

LISTING_LIMIT = 8 << 20   # bytes of a tool listing read at most


class HTTPToolServer(ToolServer):
    """A server speaking the protocol above at `url` (connected and listed on construction)."""

    def __init__(self, name: str, url: str, *, allow: tuple[str, ...] = (), headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 30.0, concurrency: int = 8):
        self.name, self.url = name, url.rstrip("/")
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        try:
            body = self._request("GET", "/tools", None, connect_timeout_s, LISTING_LIMIT)
            listing = http.parse_json(body)
            entries = listing.get("tools") if isinstance(listing, dict) else listing
            if not isinstance(entries, list):
                raise ValueError("GET /tools must answer {\"tools\": [...]} or a list of tool schemas")
            offered = [normalize_schema(e, f"tools[{i}]") for i, e in enumerate(entries)]
            self.schemas = select_tools(name, offered, allow)
        except (ServerError, TimeoutError, ToolCallError, ValueError) as e:
            raise UserError(f"rollout.multi_turn.servers: server {name!r} ({self.url}): cannot list its tools: {e}") from None

    def _request(self, method: str, path: str, payload: Any, timeout_s: float, limit: int, cut: bool = False) -> bytes:
        """The body of a 2xx answer, read up to `limit` bytes (one byte more tells the caller it was
        cut); 4xx with `{"error": ...}` is a `ToolCallError`, other statuses and failures a
        `ServerError`, the deadline a `TimeoutError`."""
        data = None if payload is None else json.dumps(payload).encode()
        try:
            reply = http.request(method, self.url + path, body=data, headers=self.headers, timeout_s=timeout_s,
                                 max_bytes=limit, cut=cut)
        except http.HTTPFailure as e:
            if e.kind == "timeout":
                raise TimeoutError(f"no answer within {timeout_s:g} s") from None
            if e.kind == "connection":
                raise ServerError(f"cannot reach {self.url}: {e.detail}") from None
            raise ServerError(str(e)) from None
        if 400 <= reply.status < 500:
            message = _error_of(reply.body)
            if message is not None:
                raise ToolCallError(message)
        if not 200 <= reply.status < 300:
            raise ServerError(f"HTTP {reply.status} {reply.reason}".rstrip())
        return reply.body

    def call(self, tool: str, arguments: dict, max_bytes: int) -> str:
        limit = 2 * max_bytes + 4096   # room for the JSON around (and escapes inside) a result of max_bytes
        body = self._request("POST", "/call", {"name": tool, "arguments": arguments}, self.timeout_s, limit,
                             cut=True)
        if len(body) > limit:   # cut mid-JSON: pass on the start of the result's text (the runner cuts it)
            text = body.decode(errors="replace")
            head = text.split('"result"', 1)[-1].lstrip(' :"')
            return head if len(head.encode()) > max_bytes else text
        try:
            reply = http.parse_json(body)
        except ValueError as e:
            raise ServerError(f"the reply is not usable JSON ({e}): {body[:120]!r}") from None
        if isinstance(reply, dict) and "error" in reply and reply["error"] is not None:
            raise ToolCallError(str(reply["error"]))
        if not isinstance(reply, dict) or "result" not in reply:
            raise ServerError(f"the reply has neither 'result' nor 'error': {body[:120]!r}")
        result = reply["result"]
        return result if isinstance(result, str) else json.dumps(result)


def _error_of(body: bytes) -> str | None:
    try:
        reply = http.parse_json(body)
    except ValueError:
        return None
    return str(reply["error"]) if isinstance(reply, dict) and reply.get("error") is not None else None
