"""Server mode (vLLM AsyncLLM) against SPMD (vLLM in-process, external_launcher) on one model.

Usage: python vllm_server_checks.py MODEL_DIR (a plain process: a gloo world of one for SPMD).
Builds both engines once, runs every check and prints one `RESULT {json}` line that
tests/rollout/test_vllm_server.py reads (one launch shared by its tests):
- greedy: the same prompts through SPMD `generate` and through `ServerRollout.generate` (one
  coroutine per trajectory): token ids and log-probs;
- weights: a perturbed copy of the model streamed into the server as pause -> update -> resume
  (and into SPMD); then each engine's teacher-forced log-probs of fixed sequences against the
  transformers forward of the streamed weights (the trainer's numbers), and the server's weights
  read back by HF name;
- abort: a long request aborted mid-generation returns the tokens it had, finish "abort".
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time


def main(model_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mrl.rollout.agent_loop import AgentRunner, single_turn
    from mrl.rollout.async_engine import GenRequest
    from mrl.rollout.router import Router
    from mrl.rollout.server import ServerRollout
    from mrl.rollout.types import Sampling
    from mrl.rollout.vllm_async import LoopThread, VLLMAsyncEngine
    from mrl.rollout.vllm_engine import VLLMEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MRL_TEST_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=64 * 2**20,
              load_format="auto", bucket_mb=0.25)
    out: dict = {}
    t0 = time.perf_counter()
    spmd = VLLMEngine(model_dir, seed=0, **kw)
    loop = LoopThread()
    engine = VLLMAsyncEngine(model_dir, loop=loop, seed=0, **kw)
    server = ServerRollout([engine], loop, AgentRunner(Router([engine]), single_turn))
    out["start_s"] = time.perf_counter() - t0

    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 300, 301], [1, 42, 43, 44, 45, 46]]
    greedy = Sampling(n=1, temperature=0.0, max_tokens=16, ignore_eos=True)
    a, b = spmd.generate(prompts, greedy), server.generate(prompts, greedy)
    out["greedy_ids_spmd"] = [r.token_ids for r in a]
    out["greedy_ids_server"] = [r.token_ids for r in b]
    out["greedy_logprob_max_diff"] = max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r.logprobs, s.logprobs))
    out["server_busy"] = server.last.engine_busy

    # weights: a perturbed copy, streamed as the trainer would (full HF-named tensors)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    tied = hf.config.tie_word_embeddings
    stream = [(k, v) for k, v in state.items() if not (tied and k == "lm_head.weight")]
    out["sent"] = server.update_weights(iter(stream))
    spmd.update_weights(iter(stream))
    seqs = [p + r.token_ids for p, r in zip(prompts, a)]
    with torch.no_grad():
        trainer = []
        for s in seqs:
            logits = hf(torch.tensor([s])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            trainer.append([float(lp[t - 1, s[t]]) for t in range(1, len(s))])
    for name, eng in (("server", server), ("spmd", spmd)):
        got = eng.sequence_logprobs(seqs)
        out[f"{name}_vs_trainer_after_update"] = max(abs(x - y) for g, t in zip(got, trainer) for x, y in zip(g, t))
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    out["readback_max_diff"] = max(float((t - state[n]).abs().max()) for n, t in server.held_weights(names))
    after_a, after_b = spmd.generate(prompts, greedy), server.generate(prompts, greedy)
    out["greedy_equal_after_update"] = [r.token_ids for r in after_a] == [r.token_ids for r in after_b]

    # abort: a long request returns what it had
    async def aborted():
        req = GenRequest("long", (1, 5, 6), Sampling(temperature=0.0, max_tokens=250, ignore_eos=True))
        task = asyncio.ensure_future(engine.generate(req))
        while True:
            await asyncio.sleep(0.05)
            if engine.llm.get_num_unfinished_requests():
                break
        await asyncio.sleep(0.1)
        await engine.abort(["long"])
        return await task

    res = loop.run(aborted())
    out["abort_reason"], out["abort_tokens"] = res.finish_reason, len(res.token_ids)
    out["total_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out), flush=True)
    server.shutdown()
    spmd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
