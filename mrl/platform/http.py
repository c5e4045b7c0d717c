"""The one HTTP client of mrl's network callers (remote rewards, HTTP judges, HTTP tool servers):
every request is bounded in time, in size and in where its headers go.

- **Total deadline.** `timeout_s` bounds the whole request, connect to last byte, redirects
  included: every socket operation waits at most what is left of it (httpcore's network backend,
  wrapped), so a body trickled a byte a second fails at the deadline, not one read timeout per byte.
- **Size cap.** The body is streamed and the request fails once it passes `max_bytes`; nothing
  beyond the cap is read.
- **No credentials across origins.** Redirects (301/302/303/307/308) are followed only within the
  request's origin (scheme, host and port), at most `MAX_REDIRECTS` times; a redirect to another
  origin is refused (`HTTPFailure` kind "redirect") rather than followed without its headers, so
  an `Authorization` header read from `header_env` never reaches a host the job did not name.
- **Bounded JSON.** `parse_json` refuses integers of more than `MAX_INT_DIGITS` digits and
  nesting deeper than `MAX_DEPTH` as a `ValueError`, so a hostile answer is a parse error the
  caller counts, never a traceback (Python's int-to-str limit and `RecursionError` are the causes).

Built on httpcore (httpx's transport; pinned in constraints.txt) rather than on urllib, whose
timeout bounds each read and whose redirect handler forwards every header. Proxies come from the
environment as urllib reads them (`HTTP(S)_PROXY`, `NO_PROXY`), and TLS peers are checked against
the system's certificate store as urllib checks them (`ssl.create_default_context`, which honours
`SSL_CERT_FILE` / `SSL_CERT_DIR`).
"""
from __future__ import annotations

import json
import ssl
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urljoin, urlsplit

import httpcore

MAX_REDIRECTS = 5
MAX_INT_DIGITS = 100   # an integer in an answer with more digits is a parse error
MAX_DEPTH = 64         # arrays/objects nested deeper are a parse error
_REDIRECTS = (301, 302, 303, 307, 308)


class HTTPFailure(Exception):
    """A request that got no usable answer. `kind`: "connection" (refused, reset, DNS, TLS),
    "timeout" (the total deadline passed), "too_large" (the body passed `max_bytes`) or "redirect"
    (to another origin, or too many)."""

    def __init__(self, kind: str, message: str, detail: str = ""):
        super().__init__(message)
        self.kind, self.detail = kind, detail or message


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    body: bytes
    url: str   # the URL that answered (after same-origin redirects)


class _Deadline:
    def __init__(self, timeout_s: float):
        self.timeout_s, self.end = timeout_s, time.monotonic() + timeout_s

    def left(self, timeout: Optional[float]) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout(f"deadline of {self.timeout_s:g} s passed")
        return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A socket stream whose every operation waits at most what is left of the deadline."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: _Deadline):
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        return self._inner.read(max_bytes, self._deadline.left(timeout))

    def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        self._inner.write(buffer, self._deadline.left(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, self._deadline.left(timeout)),
                       self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, deadline: _Deadline):
        self._inner, self._deadline = httpcore.SyncBackend(), deadline

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _Stream(self._inner.connect_tcp(host, port, self._deadline.left(timeout), local_address,
                                               socket_options), self._deadline)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _Stream(self._inner.connect_unix_socket(path, self._deadline.left(timeout), socket_options),
                       self._deadline)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(0.0, self._deadline.end - time.monotonic())))


def _origin(url: str) -> tuple[str, str, Optional[int]]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def _pool(url: str, deadline: _Deadline) -> httpcore.ConnectionPool:
    scheme, host, _ = _origin(url)
    proxy_url = urllib.request.getproxies().get(scheme)
    proxy = httpcore.Proxy(proxy_url) if proxy_url and not urllib.request.proxy_bypass(host) else None
    return httpcore.ConnectionPool(ssl_context=ssl.create_default_context(), proxy=proxy, max_connections=1, retries=0,
                                   network_backend=_Backend(deadline))


def _once(method: str, url: str, body: Optional[bytes], headers: dict, deadline: _Deadline,
          max_bytes: int, cut: bool) -> tuple[int, str, dict, bytes]:
    t = deadline.timeout_s
    with _pool(url, deadline) as pool, pool.stream(
            method, url, headers=list(headers.items()), content=body,
            extensions={"timeout": {"connect": t, "read": t, "write": t, "pool": t}}) as resp:
        got, chunks = 0, []
        for chunk in resp.iter_stream():
            got += len(chunk)
            if got > max_bytes:
                if cut:   # keep the first max_bytes + 1 bytes (the caller sees it was cut), read no more
                    chunks.append(chunk[:len(chunk) - (got - max_bytes - 1)])
                    break
                raise HTTPFailure("too_large", f"{url} answered with more than {max_bytes} bytes")
            chunks.append(chunk)
        reason = resp.extensions.get("reason_phrase", b"")
        head = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in resp.headers}
        return resp.status, reason.decode("latin-1", "replace"), head, b"".join(chunks)


def request(method: str, url: str, *, body: Optional[bytes] = None, headers: Optional[dict] = None,
            timeout_s: float, max_bytes: int, cut: bool = False) -> Reply:
    """One HTTP request, bounded as the module says: the `Reply` (any status), or `HTTPFailure`.
    `cut`: a body over `max_bytes` is not a failure but its first `max_bytes` + 1 bytes."""
    deadline = _Deadline(timeout_s)
    headers = dict(headers or {})
    start = url
    try:
        _origin(url)
    except ValueError as e:
        raise HTTPFailure("connection", f"{url}: not a valid URL ({e})") from None
    for _ in range(MAX_REDIRECTS + 1):
        try:
            status, reason, head, data = _once(method, url, body, headers, deadline, max_bytes, cut)
        except httpcore.TimeoutException:
            raise HTTPFailure("timeout", f"{start} did not answer within {timeout_s:g} s") from None
        except (httpcore.UnsupportedProtocol, httpcore.LocalProtocolError) as e:
            raise HTTPFailure("connection", f"{start}: {e}") from None
        except (httpcore.NetworkError, httpcore.RemoteProtocolError, httpcore.ProxyError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
            raise HTTPFailure("connection", f"{start} cannot be reached: {why}", why) from None
        if status not in _REDIRECTS or "location" not in head:
            return Reply(status, reason, data, url)
        try:
            target = urljoin(url, head["location"])
            elsewhere = _origin(target) != _origin(url)
        except ValueError:
            raise HTTPFailure("redirect", f"{start} redirected to an invalid URL {head['location'][:200]!r}") from None
        if elsewhere:
            raise HTTPFailure("redirect", f"{start} redirected to another origin ({_origin(target)[1]}); mrl follows "
                                          "redirects only within the URL's origin, so its headers never reach "
                                          "another host: give the final URL")
        if status == 303 or (status in (301, 302) and method == "POST"):
            method, body = "GET", None
            headers = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
        url = target
    raise HTTPFailure("redirect", f"{start} redirected more than {MAX_REDIRECTS} times")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits (more than {MAX_INT_DIGITS})")
    return int(text)


def _check_depth(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))


def parse_json(data: bytes | str) -> Any:
    """`data` decoded as JSON, or `ValueError` saying why not (not JSON or not UTF-8, an integer
    over `MAX_INT_DIGITS` digits, nesting over `MAX_DEPTH`)."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    _check_depth(value)
    return value
