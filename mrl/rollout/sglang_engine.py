"""SGLang (pinned 0.5.23) as a server-mode engine: `SGLangEngine` implements `AsyncEngine` over
SGLang's native HTTP API. docs/sglang.md lists every endpoint it uses, where each shape comes from in
SGLang's source, and what has never run against a real SGLang server.

Requests are token ids in, token ids out (`skip_tokenizer_init`): `POST /generate` with `input_ids`,
`sampling_params`, `return_logprob` and our `rid`; the response's `output_ids` and
`meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples) become `GenResult`, its
`meta_info.finish_reason.type` ("stop", "length", "abort") the finish reason. `POST /abort_request`
with a `rid` ends a running request, whose `/generate` then answers with the tokens so far and
finish type "abort" (`tokenizer_manager.py: _handle_abort_req`). Weights: `sglang_weights.py`.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import weakref
from typing import Optional, Sequence

import httpx

from mrl.rollout.async_engine import AsyncEngine, GenRequest, GenResult
from mrl.rollout.engine import WeightStream, buckets
from mrl.rollout.sglang_server import ServerProcess
from mrl.rollout.types import Sampling

log = logging.getLogger(__name__)
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """The SGLang server failed a request, answered outside its contract, or died."""


def sampling_params(sampling: Sampling, seed: Optional[int]) -> dict:
    """`GenerateReqInput.sampling_params` (fields of `sglang/srt/sampling/sampling_params.py:
    SamplingParams`; the JSON contract `sglang/api/v1/api_types.py: SamplingParams` rejects any
    other key). Temperature 0 is greedy there too (it becomes top_k = 1); top_k -1 is the whole
    vocabulary. `no_stop_trim`: the stop token stays the last output id, as mrl's responses keep it
    (without it the detokenizer drops a matched stop token id: `trim_matched_stop`)."""
    params = {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
              "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
              "repetition_penalty": sampling.repetition_penalty, "ignore_eos": sampling.ignore_eos,
              "no_stop_trim": True}
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def generate_body(request: GenRequest) -> dict:
    """The `/generate` body (`io_struct.GenerateReqInput`) of one request."""
    return {"rid": request.request_id, "input_ids": list(request.prompt_ids),
            "sampling_params": sampling_params(request.sampling, request.seed),
            "return_logprob": True, "stream": False}


def parse_generate(request_id: str, out: dict, engine: str = "sglang engine") -> GenResult:
    """A `/generate` answer (`api_types.GenerateResponse`) as a GenResult; SGLangError when it does
    not hold what we asked for (logprobs for every output token, a known finish type)."""
    meta = out.get("meta_info") or {}
    ids = out.get("output_ids")
    entries = meta.get("output_token_logprobs")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    if not isinstance(ids, list) or not isinstance(entries, list) or kind not in _FINISH:
        if kind == "abort" and ids is None:   # aborted before its first token
            ids, entries = [], []
        else:
            raise SGLangError(f"{engine}: request {request_id} answered without output_ids, output_token_logprobs "
                              f"or a known finish_reason: {str(out)[:200]}")
    if len(entries) != len(ids) or any(e[1] != t for e, t in zip(entries, ids)):
        raise SGLangError(f"{engine}: request {request_id}: output_token_logprobs ({len(entries)}) do not match "
                          f"output_ids ({len(ids)})")
    version = meta.get("weight_version")
    return GenResult(request_id=request_id, token_ids=[int(t) for t in ids],
                     logprobs=[float(e[0]) for e in entries], finish_reason=_FINISH[kind],
                     weight_version=int(version) if isinstance(version, str) and version.isdigit() else None,
                     info={"finish": reason, "prompt_tokens": meta.get("prompt_tokens"),
                           "cached_tokens": meta.get("cached_tokens")})


class SGLangEngine(AsyncEngine):
    """One SGLang server (tp workers of its own) behind SGLang's HTTP API.

    `server`: the launched process (None: a server someone else runs at `url`, never stopped
    here). `transport`: "tensor" (`update_weights_from_tensor`, same node) or "distributed"
    (`update_weights_from_distributed` over a process group we join as rank 0, `group_backend`).
    `logprobs_mode`: the log-probs the server reports, fixed at launch (raw:
    `SGLANG_RETURN_ORIGINAL_LOGPROB`); a request asking for the other kind is refused.
    `max_connections`: requests in flight to the server at once (more wait in the client's pool).
    `expected_names`: the model's HF parameter names (`sglang_sync.checkpoint_parameter_names`),
    which a full sync must all send. `sleep_level`: what the server was launched for (0: no memory
    saver, 1: a CPU copy of the weights while asleep, 2: none).
    """

    def __init__(self, url: str, *, server: Optional[ServerProcess] = None, tp: int = 1,
                 transport: str = "tensor", bucket_mb: float = 512, group_backend: str = "nccl",
                 request_timeout_s: float = 3600.0, update_timeout_s: float = 600.0, name: str = "sglang",
                 expected_names: Optional[set[str]] = None, logprobs_mode: str = "processed_logprobs",
                 max_connections: int = 1024, sleep_level: int = 1):
        if transport not in ("tensor", "distributed"):
            raise ValueError(f"unknown weight transport {transport!r}")
        self.url, self.server, self.tp, self.transport = url.rstrip("/"), server, tp, transport
        self.bucket_mb, self.group_backend, self.name = bucket_mb, group_backend, name
        self.request_timeout_s, self.update_timeout_s = request_timeout_s, update_timeout_s
        self.expected_names = expected_names   # HF names a full sync must cover (None: unchecked)
        self.logprobs_mode = logprobs_mode     # what the server was launched to report
        self.max_connections = max_connections
        self.sleep_level = sleep_level         # the memory saver's launch flags (rollout.sleep_level)
        self.version = 0             # weight syncs loaded (sent as the server's weight_version)
        self._group = None           # our side of the update group (distributed transport)
        self._group_name = "mrl_weight_update"
        self._http = httpx.Client(timeout=update_timeout_s)
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # event loop -> its AsyncClient
        self._asleep: set[str] = set()

    # ---- errors ---------------------------------------------------------------------------

    @property
    def who(self) -> str:
        return f"{self.name} engine at {self.url}"

    def _failure(self, what: str, err: Exception | str) -> SGLangError:
        """One line naming the engine, the call, and the server's death when that is the cause."""
        if self.server is not None and isinstance(err, Exception) and self.server.alive():
            try:   # a dropped connection: give a dying server a moment to be reported as dead
                self.server.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        dead = self.server.death() if self.server is not None else None
        if isinstance(err, Exception):
            err = f"{type(err).__name__}: {err}"
        return SGLangError(f"{self.who}: {what} failed: " + (dead or err))

    def _check(self, what: str, response: httpx.Response) -> httpx.Response:
        if response.status_code != 200:
            raise self._failure(what, f"HTTP {response.status_code}: {response.text[:300]}")
        return response

    # ---- async request API ------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
            client = self._clients[loop] = httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits)
        return client

    async def aclose(self) -> None:
        """Close the connections of the running event loop's client (before that loop ends)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def _post(self, path: str, body: dict, what: str) -> httpx.Response:
        try:
            response = await self._client().post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as e:
            raise self._failure(what, e) from None
        return self._check(what, response)

    async def generate(self, request: GenRequest) -> GenResult:
        s = request.sampling
        if s.logprobs_mode != self.logprobs_mode or (s.logprobs_mode == "processed_logprobs" and s.truncates):
            raise SGLangError(f"{self.who}: request {request.request_id} asks for {s.logprobs_mode}"
                              + (" of a top-k/top-p/min-p truncated distribution, which sglang does not report"
                                 if s.logprobs_mode == self.logprobs_mode else
                                 f"; the server was launched to report {self.logprobs_mode}"))
        response = await self._post("/generate", generate_body(request), f"/generate {request.request_id}")
        return parse_generate(request.request_id, response.json(), self.who)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """`/abort_request` (`io_struct.AbortReq`: `rid`, `abort_all`) for each id; an id that has
        already finished is ignored by the server."""
        await asyncio.gather(*(self._post("/abort_request", {"rid": rid, "abort_all": False}, f"/abort_request {rid}")
                               for rid in request_ids))

    async def pause(self, *, abort_running: bool = False) -> None:
        """`/pause_generation` (`io_struct.PauseGenerationReqInput.mode`): "abort" returns the
        running requests as aborted; "retract" puts them back in the waiting queue, recomputed
        from their tokens after `continue_generation` (so the KV cache may be flushed between)."""
        await self._post("/pause_generation", {"mode": "abort" if abort_running else "retract"}, "/pause_generation")

    async def resume(self) -> None:
        await self._post("/continue_generation", {"torch_empty_cache": True}, "/continue_generation")

    # ---- weights ----------------------------------------------------------------------------

    def _post_sync(self, path: str, body: Optional[dict], what: str) -> httpx.Response:
        try:
            response = self._http.post(f"{self.url}{path}", json=body)
        except httpx.HTTPError as e:
            raise self._failure(what, e) from None
        response = self._check(what, response)
        if response.headers.get("content-type", "").startswith("application/json"):
            answer = response.json()
            if isinstance(answer, dict) and answer.get("success") is False:
                raise self._failure(what, answer.get("message", "success = false"))
        return response

    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Deliver whole HF tensors bucket by bucket (`rollout.weight_sync.bucket_mb`), then flush
        the prefix cache (its KV was computed with the old weights). `partial` changes nothing:
        SGLang loads whatever tensors arrive and keeps the others (a delta sync); a full sync that
        sent nothing for a parameter of `expected_names` is an error."""
        version = str(self.version + 1)
        sent: list[str] = []
        pending = None   # the bucket before: the last one carries the new weight_version
        for bucket in buckets(weights, self.bucket_mb):
            if pending is not None:
                self._send_bucket(pending, None)
            pending = bucket
            sent += [name for name, _ in bucket]
        if pending is not None:
            self._send_bucket(pending, version)
        missing = sorted(self.expected_names - set(sent)) if self.expected_names and not partial else []
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise SGLangError(f"{self.who}: the weight sync ({len(sent)} tensors) sent nothing "
                              f"for {len(missing)} parameter(s): {shown}")
        self._post_sync("/flush_cache", None, "/flush_cache after a weight update")
        self.version += 1
        return len(sent)

    def _send_bucket(self, bucket: list, version: Optional[str]) -> None:
        from mrl.rollout import sglang_weights as sw

        if self.transport == "tensor":
            body, held = sw.tensor_update_request(bucket, self.tp, weight_version=version)
            what = f"/update_weights_from_tensor ({bucket[0][0]} .. {bucket[-1][0]})"
            self._post_sync("/update_weights_from_tensor", body, what)
            del held   # the server has loaded them
            return
        if self._group is None:
            self._join_group()
        body = sw.distributed_update_request(bucket, self._group_name, weight_version=version)
        what = f"/update_weights_from_distributed ({bucket[0][0]} .. {bucket[-1][0]})"
        sw.while_posting(lambda: self._post_sync("/update_weights_from_distributed", body, what),
                         lambda: sw.broadcast_bucket(bucket, self._group))

    def _join_group(self) -> None:
        from mrl.rollout import sglang_weights as sw
        from mrl.rollout.sglang_server import free_port

        host = httpx.URL(self.url).host
        address = "127.0.0.1" if host in ("localhost", "127.0.0.1") else host_address()
        port = free_port("0.0.0.0")
        body = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": self.tp + 1,
                "group_name": self._group_name, "backend": self.group_backend}
        box = {}

        def join():
            box["group"] = sw.join_update_group(address, port, self.tp + 1, self._group_name, self.group_backend,
                                                self.update_timeout_s)

        sw.while_posting(lambda: self._post_sync("/init_weights_update_group", body, "/init_weights_update_group"), join)
        self._group = box["group"]

    # ---- memory -----------------------------------------------------------------------------

    def sleep(self, level: Optional[int] = None) -> None:
        """`/release_memory_occupation` of the weights and the KV cache (`io_struct.
        ReleaseMemoryOccupationReqInput.tags`); whether the weights survive (a CPU copy) was fixed at
        launch (`enable_weights_cpu_backup`, from rollout.sleep_level). Level 0, or a server
        launched at level 0 (no memory saver): nothing."""
        if level == 0 or self.sleep_level == 0:
            return
        if level is not None and level != self.sleep_level:
            raise SGLangError(f"{self.who}: sleep level {level} asked of a server launched for level "
                              f"{self.sleep_level} (whether it keeps a CPU copy of the weights is fixed at launch)")
        tags = ["kv_cache", "weights"]
        self._post_sync("/release_memory_occupation", {"tags": tags}, "/release_memory_occupation")
        self._asleep.update(tags)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """`/resume_memory_occupation` of `tags` ("weights", "kv_cache"; all when None) that are asleep."""
        wanted = [t for t in (tags or ("weights", "kv_cache")) if t in self._asleep]
        if wanted:
            self._post_sync("/resume_memory_occupation", {"tags": wanted}, "/resume_memory_occupation")
            self._asleep.difference_update(wanted)

    def shutdown(self) -> None:
        if self._group is not None:
            try:
                self._post_sync("/destroy_weights_update_group", {"group_name": self._group_name},
                                "/destroy_weights_update_group")
            except SGLangError as e:
                log.warning("%s", e)
            from mrl.rollout.sglang_weights import destroy_update_group

            destroy_update_group(self._group)
            self._group = None
        self._http.close()
        self._clients.clear()   # connections of loops that did not `aclose` go with their loops
        if self.server is not None:
            self.server.stop()
            self.server = None


def host_address() -> str:
    """This host's address as the server's workers can reach it (the update group's store)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
