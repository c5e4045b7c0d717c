"""Delta weight syncs into a vLLM engine group inside `mrl train`'s components, in bf16.

Usage: torchrun --nproc_per_node 2 vllm_delta_sync.py JOB STEPS [key=value ...]
(the job must set rollout.weight_sync.mode = "delta" and verify_every_steps = 1).

Each of STEPS steps, on every rank:
1. the publish syncs the actor into the engine: full at step 1, delta afterwards, and verified
   (the engine's weights read back under HF names hash to the trainer's export);
2. the engine's weights, read back, are the exported tensors bit for bit;
3. the same weights by a full sync give the same engine: its log-probs of fixed sequences are
   equal bit for bit before and after (so generation, and the trainer/rollout audit, are those
   of a full-sync run);
4. a training step (generation on the engine group; its audit is printed).
Then: a byte flipped in transit is caught naming its tensor; a level-2 sleep forces a full sync.
Prints per-sync figures (bytes, seconds, full vs delta; verification) and `rank R ok` at the end.
"""
from __future__ import annotations

import sys
import time

import torch


def main(job: str, steps: int, overrides: list[str]) -> None:
    from mrl.config.loader import load
    from mrl.train.build import build, close
    from mrl.train.colocated import ColocatedRollouts
    from mrl.train.colocated import release_engine
    from mrl.train.step import train_step
    from mrl.weights.delta import Bucket
    from mrl.weights.verify import WeightSyncError

    spec, _ = load(job, overrides)
    assert spec.rollout.engine == "vllm" and spec.rollout.weight_sync.mode == "delta"
    assert spec.rollout.weight_sync.verify_every_steps == 1
    run, learner, gen, prompts = build(spec)
    rank = run.ctx.rank
    rollouts = ColocatedRollouts(run, learner, gen, prompts)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, run.hf["vocab_size"], (n,), generator=g).tolist() for n in (7, 12, 5, 16)]
    rows = []
    for step in range(1, steps + 1):
        rollouts.publish(step - 1)
        delta = gen.channel.last
        assert delta.full == (step == 1) and delta.verified, (step, delta)
        t0 = time.perf_counter()
        exported = {n: t.clone() for n, t in learner.exporter.stream("all")}
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        held = dict(gen.engine.held_weights(sorted(exported)))
        readback_s = time.perf_counter() - t0
        for name, t in exported.items():
            assert torch.equal(held[name].view(torch.int16), t.view(torch.int16)), f"rank {rank} step {step}: {name}"
        lp_delta = gen.engine.sequence_logprobs(seqs)

        gen.channel.sender.forget()   # the same version again, by a full sync
        t0 = time.perf_counter()
        gen.channel.push(exported.items(), step - 1)   # verified too (every sync)
        full_s = time.perf_counter() - t0
        full = gen.channel.last
        assert full.full and gen.engine.sequence_logprobs(seqs) == lp_delta, f"rank {rank} step {step}"
        rows.append((step, delta, rollouts.sync_s, full, full_s + export_s, readback_s))

        m = train_step(run, learner, rollouts, step)
        print(f"rank {rank} step {step} audit {m['rollout/logprob_abs_diff_mean']:.3e}", flush=True)
        if step == 1:
            assert m["rollout/logprob_abs_diff_mean"] < 2e-2, m["rollout/logprob_abs_diff_mean"]

    def flip(messages):
        for msg in messages:
            if isinstance(msg, Bucket) and msg.index == 0:
                item = msg.items[0]
                item.values = item.values.clone()
                item.values.view(-1).view(torch.uint8)[3] ^= 0x01
                flip.name = item.name
            yield msg

    gen.channel.transit = flip
    try:
        gen.channel.push(learner.exporter.stream("all"), steps)
    except WeightSyncError as e:
        assert str(e) == (f"weight sync: {flip.name} (version {steps}, bucket 0) failed its checksum at engine group "
                          f"{gen.channel.receiver.group}"), e
    else:
        raise AssertionError(f"rank {rank}: a flipped byte went unnoticed")
    gen.channel.transit = lambda messages: messages
    release_engine(gen, 2)        # the engine dropped its weights (and a failed sync left them in part)
    rollouts.publish(steps)
    assert gen.channel.last.full and gen.channel.last.verified

    for step, d, sync_s, f, full_s, readback_s in rows:
        print(f"rank {rank} sync {step}: {'full' if d.full else 'delta'} {d.bytes_sent} of {d.bytes_full} bytes "
              f"({d.tensors_sent}/{d.tensors} tensors, changed {d.elements_changed / max(d.elements, 1):.4f}) "
              f"{sync_s:.4f}s (checksums {d.seconds_checksums:.4f}s, verify {d.seconds_verify:.4f}s); "
              f"full {f.bytes_sent} bytes {full_s:.4f}s; readback {readback_s:.4f}s", flush=True)
    close(gen)
    print(f"rank {rank} ok: {steps} steps", flush=True)
    from mrl.platform import teardown

    teardown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
