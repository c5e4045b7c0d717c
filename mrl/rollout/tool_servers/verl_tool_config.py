"""verl's tool file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) as mrl tool servers.

verl's YAML lists tools by class (verl/tools/utils/tool_registry.py):

    tools:
      - class_name: verl.tools.mcp_search_tool.MCPSearchTool
        config: {type: mcp, timeout: 60, rate_limit: 10}
        mcp:
          mcp_servers_config_path: ./mcp_servers.json     # {"mcpServers": {name: {...}}}
          tool_selected_list: [tavily_search]             # optional allowlist
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {...}}

An `mcp` entry maps: each server of its JSON file becomes an MCP server (`command` + `args` +
`env` + `cwd`: stdio; `url`: streamable HTTP, `auth_token` as a bearer header, `headers` kept),
`tool_selected_list` the allowlist across them, `config.timeout` the call timeout. What does not
map is refused, one line per entry: `native` entries (a Python class with verl's per-trajectory
`create/execute/calc_reward/release` lifecycle, which mrl does not run), `benchmax`, and MCP
servers reached over the legacy SSE transport. `rate_limit` has no mrl counterpart (each server's
`concurrency` bounds its calls in flight) and is ignored with a log line.
Relative paths in the file are taken against the file's directory, then the working directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY = "rollout.multi_turn.tool_config"


@dataclass(frozen=True)
class VerlServer:
    """One MCP server from a verl tool file; `select` is its entry's tool_selected_list (None: all),
    applied across every server of that entry; `ignored`: verl settings without an mrl counterpart."""

    name: str
    kind: str
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    select: tuple[str, ...] | None = None
    entry: int = 0
    ignored: tuple[str, ...] = ()


def _near(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return base / p if (base / p).exists() or not p.exists() else p


def verl_tool_servers(path: str) -> tuple[list[VerlServer], list[str]]:
    """(servers, problems) of verl tool file `path`; each problem is one line naming the file and entry."""
    import yaml

    where = f"{KEY}: {path}"
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        return [], [f"{where}: no such file"]
    except (OSError, yaml.YAMLError) as e:
        return [], [f"{where}: cannot read it: {str(e).splitlines()[0]}"]
    tools = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(tools, list):
        return [], [f"{where}: expected verl's form, a top-level `tools:` list"]
    servers, problems = [], []
    for i, entry in enumerate(tools):
        at = f"{where}: tools[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{at}: must be a table with class_name and config")
            continue
        cls = entry.get("class_name", "?")
        config = entry.get("config") if isinstance(entry.get("config"), dict) else {}
        kind = config.get("type", "native")
        if kind == "native":
            problems.append(f"{at} ({cls}): a verl native tool class; mrl does not run verl's tool classes: name a "
                            "Python function in rollout.multi_turn.tools, or serve the tool over HTTP or MCP "
                            "([[rollout.multi_turn.servers]], docs/tools.md)")
            continue
        if kind != "mcp":
            problems.append(f"{at} ({cls}): config.type {kind!r} is not supported (mrl maps verl's 'mcp' entries)")
            continue
        mcp = entry.get("mcp") if isinstance(entry.get("mcp"), dict) else {}
        file = mcp.get("mcp_servers_config_path")
        if not isinstance(file, str):
            problems.append(f"{at} ({cls}): an mcp entry needs mcp.mcp_servers_config_path")
            continue
        select = mcp.get("tool_selected_list")
        if select is not None and not (isinstance(select, list) and all(isinstance(s, str) for s in select)):
            problems.append(f"{at}: mcp.tool_selected_list must be a list of tool names")
            continue
        timeout = config.get("timeout")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            problems.append(f"{at}: config.timeout must be a positive number of seconds")
            continue
        ignored = tuple(k for k in ("rate_limit",) if k in config)
        found, more = _servers_file(_near(file, Path(path).resolve().parent), f"{at}: {file}")
        problems += more
        servers += [VerlServer(**{**s, "timeout_s": None if timeout is None else float(timeout),
                                  "select": None if select is None else tuple(select), "entry": i, "ignored": ignored})
                    for s in found]
    return servers, problems


def _servers_file(path: Path, where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The servers of an MCP servers JSON file (`{"mcpServers": {name: {...}}}`) as VerlServer fields."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return [], [f"{where}: no such file"]
    except (OSError, ValueError) as e:
        return [], [f"{where}: cannot read it: {e}"]
    table = doc.get("mcpServers") if isinstance(doc, dict) else None
    if not isinstance(table, dict) or not table:
        return [], [f"{where}: expected {{\"mcpServers\": {{name: {{command|url: ...}}}}}}"]
    out, problems = [], []
    for name, s in table.items():
        at = f"{where}: mcpServers.{name}"
        if not isinstance(s, dict):
            problems.append(f"{at}: must be an object")
            continue
        transport = str(s.get("transport", s.get("type", ""))).lower()
        if "command" in s:
            args, env = s.get("args", []), s.get("env", {})
            if not isinstance(s["command"], str) or not isinstance(args, list) or not isinstance(env, dict):
                problems.append(f"{at}: command must be a string, args a list, env an object")
                continue
            out.append({"name": name, "kind": "mcp_stdio", "command": s["command"], "args": tuple(map(str, args)),
                        "env": tuple((str(k), str(v)) for k, v in env.items()), "cwd": s.get("cwd")})
        elif isinstance(s.get("url"), str):
            if transport == "sse" or s["url"].rstrip("/").endswith("/sse"):
                problems.append(f"{at}: the legacy SSE transport is not supported; mrl speaks streamable HTTP "
                                "(an MCP endpoint such as http://host:8000/mcp)")
                continue
            headers = dict(s.get("headers") or {})
            if "auth_token" in s:
                headers["Authorization"] = f"Bearer {s['auth_token']}"
            out.append({"name": name, "kind": "mcp_http", "url": s["url"],
                        "headers": tuple((str(k), str(v)) for k, v in headers.items())})
        else:
            problems.append(f"{at}: needs a command (stdio) or a url (streamable HTTP)")
    return out, problems
