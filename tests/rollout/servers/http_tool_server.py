"""A tool server speaking mrl's HTTP tool protocol (docs/tools.md), for the tests and the benchmark.

    start(simple=False) -> (server, url)      # in a daemon thread of this process
    python http_tool_server.py PORT           # standalone

Tools: `lookup(key)`, `add(a, b)`, `sleepy(seconds)`, `boom()` (answers {"error": ...}),
`bad_args` (HTTP 400 with {"error": ...}), `big(n)`, `crash()` (HTTP 500), `garbage()` (not
JSON). `simple=True` lists the schemas in the simple form ({name, description, parameters}) as
a bare list instead of OpenAI's form under "tools". `server.calls` counts the calls answered, `server.listings`
the tool listings, `server.headers` the last listing's request headers.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SECRETS = {"alpha": "7", "beta": "3", "gamma": "9"}

SCHEMAS = [
    {"name": "lookup", "description": "The secret digit stored under key.",
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    {"name": "add", "description": "a + b.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"]}},
    {"name": "sleepy", "description": "Sleeps, then answers.",
     "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}}},
    {"name": "boom", "description": "Always fails."},
    {"name": "bad_args", "description": "Rejects its arguments with HTTP 400."},
    {"name": "big", "description": "n characters.",
     "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    {"name": "crash", "description": "HTTP 500."},
    {"name": "garbage", "description": "Answers something that is not JSON."},
]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):   # quiet
        pass

    def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") != "/tools":
            return self._send(404, b'{"error": "not found"}')
        self.server.listings += 1
        self.server.headers = dict(self.headers)
        if self.server.simple:
            return self._send(200, json.dumps(SCHEMAS).encode())
        return self._send(200, json.dumps({"tools": [{"type": "function", "function": s} for s in SCHEMAS]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.rstrip("/") != "/call":
            return self._send(404, b'{"error": "not found"}')
        self.server.calls += 1
        name, args = body.get("name"), body.get("arguments") or {}
        if name == "lookup":
            key = args.get("key")
            reply = {"result": SECRETS[key]} if key in SECRETS else {"error": f"no secret named {key!r}"}
        elif name == "add":
            reply = {"result": args["a"] + args["b"]}
        elif name == "sleepy":
            time.sleep(float(args.get("seconds", 0)))
            reply = {"result": "awake"}
        elif name == "boom":
            reply = {"error": "the tool broke"}
        elif name == "bad_args":
            return self._send(400, b'{"error": "argument x is required"}')
        elif name == "big":
            reply = {"result": "x" * int(args["n"])}
        elif name == "crash":
            return self._send(500, b"internal error")
        elif name == "garbage":
            return self._send(200, b"<html>oops</html>", "text/html")
        else:
            reply = {"error": f"unknown tool {name!r}"}
        self._send(200, json.dumps(reply).encode())


class Server(ThreadingHTTPServer):
    request_queue_size = 128   # socketserver's 5 drops connections of a burst of parallel calls
    daemon_threads = True


def start(simple: bool = False, port: int = 0):
    """(server, base url): serving in a daemon thread until `server.shutdown()`."""
    server = Server(("127.0.0.1", port), Handler)
    server.handle_error = lambda request, address: None   # a client that gave up (timeout tests) is no news
    server.simple, server.calls, server.listings, server.headers = simple, 0, 0, {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    srv, url = start(port=int(sys.argv[1]))
    print(url, flush=True)
    threading.Event().wait()
