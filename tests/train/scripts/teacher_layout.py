"""A teacher at its own tensor-parallel size inside a TP2 job (2 ranks, gloo; `distill.parallel.tensor
= 1`): its log-probs equal transformers' (1e-5) with the student's tokenizer and with another;
its full-vocabulary rows (the student's shard, out of its whole vocabulary) equal the TP2
teacher's and transformers' logits. Prints `OK <rank> <check>` per check.

    python -m torch.distributed.run --nproc_per_node 2 teacher_layout.py SAME_TOKENIZER_DIR OTHER_TOKENIZER_DIR
"""
from __future__ import annotations

import sys

import torch


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mrl import platform as plat
    from mrl.batch import Batch
    from mrl.config.loader import load
    from mrl.models.tokenizer import byte_tokenizer
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.train.build import build_teacher
    from mrl.train.retokenize import align
    from mrl.train.teacher import teacher_logprobs, teacher_rows

    same, other = sys.argv[1:3]
    plat.setup(PlatformConfig(device="cpu", ranks_per_node=2, cpu_threads=1), ParallelConfig(tensor=2), seed=11)
    rank = dist.get_rank()

    def spec(path, *extra):
        return load("jobs/quickstart_cpu.toml", ["algorithm.advantage=distill", f"distill.model_path={path}", *extra])[0]

    def ok(name):
        print(f"OK {rank} {name}", flush=True)

    s = byte_tokenizer()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (3, 7, 5)]
    responses = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (6, 2, 9)]
    batch = Batch.from_sequences(prompts, responses, group_index=[0, 0, 1])
    hf = AutoModelForCausalLM.from_pretrained(same, dtype=torch.float32)

    t1 = build_teacher(spec(same, "distill.parallel.tensor=1"), "cpu", s, 512)
    assert t1.copies == 2 and t1.tp_group is None
    assert t1.engine.chunks[0].output_layer.weight.shape == (512, 96)   # whole on each rank (TP2: [256, 96])
    got, _ = teacher_logprobs(t1, batch, budget=24, temperature=0.7, kernels="torch")
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = hf(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        assert (got[i, :len(r)] - want).abs().max().item() <= 1e-5, i
    ok("tp1_teacher_logprobs_equal_transformers")

    t2 = build_teacher(spec(same), "cpu", s, 512)   # the job's layout: this rank's half of the vocabulary
    assert t2.copies == 1 and t2.engine.chunks[0].output_layer.weight.shape == (256, 96)
    for mb in t1.engine.micro_batches(batch, 24, "test"):
        a, b = teacher_rows(t1)(mb), teacher_rows(t2)(mb)
        assert a.shape == b.shape == (len(mb.response_labels), 256)
        assert (a - b).abs().max().item() <= 1e-5
        rows = []
        for i in mb.index.tolist():
            p, r = prompts[i], responses[i]
            with torch.no_grad():
                rows.append(hf(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1])
        want = torch.cat(rows, 0)[:, rank * 256:(rank + 1) * 256]
        assert (a - want).abs().max().item() <= 1e-5
    ok("tp1_teacher_rows_equal_tp2_and_transformers")

    t3 = build_teacher(spec(other, "distill.parallel.tensor=1"), "cpu", s, 512)
    t = t3.tokenizer
    assert t is not None and t3.copies == 2
    texts = [("<|im_start|>user 12+3=", "12345 ab"), ("<|im_start|>q", "x45é123")]
    prompts = [s(p, add_special_tokens=False)["input_ids"] for p, _ in texts]
    responses = [s(r, add_special_tokens=False)["input_ids"] + [s.eos_token_id] for _, r in texts]
    batch = Batch.from_sequences(prompts, responses, group_index=[0, 1])
    old = -torch.rand(batch["response_ids"].shape, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
    got, _ = teacher_logprobs(t3, batch.add(old_logprobs=old), budget=24, temperature=1.0, kernels="torch")
    hf = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        a = align(s, t, p, r)
        with torch.no_grad():
            lq = torch.log_softmax(hf(torch.tensor([a.prompt + a.response])).logits[0, len(a.prompt) - 1:-1], -1)
        lq = lq.gather(-1, torch.tensor(a.response)[:, None])[:, 0]
        for c in range(max(a.student_chunk) + 1):
            ks = [k for k, x in enumerate(a.student_chunk) if x == c]
            js = [j for j, x in enumerate(a.teacher_chunk) if x == c]
            want = old[i, ks] + (lq[js].sum() - old[i, ks].sum()) / len(ks)
            assert (got[i, ks] - want).abs().max().item() <= 1e-5, (i, c)
    ok("tp1_teacher_with_another_tokenizer_equals_transformers")
    plat.teardown()


if __name__ == "__main__":
    main()
