"""The SFT engine loss of a job's first examples vs a plain `transformers` cross-entropy.

Run as `python sft_loss.py JOB [overrides]` (one rank) or under torchrun (TP/DP): builds the job's
model and examples as `mrl sft` does, accumulates the step's loss over several packed
micro-batches (no update), and on rank 0 prints `RESULT {"engine": ..., "hf": ..., "tokens": ...}`
where `hf` is the token-mean cross-entropy of `AutoModelForCausalLM` on the same examples, masked
to the same tokens.
"""
import json
import sys

import torch


def main():
    from mrl.config.loader import load
    from mrl.sft.data import to_batch
    from mrl.sft.loop import build, _pad_id
    from mrl.sft.objective import SFTObjective

    spec, _ = load(sys.argv[1], sys.argv[2:])
    run = build(spec)
    n = spec.sft.examples_per_step
    examples = run.train.examples[:n]
    per = n // run.ctx.dp
    mine = examples[run.ctx.dp_rank * per:(run.ctx.dp_rank + 1) * per]
    batch = to_batch(mine, _pad_id(run.tokenizer))
    m = run.engine.forward_backward(batch, SFTObjective(vocab_size=run.hf["vocab_size"]),
                                    micro_batch_tokens=spec.sft.micro_batch_tokens)
    if run.ctx.rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=torch.float32).eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for ex in examples:
                ids = torch.tensor([ex.prompt_ids + ex.response_ids])
                labels = torch.tensor([[-100] * len(ex.prompt_ids) +
                                       [t if k else -100 for t, k in zip(ex.response_ids, ex.loss_mask)]])
                logits = hf(ids).logits[0, :-1].double()
                target = labels[0, 1:]
                total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
                tokens += int((target != -100).sum())
        print("RESULT " + json.dumps({"engine": m["loss"], "hf": total / tokens, "tokens": tokens,
                                      "micro_batches": m["micro_batches"]}), flush=True)
    from mrl.platform import teardown

    teardown()


if __name__ == "__main__":
    main()
