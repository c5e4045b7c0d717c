"""Server-mode engines across processes: a leader's engine behind a small HTTP channel
(`EngineServer`), and the driver's client of it (`RemoteEngine`), so one `Router` spreads
trajectories over engine groups whose leaders are different processes (`rollout.router =
"driver"`, docs/async.md).

Why HTTP on the leader's own event loop (aiohttp): a server-mode engine is an asyncio object on
its leader's `LoopThread`, and its traffic is per request and asynchronous (a trajectory's turn
arrives whenever its tools return; an abort must reach the one request it names, while others
keep generating). torch.distributed is synchronous and collective, so it cannot carry that
traffic; an aiohttp server on the same loop can, without a second thread or process, and the
engine stays the leader's (its weights, sleep and wake are loaded there, as with one router per
leader).

The channel (JSON bodies; Python's JSON writes floats exactly, so log-probs arrive bit for bit;
token ids in, token ids out, never text):
- `POST /generate` `{"requests": [{id, prompt_ids, sampling, seed}, ...]}`: the engine gets the
  requests in this order (a client sends every request its loop produced in one iteration as one
  batch, so a remote engine admits them as a local one would); the response streams one JSON
  line per request as it ends (`GenResult`: token ids, log-probs, finish reason, weight version),
  or `{"id", "error"}` when the engine raised.
- `POST /abort` `{"ids": [...]}`: those requests end with `finish_reason = "abort"` and the
  tokens they have; an id aborted before it arrives returns at once with no tokens.
- `POST /pause` `{"abort_running": bool}`, `POST /resume`: the engine's own.
Every call carries the job's channel token (`X-Mrl-Token`, drawn on the driver and sent to the
leaders over the process group); any other caller gets 403. Request ids are prefixed on the
server (`remote:`), so they never meet the leader's own requests (its validation) in the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from mrl.rollout.async_engine import GenRequest, GenResult
from mrl.rollout.types import Sampling

TOKEN_HEADER = "X-Mrl-Token"
PREFIX = "remote:"


def encode_request(r: GenRequest) -> dict:
    s = asdict(r.sampling)
    s["stop_token_ids"] = list(s["stop_token_ids"])
    return {"id": r.request_id, "prompt_ids": list(r.prompt_ids), "sampling": s, "seed": r.seed}


def decode_request(d: dict) -> GenRequest:
    s = dict(d["sampling"])
    s["stop_token_ids"] = tuple(s["stop_token_ids"])
    return GenRequest(str(d["id"]), tuple(int(t) for t in d["prompt_ids"]), Sampling(**s), seed=d.get("seed"))


def encode_result(r: GenResult) -> dict:
    return {"id": r.request_id, "token_ids": list(r.token_ids), "logprobs": [float(x) for x in r.logprobs],
            "finish_reason": r.finish_reason, "weight_version": r.weight_version, "info": r.info}


def decode_result(d: dict) -> GenResult:
    return GenResult(d["id"], [int(t) for t in d["token_ids"]], [float(x) for x in d["logprobs"]],
                     d["finish_reason"], d.get("weight_version"), dict(d.get("info") or {}))


def reachable_host(peer: Optional[str]) -> str:
    """This machine's address as `peer` (the job's rendezvous host) reaches it: the local end of a
    UDP socket pointed at it (nothing is sent); 127.0.0.1 when the peer is this machine."""
    if not peer or peer in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


@dataclass
class ServedLog:
    """What a leader's channel served: request ids (the client's) in arrival order, and those that
    ended aborted (reported in the leader's log and read by tests)."""

    received: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)


class EngineServer:
    """A leader's engine (`AsyncEngine`) behind the channel (module docstring), on the engine's
    event loop. `start` (a coroutine, run on that loop) binds `host:port` (0: a free port) and
    returns the URL clients use."""

    def __init__(self, engine, token: str):
        self.engine, self.token = engine, token
        self.log = ServedLog()
        self._aborted: set[str] = set()     # client ids aborted (early aborts return at once)
        self._runner = None
        self.url: Optional[str] = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, advertise: Optional[str] = None) -> str:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort", self._abort)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{advertise or host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _check(self, request) -> None:
        from aiohttp import web

        # constant-time: the token is the channel's only credential
        if not hmac.compare_digest(request.headers.get(TOKEN_HEADER, "").encode(), self.token.encode()):
            raise web.HTTPForbidden(text="wrong or missing channel token")

    async def _generate(self, request):
        from aiohttp import web

        self._check(request)
        body = await request.json()
        reqs = [decode_request(d) for d in body["requests"]]
        self.log.received += [r.request_id for r in reqs]
        tasks = {}
        for r in reqs:   # created in order: the engine enqueues them in the client's order
            tasks[asyncio.ensure_future(self._one(r))] = r.request_id
        pending = set(tasks)
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                lines = []
                for t in done:
                    try:
                        res = t.result()
                        if res.finish_reason == "abort":
                            self.log.aborted.append(res.request_id)
                        lines.append(json.dumps(encode_result(res)))
                    except Exception as e:   # the engine's error goes to the caller of that request
                        lines.append(json.dumps({"id": tasks[t], "error": f"{type(e).__name__}: {e}"}))
                await response.write(("\n".join(lines) + "\n").encode())
        finally:   # the client went away: nothing of this batch keeps generating
            if pending:
                await self.engine.abort([PREFIX + tasks[t] for t in pending])
                for t in pending:
                    t.cancel()
        await response.write_eof()
        return response

    async def _one(self, r: GenRequest) -> GenResult:
        if r.request_id in self._aborted:
            self._aborted.discard(r.request_id)
            return GenResult(r.request_id, [], [], "abort")
        out = await self.engine.generate(GenRequest(PREFIX + r.request_id, r.prompt_ids, r.sampling, r.seed))
        self._aborted.discard(r.request_id)
        return GenResult(r.request_id, out.token_ids, out.logprobs, out.finish_reason, out.weight_version, out.info)

    async def _abort(self, request):
        from aiohttp import web

        self._check(request)
        ids = [str(i) for i in (await request.json())["ids"]]
        self._aborted.update(ids)
        await self.engine.abort([PREFIX + i for i in ids])
        return web.json_response({"ok": True})

    async def _pause(self, request):
        from aiohttp import web

        self._check(request)
        await self.engine.pause(abort_running=bool((await request.json()).get("abort_running", False)))
        return web.json_response({"ok": True})

    async def _resume(self, request):
        from aiohttp import web

        self._check(request)
        await self.engine.resume()
        return web.json_response({"ok": True})


class RemoteEngineError(RuntimeError):
    pass


class RemoteEngine:
    """The driver's handle on another leader's engine: `generate`, `abort`, `pause`, `resume` as
    the router calls them on a local engine, over the channel (module docstring). Its weights,
    sleep and wake belong to its leader, which loads them in its own process."""

    def __init__(self, url: str, token: str, name: str, *, timeout_s: Optional[float] = None):
        self.url, self.token, self.name, self.timeout_s = url.rstrip("/"), token, name, timeout_s
        self._session = None
        self._batch: list[tuple[GenRequest, asyncio.Future]] = []
        self._flushing = False
        self._tasks: set = set()

    def _client(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers={TOKEN_HEADER: self.token},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=30))
        return self._session

    async def generate(self, request: GenRequest) -> GenResult:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._batch.append((request, future))
        if not self._flushing:   # every request of this loop iteration goes in one batch, in order
            self._flushing = True
            loop.call_soon(self._flush)
        try:
            return await future
        except asyncio.CancelledError:   # its trajectory was cancelled: stop it on the leader
            self._spawn(self._abort_quietly(request.request_id))
            raise

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _flush(self) -> None:
        batch, self._batch, self._flushing = self._batch, [], False
        batch = [(r, f) for r, f in batch if not f.done()]
        if batch:
            self._spawn(self._send(batch))

    async def _send(self, batch) -> None:
        futures = {r.request_id: f for r, f in batch}
        try:
            async with self._client().post(self.url + "/generate",
                                           json={"requests": [encode_request(r) for r, _ in batch]}) as resp:
                if resp.status != 200:
                    raise RemoteEngineError(f"{self.name} ({self.url}) answered {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if not line.strip():
                        continue
                    d = json.loads(line)
                    f = futures.pop(d["id"], None)
                    if f is None or f.done():
                        continue
                    if "error" in d:
                        f.set_exception(RemoteEngineError(f"{self.name}: request {d['id']}: {d['error']}"))
                    else:
                        f.set_result(decode_result(d))
            if futures:
                raise RemoteEngineError(f"{self.name} ({self.url}) closed the stream with "
                                        f"{len(futures)} request(s) unanswered")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            err = e if isinstance(e, RemoteEngineError) else RemoteEngineError(
                f"{self.name} ({self.url}): {type(e).__name__}: {e}")
            for f in futures.values():
                if not f.done():
                    f.set_exception(err)

    async def _abort_quietly(self, request_id: str) -> None:
        """Best effort for a cancelled caller: nobody waits for the answer (a leader that is gone
        fails the step through its other requests)."""
        try:
            await self._post("/abort", {"ids": [request_id]})
        except Exception:
            pass

    async def _post(self, path: str, body: dict) -> None:
        async with self._client().post(self.url + path, json=body) as resp:
            if resp.status != 200:
                raise RemoteEngineError(f"{self.name} ({self.url}{path}) answered {resp.status}: {await resp.text()}")

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        for r, f in self._batch:   # not sent yet: they never reach the leader
            if r.request_id in ids and not f.done():
                f.set_result(GenResult(r.request_id, [], [], "abort"))
        await self._post("/abort", {"ids": sorted(ids)})

    async def pause(self, *, abort_running: bool = False) -> None:
        await self._post("/pause", {"abort_running": abort_running})

    async def resume(self) -> None:
        await self._post("/resume", {})

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
