"""Tools behind an HTTP endpoint, in mrl's small JSON protocol (docs/tools.md):

    GET  <url>/tools  ->  {"tools": [schema, ...]}   (or the bare list)
    POST <url>/call   {"name": "lookup", "arguments": {"key": "alpha"}}
                      ->  {"result": "7"}             (a non-string result is sent back as its JSON)
                      or  {"error": "no such key"}    (the tool failed: the model sees the message)

A schema is OpenAI's function-tool form (`{"type": "function", "function": {name, description,
parameters}}`) or the simple `{name, description, parameters}` one. A 4xx answer carrying
`{"error": ...}` is a tool error too; a refused connection, a 5xx or a reply that is not this JSON
is a server error. Calls are plain HTTP/1.1 requests (stdlib `urllib`), one connection each, with
the server's timeout on the connect and on every read.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from mrl.errors import UserError
from mrl.rollout.tool_servers.base import ServerError, ToolCallError, ToolServer, normalize_schema, select_tools

LISTING_LIMIT = 8 << 20   # bytes of a tool listing read at most


def _read(resp, limit: int) -> bytes:
    return resp.read(limit + 1)


class HTTPToolServer(ToolServer):
    """A server speaking the protocol above at `url` (connected and listed on construction)."""

    def __init__(self, name: str, url: str, *, allow: tuple[str, ...] = (), headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 30.0, concurrency: int = 8):
        self.name, self.url = name, url.rstrip("/")
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        try:
            body = self._request("GET", "/tools", None, connect_timeout_s, LISTING_LIMIT)
            listing = json.loads(body)
            entries = listing.get("tools") if isinstance(listing, dict) else listing
            if not isinstance(entries, list):
                raise ValueError("GET /tools must answer {\"tools\": [...]} or a list of tool schemas")
            offered = [normalize_schema(e, f"tools[{i}]") for i, e in enumerate(entries)]
            self.schemas = select_tools(name, offered, allow)
        except (ServerError, TimeoutError, ToolCallError, ValueError) as e:
            raise UserError(f"rollout.multi_turn.servers: server {name!r} ({self.url}): cannot list its tools: {e}") from None

    def _request(self, method: str, path: str, payload: Any, timeout_s: float, limit: int) -> bytes:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return _read(resp, limit)
        except urllib.error.HTTPError as e:
            body = e.read(limit + 1) if e.fp is not None else b""
            if 400 <= e.code < 500:
                message = _error_of(body)
                if message is not None:
                    raise ToolCallError(message) from None
            raise ServerError(f"HTTP {e.code} {e.reason}") from None
        except (socket.timeout, TimeoutError):
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise TimeoutError(f"no answer within {timeout_s:g} s") from None
            raise ServerError(f"cannot reach {self.url}: {e.reason}") from None
        except (ConnectionError, OSError) as e:   # reset or closed mid-answer
            raise ServerError(f"{type(e).__name__}: {e}") from None

    def call(self, tool: str, arguments: dict, max_bytes: int) -> str:
        limit = 2 * max_bytes + 4096   # room for the JSON around (and escapes inside) a result of max_bytes
        body = self._request("POST", "/call", {"name": tool, "arguments": arguments}, self.timeout_s, limit)
        if len(body) > limit:   # cut mid-JSON: pass on the start of the result's text (the runner cuts it)
            text = body.decode(errors="replace")
            head = text.split('"result"', 1)[-1].lstrip(' :"')
            return head if len(head.encode()) > max_bytes else text
        try:
            reply = json.loads(body)
        except ValueError:
            raise ServerError(f"the reply is not JSON: {body[:120]!r}") from None
        if isinstance(reply, dict) and "error" in reply and reply["error"] is not None:
            raise ToolCallError(str(reply["error"]))
        if not isinstance(reply, dict) or "result" not in reply:
            raise ServerError(f"the reply has neither 'result' nor 'error': {body[:120]!r}")
        result = reply["result"]
        return result if isinstance(result, str) else json.dumps(result)


def _error_of(body: bytes) -> str | None:
    try:
        reply = json.loads(body)
    except ValueError:
        return None
    return str(reply["error"]) if isinstance(reply, dict) and reply.get("error") is not None else None
