"""The SmolLM2 chain_sum GRPO job in TRL's GRPOTrainer (run by tools/bench/peer_trl.py in TRL's own venv).

    TRL_VENV/bin/python tools/bench/trl_grpo_runner.py --model DIR --steps 3 --out result.json

Never imports mrl (TRL's venv does not have it). The settings mirror jobs/smollm2_chainsum_cpu.toml:
reasoning-gym chain_sum (2000 problems, seed 3, 2-3 terms of 1-2 digits), the job's system prompt
through the chat template, 8 prompts x 8 responses per step, 32 new tokens at temperature 1
(top-p 1, no top-k), GRPO advantages (group mean and std), the clipped objective with clip 0.2 /
0.28 and a token mean, no KL term, one optimizer step per batch (AdamW, lr 2e-5, no weight decay,
gradient clip 1.0), fp32 on the CPU. The reward is the job's own file (jobs/rewards/chain_sum.py).
Writes, per step, the wall time (a `TrainerCallback`), the part of it in TRL's
`_generate_and_score_completions` (generation, rewards, advantages), the rest as the update, and
TRL's logged mean reward.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "Compute the result. End with the final number inside <answer></answer> tags."


def _reward_fn():
    spec = importlib.util.spec_from_file_location("chain_sum_reward", REPO / "jobs" / "rewards" / "chain_sum.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def chain_sum(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [mod.score(None, t, a, {})["score"] for t, a in zip(texts, answer)]

    return chain_sum


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()

    import reasoning_gym
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = reasoning_gym.create_dataset("chain_sum", size=2000, seed=3, min_terms=2, max_terms=3, min_digits=1,
                                        max_digits=2)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": e["question"]}],
                               "answer": str(e["answer"])} for e in rows])
    wanted = dict(output_dir=str(args.work), max_steps=args.steps, learning_rate=2e-5, weight_decay=0.0,
                  max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
                  per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8,
                  max_completion_length=32, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
                  epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
                  logging_steps=1, report_to="none", save_strategy="no", seed=3, bf16=False, fp16=False,
                  use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(k for k in wanted if k not in fields)
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()
            generated.clear()

        def on_step_end(self, a, state, control, **kw):
            seconds = time.perf_counter() - self.t0
            steps.append({"step": state.global_step, "seconds": seconds, "generate": sum(generated),
                          "update": seconds - sum(generated)})

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])

    trainer = GRPOTrainer(model=model, reward_funcs=[_reward_fn()], args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Timer()])
    generate = trainer._generate_and_score_completions   # sampling, rewards, advantages: the rollout
    generated: list[float] = []

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generated.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed_generate
    started = time.perf_counter()
    trainer.train()
    import transformers
    import trl

    args.out.write_text(json.dumps({"steps": steps, "seconds": time.perf_counter() - started,
                                    "dropped_config": dropped, "threads": torch.get_num_threads(),
                                    "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                                 "torch": torch.__version__}}))


if __name__ == "__main__":
    sys.exit(main())
