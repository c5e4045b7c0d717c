"""Weight sync into vLLM engine groups inside `mrl train`'s components, proven by log-probs.

Usage: torchrun --nproc_per_node 2 vllm_loop_sync.py JOB [key=value ...]

Builds the job's components (trainer + vLLM engine groups), then on every rank:
1. sync, then the engine's teacher-forced log-probs of fixed sequences == the trainer's (<= 1e-4);
2. one training step (rollout on the engine groups, update); its step-1 audit is near 0;
3. sync of the updated weights: the engine follows the trainer again (<= 1e-4) and has moved;
4. a stream carrying the wrong TP shard of one tensor (halves swapped) is caught (> 1e-3);
5. an empty stream, or one missing a tensor, is refused by `update_weights`.
Prints `rank R ok ...` at the end.
"""
from __future__ import annotations

import sys

import torch


def main(job: str, overrides: list[str]) -> None:
    from mrl.batch import Batch
    from mrl.config.loader import load
    from mrl.train.build import build, close
    from mrl.train.colocated import ColocatedRollouts
    from mrl.train.engine_sync import sync_weights as sync
    from mrl.train.step import logprobs_of, train_step

    spec, _ = load(job, overrides)
    assert spec.rollout.engine == "vllm" and spec.rollout.temperature == 1.0
    run, learner, gen, prompts = build(spec)
    rank = run.ctx.rank
    g = torch.Generator().manual_seed(0)
    V = run.hf["vocab_size"]

    def sync_weights(_=None):
        sync(gen, learner, learner.actor.steps)
    seqs = [torch.randint(3, V, (n,), generator=g).tolist() for n in (7, 12, 5, 16)]

    def trainer_lp() -> list[list[float]]:
        batch = Batch.from_sequences([s[:1] for s in seqs], [s[1:] for s in seqs], pad_id=0)
        lp = logprobs_of(learner.actor, run, batch, spec.actor.micro_batch_tokens)
        return [lp[b, :len(s) - 1].tolist() for b, s in enumerate(seqs)]

    def max_diff(a, b) -> float:
        return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    # 1. the first sync
    sync_weights()
    before = gen.engine.sequence_logprobs(seqs)
    d1 = max_diff(before, trainer_lp())
    assert d1 <= 1e-4, f"rank {rank}: engine vs trainer after the first sync: {d1}"

    # 2. a training step: generation on the engine groups, the update
    m = train_step(run, learner, ColocatedRollouts(run, learner, gen, prompts), 1)
    audit = m["rollout/logprob_abs_diff_mean"]
    assert audit < 1e-3, f"rank {rank}: step-1 audit {audit}"
    assert m["actor/updates"] >= 1

    # 3. the updated weights arrive
    sync_weights()
    after = gen.engine.sequence_logprobs(seqs)
    d3 = max_diff(after, trainer_lp())
    moved = max_diff(after, before)
    assert d3 <= 1e-4, f"rank {rank}: engine vs trainer after an update: {d3}"
    assert moved > 10 * max(d3, 1e-6), f"rank {rank}: the update did not reach the engine (moved {moved})"

    # 4. the wrong shard: one tensor with its two halves swapped (another TP rank's piece in place)
    def swapped(stream, victim):
        for name, t in stream:
            if name == victim:
                half = t.shape[0] // 2
                t = torch.cat([t[half:], t[:half]])
            yield name, t

    victim = "model.layers.0.mlp.down_proj.weight"
    gen.engine.wake(tags=["weights"])
    gen.engine.update_weights(swapped(learner.exporter.stream("all"), victim))
    d4 = max_diff(gen.engine.sequence_logprobs(seqs), trainer_lp())
    assert d4 > 1e-3, f"rank {rank}: a wrong shard went unnoticed ({d4})"

    # 5. incomplete streams are refused
    for stream, what in (([], "empty"), ((kv for kv in learner.exporter.stream("all") if kv[0] != victim), "missing")):
        try:
            gen.engine.update_weights(stream)
        except RuntimeError as e:
            assert "loaded nothing into" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: an {what} weight stream was accepted")
    gen.weights_key = None   # the engine's weights are no longer the actor's
    sync_weights()
    d5 = max_diff(gen.engine.sequence_logprobs(seqs), trainer_lp())
    assert d5 <= 1e-4, d5
    close(gen)
    print(f"rank {rank} ok: first sync {d1:.2e}, step-1 audit {audit:.2e}, after update {d3:.2e} "
          f"(moved {moved:.2e}), wrong shard {d4:.2e}", flush=True)
    from mrl.platform import teardown

    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
