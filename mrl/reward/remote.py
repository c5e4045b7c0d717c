"""Rewards from an HTTP service: batched JSON POSTs with a concurrency limit, timeouts and retries.

Request (one per `batch_size` responses; `Content-Type: application/json`):

    {"items": [{"id": "step 3 prompt 0 response 1", "prompt": ..., "response": "...",
                "ground_truth": ..., "data_source": "...", "extra": {...}}, ...]}

Response (HTTP 200), one entry per item, in order:

    {"scores": [1.0, {"score": 0.5, "acc": 0.0}, null, {"error": "why"}, ...]}

An entry is a number, or a table with the score under `reward.score_key` plus numbers to log
(as a reward function returns). `null` or `{"error": ...}` is that item's error ("service_item").
A request that fails after `retries` retries (waiting `backoff_s`, then twice that, ...) gives
each of its items an error of kind "connection" (refused, reset, DNS), "timeout", "http"
(status 4xx/5xx, or a redirect to another origin; 429 and 5xx are retried) or "bad_response"
(not JSON, an integer of more than 100 digits, nesting deeper than 64, an answer over
`MAX_RESPONSE_BYTES`, wrong length). `timeout_s` is each attempt's total deadline. Once a
request finds the service unreachable, the batch's remaining requests fail at once with the same
error instead of each waiting out its retries: a down service costs one request's retries, and
the Rewarder logs it as one line naming the URL (`compose._log_service_errors`).

`call_json` is the JSON-over-HTTP call shared with the judge's chat-completions calls, on
`mrl.platform.http` (total deadline, size cap, same-origin redirects only, bounded JSON).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mrl.platform import http
from mrl.reward.pool import Outcome

log = logging.getLogger(__name__)
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)
MAX_RESPONSE_BYTES = 64 << 20   # an answer's body is read up to this, then the request fails ("bad_response")


@dataclass(frozen=True)
class RequestError(Exception):
    """A request that failed for good: `kind` is the error counter, `message` one line."""

    kind: str
    message: str
    unreachable: bool = False   # the service cannot be reached at all: fail the rest fast
    status: int = 0             # the HTTP status of an "http" error (0: none)

    def __str__(self) -> str:
        return self.message


def _plain(value: Any) -> Any:
    """JSON for what json cannot encode (numpy arrays and scalars from parquet rows, else the text)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _post_once(url: str, body: bytes, headers: dict, timeout_s: float, max_bytes: int) -> Any:
    reply = http.request("POST", url, body=body, headers={"Content-Type": "application/json", **headers},
                         timeout_s=timeout_s, max_bytes=max_bytes)
    if reply.status >= 400:
        raise RequestError("http", f"{url} answered HTTP {reply.status} {reply.reason}".rstrip(), status=reply.status)
    if reply.status >= 300:
        raise RequestError("http", f"{url} answered HTTP {reply.status} {reply.reason} without a usable redirect")
    try:
        return http.parse_json(reply.body)
    except ValueError as e:
        raise RequestError("bad_response", f"{url} answered with something that is not usable JSON ({e}): "
                                           f"{reply.body[:80]!r}") from None


def call_json(url: str, payload: Any, *, timeout_s: float, retries: int, backoff_s: float,
              headers: dict | None = None, max_bytes: int = MAX_RESPONSE_BYTES,
              sleep: Callable[[float], None] = time.sleep) -> Any:
    """POST `payload` as JSON and return the decoded answer (`mrl.platform.http`: `timeout_s` is
    each attempt's total deadline, `max_bytes` caps its body, redirects stay within the origin);
    raises `RequestError` after `retries` retries of connection errors, timeouts and HTTP
    408/429/5xx. An answer over `max_bytes`, a cross-origin redirect or unusable JSON is not retried."""
    body = json.dumps(payload, default=_plain).encode()
    last: RequestError | None = None
    for attempt in range(retries + 1):
        if attempt:
            sleep(backoff_s * 2 ** (attempt - 1))
        try:
            return _post_once(url, body, headers or {}, timeout_s, max_bytes)
        except RequestError as e:
            if e.status not in RETRIED_STATUS:
                raise
            last = e
        except http.HTTPFailure as e:
            if e.kind == "too_large":
                raise RequestError("bad_response", str(e)) from None
            if e.kind == "redirect":
                raise RequestError("http", str(e)) from None
            last = RequestError(e.kind, str(e), unreachable=e.kind == "connection")
    raise RequestError(last.kind, f"{last.message} ({retries + 1} attempts)", last.unreachable)


def run_batches(batches: Sequence[Any], send: Callable[[Any], list[Outcome]], concurrency: int) -> list[list[Outcome]]:
    """`send(batch)` for every batch, `concurrency` at a time; a `RequestError` gives each item of
    its batch an error outcome, and an unreachable service fails the batches not yet sent."""
    down: list[RequestError] = []
    lock = threading.Lock()

    def one(batch) -> list[Outcome]:
        with lock:
            dead = down[0] if down else None
        if dead is not None:
            return [Outcome(error=dead.kind, message=dead.message)] * len(batch)
        try:
            return send(batch)
        except RequestError as e:
            if e.unreachable:
                with lock:
                    down.append(e)
            return [Outcome(error=e.kind, message=e.message)] * len(batch)

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(batches))), thread_name_prefix="mrl-remote") as ex:
        results = list(ex.map(one, batches))
    return results


def request_headers(cfg, environ=None) -> dict[str, str]:
    """`[reward.remote]`'s headers plus those read from the environment (`header_env`); a variable
    that is not set is a `UserError` naming it."""
    import os

    from mrl.errors import UserError

    environ = os.environ if environ is None else environ
    headers = dict(cfg.headers)
    for header, var in cfg.header_env.items():
        if var not in environ:
            raise UserError(f"reward.remote.header_env: the environment variable {var!r} (header {header!r}) is not set")
        headers[header] = environ[var]
    return headers


def _item(sample) -> dict:
    return {"id": str(sample.sample_id), "prompt": sample.prompt, "response": sample.response,
            "ground_truth": sample.ground_truth, "data_source": sample.data_source, "extra": sample.extra}


def _entry(entry: Any) -> Outcome:
    if entry is None:
        return Outcome(error="service_item", message="the service returned null for this response")
    if isinstance(entry, dict) and "error" in entry:
        return Outcome(error="service_item", message=f"the service says: {str(entry['error'])[:200]}")
    return Outcome(value=entry)


class RemoteScorer:
    """Scores samples with the service at `url` (`[reward.remote]` options); returns one `Outcome`
    per sample, values read by the Rewarder like a reward function's."""

    def __init__(self, url: str, *, batch_size: int = 16, concurrency: int = 8, timeout_s: float = 30.0,
                 retries: int = 2, backoff_s: float = 0.5, headers: dict | None = None):
        self.url, self.batch_size, self.concurrency = url, batch_size, concurrency
        self.timeout_s, self.retries, self.backoff_s, self.headers = timeout_s, retries, backoff_s, dict(headers or {})

    @classmethod
    def from_config(cls, url: str, cfg) -> "RemoteScorer":
        return cls(url, batch_size=cfg.batch_size, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s,
                   retries=cfg.retries, backoff_s=cfg.backoff_s, headers=request_headers(cfg))

    def budget_s(self, responses: int) -> float:
        """The longest a call for `responses` responses takes (every request retried to the end)."""
        waves = -(-max(responses, 1) // self.batch_size) / self.concurrency
        per_request = (self.retries + 1) * self.timeout_s + self.backoff_s * (2 ** self.retries)
        return (int(waves) + 1) * per_request

    def _send(self, batch: list) -> list[Outcome]:
        started = time.monotonic()
        answer = call_json(self.url, {"items": [_item(s) for s in batch]}, timeout_s=self.timeout_s,
                           retries=self.retries, backoff_s=self.backoff_s, headers=self.headers)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(batch):
            got = f"{len(scores)} scores" if isinstance(scores, list) else "no 'scores' list"
            raise RequestError("bad_response", f"{self.url} answered {got} for {len(batch)} responses")
        seconds = time.monotonic() - started
        return [Outcome(value=o.value, error=o.error, message=o.message, seconds=seconds) for o in map(_entry, scores)]

    def __call__(self, samples: Sequence) -> list[Outcome]:
        batches = [list(samples[i:i + self.batch_size]) for i in range(0, len(samples), self.batch_size)]
        results = run_batches(batches, self._send, self.concurrency)
        return [o for batch in results for o in batch]
