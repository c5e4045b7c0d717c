"""A hostile HTTP server on 127.0.0.1 for the network clients' tests: each connection is answered
by `server.respond(conn, head)`, which writes raw bytes (slow, huge, malformed, redirecting), so
the tests see what a real socket gives the client. Records every request's head and how many
bytes were sent."""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Optional


class HostileServer:
    def __init__(self, respond: Optional[Callable] = None):
        self.respond = respond or (lambda conn, head: send_reply(conn, 200, b"{}"))
        self.heads: list[bytes] = []
        self.sent = 0
        self.stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 1 << 16:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            self.heads.append(head)
            self.respond(self, conn, head)
        except OSError:
            pass
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        self._sock.close()

    def got_header(self, name: bytes) -> bool:
        return any(line.lower().startswith(name.lower() + b":") for h in self.heads for line in h.split(b"\r\n"))


def head_bytes(status: int, length: Optional[int], extra: dict | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Connection: close", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def send_reply(server: HostileServer, conn, status: int = 200, body: bytes = b"{}", extra: dict | None = None) -> None:
    server.send(conn, head_bytes(status, len(body), extra) + body)


def reply(status: int = 200, body: bytes = b"{}", extra: dict | None = None) -> Callable:
    return lambda server, conn, head: send_reply(server, conn, status, body, extra)


def trickle(body: bytes, delay_s: float, *, in_head: bool = False) -> Callable:
    """The answer one byte every `delay_s` (the head too when `in_head`), until the client hangs up."""
    def respond(server, conn, head):
        data = head_bytes(200, len(body)) + body
        start = 0 if in_head else len(data) - len(body)
        server.send(conn, data[:start])
        for i in range(start, len(data)):
            if server.stop.is_set():
                return
            time.sleep(delay_s)
            server.send(conn, data[i:i + 1])
    return respond


def huge(total: int, chunk: int = 1 << 16, *, declared: bool = True) -> Callable:
    """A body of `total` bytes (declared in Content-Length or not), sent until the client hangs up."""
    def respond(server, conn, head):
        server.send(conn, head_bytes(200, total if declared else None))
        block = b"7" * chunk
        for _ in range(total // chunk):
            if server.stop.is_set():
                return
            server.send(conn, block)
    return respond


def redirect(location: str, status: int = 302) -> Callable:
    return reply(status, b"", {"Location": location})
