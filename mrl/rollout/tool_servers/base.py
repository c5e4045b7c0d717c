"""What every tool server offers the `ToolRunner`: tool schemas listed at start, and calls.

A server is connected (and its tools listed) when it is built; a build that fails raises
`UserError` naming the server, so an unreachable server or a bad listing is one line at start.
`call` returns the tool's text or raises one of the errors below; the runner turns each into a
tool message the model sees and counts it by kind.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any


class ToolCallError(Exception):
    """The tool ran and reported a failure (bad arguments, an exception in the tool): its message
    is what the model sees."""


class ServerError(Exception):
    """The server did not answer the call properly: refused or dropped connection, HTTP 5xx, a
    malformed reply, a server process that died."""


def function_schema(name: str, description: str, parameters: dict | None) -> dict:
    """A tool schema in the OpenAI function-tool form chat templates take (`tools=`)."""
    params = parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": params}}


def normalize_schema(entry: Any, where: str) -> dict:
    """`entry` as an OpenAI function-tool schema. Accepted forms: the OpenAI one
    (`{"type": "function", "function": {name, description, parameters}}`) and the simple one
    (`{name, description, parameters}`; `input_schema` / `inputSchema` as MCP spells it are read as
    `parameters`). Raises `ValueError` saying what is wrong (the caller names the server)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a tool entry must be an object, got {type(entry).__name__}")
    body = entry.get("function") if entry.get("type") == "function" else entry
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        raise ValueError(f"{where}: a tool entry needs a non-empty string 'name': {json.dumps(entry)[:200]}")
    params = next((body[k] for k in ("parameters", "input_schema", "inputSchema") if k in body), None)
    if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
        raise ValueError(f"{where}: tool {body['name']!r}: parameters must be a JSON-schema object")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"{where}: tool {body['name']!r}: description must be a string")
    return function_schema(body["name"], description, params)


class ToolServer(ABC):
    """A connected tool server: `schemas` (listed at start, after the allowlist), `call`, `close`.

    `timeout_s` bounds one call; `concurrency` bounds the calls in flight to this server;
    `restart_s` bounds a `revive()` (0 for servers that never restart)."""

    name: str
    timeout_s: float
    restart_s: float = 0.0
    concurrency: int
    schemas: list[dict]

    @property
    def tool_names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    @abstractmethod
    def call(self, tool: str, arguments: dict, max_bytes: int) -> str:
        """The tool's answer as text (at most `max_bytes` + 1 bytes of it need be read: the runner
        truncates); raises `ToolCallError`, `ServerError` or `TimeoutError`."""

    def revive(self) -> bool:
        """Called before each call: reconnect a server that an earlier call found dead, if it is
        allowed to; True when this call restarted it (raises `ServerError` when the restart failed).
        Servers without a session (HTTP: one request per call) have nothing to restart."""
        return False

    def close(self) -> None:
        """Release connections and processes; bounded in time, safe to call twice."""


def select_tools(server: str, offered: list[dict], allow: tuple[str, ...]) -> list[dict]:
    """The schemas of `allow` (all when empty) among `offered`, in the server's order; a name in
    `allow` the server does not offer is a `ValueError` listing what it offers."""
    names = [s["function"]["name"] for s in offered]
    missing = [a for a in allow if a not in names]
    if missing:
        raise ValueError(f"server {server!r} offers no tool {', '.join(map(repr, missing))} "
                         f"(it offers: {', '.join(names) or 'none'})")
    return [s for s in offered if not allow or s["function"]["name"] in allow]
