"""Tool servers for multi-turn rollouts: HTTP endpoints (mrl's JSON protocol) and MCP servers
(stdio subprocess or streamable HTTP), listed in `[[rollout.multi_turn.servers]]` or in verl's
tool file (`rollout.multi_turn.tool_config`).

- base.py: the `ToolServer` interface, schema forms, the error kinds a call can end in.
- http_tools.py: `HTTPToolServer` (GET <url>/tools, POST <url>/call).
- mcp_tools.py: `MCPToolServer` and the `EventLoopThread` its sessions live on.
- verl_tool_config.py: verl's YAML tool file -> MCP servers; what does not map is refused.

`server_problems` checks a config without connecting (`mrl validate`); `connect_servers` connects
every server and lists its tools (at start, on the ranks that run tools). The `ToolRunner`
(mrl/rollout/tools.py) calls them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Optional

from mrl.errors import UserError

log = logging.getLogger(__name__)

KEY = "rollout.multi_turn.servers"


def _own_problems(i: int, s) -> list[tuple[str, str]]:
    at = f"{KEY}[{i}]"
    out = []
    if s.kind in ("http", "mcp_http"):
        if not s.url:
            out.append((f"{at}.url", f"server {s.name!r} (kind {s.kind}) needs a url"))
        elif not s.url.startswith(("http://", "https://")):
            out.append((f"{at}.url", f"{s.url!r} is not an http:// or https:// URL"))
        for key in ("command", "cwd"):
            if getattr(s, key) is not None:
                out.append((f"{at}.{key}", f"applies to kind 'mcp_stdio' only (server {s.name!r} is {s.kind})"))
        for key in ("args", "env"):
            if getattr(s, key):
                out.append((f"{at}.{key}", f"applies to kind 'mcp_stdio' only (server {s.name!r} is {s.kind})"))
    else:
        if not s.command:
            out.append((f"{at}.command", f"server {s.name!r} (kind mcp_stdio) needs a command"))
        for key in ("url",):
            if getattr(s, key) is not None:
                out.append((f"{at}.{key}", f"applies to kinds 'http' and 'mcp_http' (server {s.name!r} is mcp_stdio)"))
        for key in ("headers", "header_env"):
            if getattr(s, key):
                out.append((f"{at}.{key}", f"applies to kinds 'http' and 'mcp_http' (server {s.name!r} is mcp_stdio)"))
    return out


def server_specs(cfg) -> tuple[list[tuple[object, Optional[tuple[str, ...]], Optional[int]]], list[tuple[str, str]]]:
    """The servers of a `rollout.multi_turn` section, `[[servers]]` first then verl's tool file, as
    (ToolServerConfig, verl select list or None, verl entry index or None), and the problems."""
    from mrl.rollout.config import ToolServerConfig

    specs: list = [(s, None, None) for s in cfg.servers]
    problems = [p for i, s in enumerate(cfg.servers) for p in _own_problems(i, s)]
    if cfg.tool_config is not None:
        from mrl.rollout.tool_servers.verl_tool_config import KEY as VERL_KEY, verl_tool_servers

        found, lines = verl_tool_servers(cfg.tool_config)
        problems += [(VERL_KEY, line.removeprefix(f"{VERL_KEY}: ")) for line in lines]
        for v in found:
            s = ToolServerConfig(name=v.name, kind=v.kind, url=v.url, command=v.command, args=v.args, env=dict(v.env),
                                 cwd=v.cwd, headers=dict(v.headers))
            if v.ignored:
                log.info("%s: tools[%d]: %s ignored (no mrl counterpart; concurrency bounds calls in flight)",
                         VERL_KEY, v.entry, ", ".join(f"config.{k}" for k in v.ignored))
            if v.timeout_s is not None:
                s = replace(s, timeout_s=v.timeout_s)
            specs.append((s, v.select, v.entry))
    seen: dict[str, int] = {}
    for k, (s, _, entry) in enumerate(specs):
        if s.name in seen:
            where = KEY if entry is None else f"rollout.multi_turn.tool_config (mcpServers.{s.name})"
            problems.append((where, f"two tool servers are named {s.name!r}"))
        seen.setdefault(s.name, k)
    return specs, problems


def server_problems(cfg) -> list[tuple[str, str]]:
    """(key, problem) for each static problem of the servers of a `rollout.multi_turn` section."""
    return server_specs(cfg)[1]


def connect_servers(cfg) -> tuple[list, Optional[object]]:
    """Connect every server of `cfg` and list its tools: (servers, the MCP event loop thread or
    None). Any failure closes what was opened and raises one `UserError` line naming the server."""
    specs, problems = server_specs(cfg)
    if problems:
        key, message = problems[0]
        raise UserError(f"{key}: {message}")
    if not specs:
        return [], None
    loop = None
    servers: list = []
    try:
        for i, (s, _, _) in enumerate(specs):
            missing = [v for v in s.header_env.values() if v not in os.environ]
            if missing:
                raise UserError(f"{KEY}[{i}].header_env: server {s.name!r}: the environment variable "
                                f"{missing[0]!r} is not set")
            s = replace(s, headers={**s.headers, **{h: os.environ[v] for h, v in s.header_env.items()}})
            if s.kind == "http":
                from mrl.rollout.tool_servers.http_tools import HTTPToolServer

                servers.append(HTTPToolServer(s.name, s.url, allow=s.tools, headers=s.headers, timeout_s=s.timeout_s,
                                              connect_timeout_s=s.connect_timeout_s, concurrency=s.concurrency))
            else:
                from mrl.rollout.tool_servers.mcp_tools import EventLoopThread, MCPToolServer

                loop = loop or EventLoopThread()
                servers.append(MCPToolServer(s.name, s.kind, loop, url=s.url, command=s.command, args=s.args,
                                             env=s.env, cwd=s.cwd, headers=s.headers, allow=s.tools,
                                             timeout_s=s.timeout_s, connect_timeout_s=s.connect_timeout_s,
                                             concurrency=s.concurrency))
        _apply_verl_selection(specs, servers)
    except BaseException:
        close_servers(servers, loop)
        raise
    for server in servers:
        log.info("tool server %r: %d tool(s): %s", server.name, len(server.schemas), ", ".join(server.tool_names))
    return servers, loop


def _apply_verl_selection(specs, servers) -> None:
    """verl's tool_selected_list picks tools across every server of its entry."""
    entries: dict[int, list] = {}
    for (s, select, entry), server in zip(specs, servers):
        if select is not None:
            entries.setdefault(entry, []).append((select, server))
    for entry, group in entries.items():
        select = group[0][0]
        offered = {n for _, server in group for n in server.tool_names}
        missing = [n for n in select if n not in offered]
        if missing:
            raise UserError(f"rollout.multi_turn.tool_config: tools[{entry}]: tool_selected_list names "
                            f"{', '.join(map(repr, missing))}, which no server of the entry offers "
                            f"(they offer: {', '.join(sorted(offered)) or 'none'})")
        for _, server in group:
            server.schemas = [x for x in server.schemas if x["function"]["name"] in select]


def close_servers(servers, loop) -> None:
    """Close `servers`, then the MCP loop thread; bounded in time."""
    for server in servers:
        try:
            server.close()
        except Exception as e:   # noqa: BLE001 - closing continues with the others
            log.warning("tool server %r: close failed: %s", server.name, e)
    if loop is not None:
        loop.close()
