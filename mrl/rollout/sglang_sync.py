"""The SGLang engine under the synchronous `RolloutEngine` interface, its launch from a job, and what
the SGLang path refuses.

`SGLangRolloutEngine.generate` sends every sample of a batch as its own request, concurrently, on an
event loop of its own (the server batches them continuously) and returns them prompt-major as the
other engines do; `sequence_logprobs` (teacher-forced log-probs) asks `/generate` for the prompt's own
log-probs (`logprob_start_len = 0`, no new token: `meta_info.input_token_logprobs`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

from mrl.errors import UserError
from mrl.rollout.async_engine import GenRequest
from mrl.rollout.engine import RolloutEngine
from mrl.rollout.sglang_engine import SGLangEngine, SGLangError
from mrl.rollout.types import Response, Sampling, prompt_seed, resolve_prompt_seeds


def sglang_problems(rollout, *, return_routes: bool = False) -> list[tuple[str, str]]:
    """Every setting the SGLang path does not honour, as (key, one line)."""
    out = []
    truncates = rollout.do_sample and (rollout.top_k > 0 or rollout.top_p < 1 or rollout.min_p > 0)
    if rollout.logprobs_mode == "processed_logprobs" and truncates:
        out.append(("rollout.logprobs_mode", "sglang reports log-probs of the tempered distribution before top-k/top-p/"
                                             "min-p (sglang/srt/layers/sampler.py), not the processed ones; use "
                                             "'raw_logprobs' or no truncation"))
    if rollout.repetition_penalty > 2:
        out.append(("rollout.repetition_penalty", f"{rollout.repetition_penalty} is above sglang's limit of 2"))
    for key, value, default in (("pipeline_parallel", rollout.pipeline_parallel, 1),
                                ("expert_parallel", rollout.expert_parallel, False),
                                ("quantization", rollout.quantization, None),
                                ("cudagraph_capture_sizes", rollout.cudagraph_capture_sizes, None)):
        if value != default:
            out.append((f"rollout.{key}", f"is {value} but the sglang engine does not pass it on (set "
                                          f"{default}; sglang's own flags go in rollout.sglang.server_args)"))
    if rollout.engine_kwargs:
        out.append(("rollout.engine_kwargs", "are vLLM's; sglang server flags go in rollout.sglang.server_args"))
    if return_routes:
        out.append(("actor.moe.routing_replay", "'r3' needs the engine's routes; the sglang engine does not "
                                                "return them"))
    return out


def colocated_problems(rollout, trainer_tensor_parallel: int) -> list[tuple[str, str]]:
    """Colocated, each model-parallel leader launches one server on its GPU and the next
    `rollout.tensor_parallel - 1`, which must be its own tensor-parallel peers (else servers overlap)."""
    if rollout.placement == "colocated" and rollout.tensor_parallel > trainer_tensor_parallel:
        return [("rollout.tensor_parallel", f"{rollout.tensor_parallel} is above parallel.tensor "
                                            f"{trainer_tensor_parallel}: a colocated sglang server spans its model-"
                                            "parallel leader's GPU and the next ones, which would overlap the "
                                            "next group's server")]
    return []


def weight_transport(rollout) -> str:
    """`rollout.sglang.weight_transport`, "auto" resolved: tensors by IPC colocated, a process
    group to separate rollout ranks."""
    chosen = rollout.sglang.weight_transport
    if chosen != "auto":
        return chosen
    return "distributed" if rollout.placement == "separate" else "tensor"


def checkpoint_parameter_names(hf_config: dict) -> Optional[set[str]]:
    """The HF checkpoint names of every parameter of the model `hf_config` describes (built on the
    meta device; per-expert names for `transformers`' fused experts; a tied head has none): what a
    full sync must cover. None when `transformers` cannot build it (remote code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.rollout.hf_experts import checkpoint_name, fused_expert_views

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "architectures"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError, TypeError):
        return None
    views = fused_expert_views(model, model_type)
    fused = {id(p) for _, p in views.values()}
    return {checkpoint_name(n, model_type) for n, p in model.named_parameters() if id(p) not in fused} | set(views)


def launch(rollout, model_path: str, *, seed: int, dtype: str, device, max_model_len: int,
           trust_remote_code: bool = False, log_dir: Optional[str] = None,
           hf_config: Optional[dict] = None) -> "SGLangRolloutEngine":
    """Start the job's SGLang server on this rank's GPU and the next `rollout.tensor_parallel - 1`
    (indices among the visible devices, which the server inherits) and wait until it generates."""
    from mrl.rollout.sglang_server import ServerProcess, free_port, server_command

    problems = sglang_problems(rollout)
    if problems:
        raise UserError(f"{problems[0][0]}: {problems[0][1]}")
    cfg = rollout.sglang
    dev = torch.device(device)
    host = "127.0.0.1"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    port = cfg.port_base + local if cfg.port_base else free_port(host)
    command = server_command(
        cfg.python or sys.executable, model_path, host=host, port=port, tp=rollout.tensor_parallel, dtype=dtype,
        seed=seed, mem_fraction=rollout.gpu_memory_utilization, context_length=max_model_len,
        max_running_requests=rollout.max_num_seqs,
        chunked_prefill_size=rollout.max_num_batched_tokens if rollout.enable_chunked_prefill else -1,
        load_format=rollout.load_format, base_gpu_id=dev.index or 0, sleep_level=rollout.sleep_level,
        disable_cuda_graph=rollout.enforce_eager, disable_radix_cache=not rollout.enable_prefix_caching,
        trust_remote_code=trust_remote_code, extra=dict(cfg.server_args))
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1" if rollout.logprobs_mode == "raw_logprobs" else "0"}
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mrl-sglang-"))
    server = ServerProcess(command, url=f"http://{host}:{port}", log_path=logs / f"sglang-{local}.log", env=env)
    server.wait_healthy(cfg.launch_timeout_s)
    check_version(server)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    engine = SGLangEngine(server.url, server=server, tp=rollout.tensor_parallel, transport=weight_transport(rollout),
                          bucket_mb=rollout.weight_sync.bucket_mb, group_backend=backend,
                          request_timeout_s=rollout.generate_timeout_s,
                          expected_names=checkpoint_parameter_names(hf_config) if hf_config else None,
                          logprobs_mode=rollout.logprobs_mode, max_connections=rollout.max_num_seqs,
                          sleep_level=rollout.sleep_level)
    return SGLangRolloutEngine(engine, timeout_s=rollout.generate_timeout_s)


def check_version(server) -> None:
    """The server runs the SGLang release this client is built against (`/server_info`'s "version")."""
    import httpx

    from mrl.rollout.sglang_server import SGLANG_VERSION

    try:
        version = httpx.get(f"{server.url}/server_info", timeout=30).json().get("version")
    except (httpx.HTTPError, ValueError) as e:
        version = f"unknown ({e})"
    if version != SGLANG_VERSION:
        server.stop()
        raise UserError(f"rollout.sglang.python: the server runs sglang {version}; mrl's sglang engine is built "
                        f"against sglang=={SGLANG_VERSION} (install that version there)")


class SGLangRolloutEngine(RolloutEngine):
    """`RolloutEngine` over an `SGLangEngine`: batches become concurrent requests."""

    def __init__(self, engine: SGLangEngine, *, timeout_s: float = 3600.0):
        self.engine = engine
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mrl-sglang-loop", daemon=True)
        self._thread.start()
        self._calls = 0

    def _run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise SGLangError(f"{self.engine.who}: a batch ran longer than "
                              f"rollout.generate_timeout_s = {self.timeout_s:g} s") from None

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None) -> list[Response]:
        seeds = resolve_prompt_seeds(sampling, len(prompt_token_ids), prompt_seeds)
        one = dataclasses.replace(sampling, n=1)
        self._calls += 1
        requests = [GenRequest(request_id=f"mrl-{id(self):x}-{self._calls}-{i}-{j}", prompt_ids=tuple(ids),
                               sampling=one, seed=None if seeds[i] is None else prompt_seed(seeds[i], j))
                    for i, ids in enumerate(prompt_token_ids) for j in range(sampling.n)]

        async def run_all():
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))

        out = []
        for k, result in enumerate(self._run(run_all())):
            if result.finish_reason == "abort":
                raise SGLangError(f"{self.engine.who}: request {result.request_id} was "
                                  f"aborted by the server: {result.info.get('finish')}")
            out.append(Response(prompt_index=k // sampling.n, token_ids=result.token_ids, logprobs=result.logprobs,
                                finish_reason=result.finish_reason))
        return out

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """`meta_info.input_token_logprobs` of each sequence (first entry None: no context)."""
        async def one(i, ids):
            body = {"rid": f"mrl-score-{id(self):x}-{self._calls}-{i}", "input_ids": list(ids), "return_logprob": True,
                    "logprob_start_len": 0, "stream": False,
                    "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
            response = await self.engine._post("/generate", body, f"/generate (scoring) {body['rid']}")
            entries = (response.json().get("meta_info") or {}).get("input_token_logprobs")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise SGLangError(f"{self.engine.who}: scoring sequence {i} returned "
                                  f"{'no' if entries is None else len(entries)} input log-probs for {len(ids)} tokens")
            return [float(e[0]) for e in entries[1:]]

        self._calls += 1

        async def run_all():
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(token_ids)))

        return self._run(run_all())

    def update_weights(self, weights, *, partial: bool = False) -> int:
        return self.engine.update_weights(weights, partial=partial)

    def held_weights(self, names):
        """SGLang 0.5.23 reads weights back only per model, truncated (`/get_weights_by_name`, "only
        used for unit test"), so every tensor is checked on arrival only."""
        for name in names:
            yield name, None

    def sleep(self, level: Optional[int] = None) -> None:
        self.engine.sleep(level)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        self.engine.wake(tags)

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.engine.aclose())
        finally:
            self.engine.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
