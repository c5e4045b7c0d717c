"""The teacher of on-policy distillation (`[distill]`, `algorithm.advantage = "distill"`).

A frozen megatron-core model like the reference (`mrl.models.roles`, role "ref": eval mode, no
gradients, no optimizer), built from its own Hugging Face config at `distill.model_path` in
`distill.dtype`, laid out with the job's pipeline parallelism and its own tensor parallelism
(`distill.parallel.tensor`, a divisor of the job's: `teacher_process_groups`), and driven by the same
`Engine.forward_only` pass: vocabulary-parallel log-probs through `mrl_kernels` (the fused
kernels on CUDA), Megatron's vocabulary padding masked at the teacher's own vocabulary size
(`teacher_logprobs`, `distill.estimator = "sampled"`); or run on each packed micro-batch of the
student's update for the full-vocabulary reverse KL (`teacher_rows`, `"full"`).

A teacher that shares the student's tokenizer (the same token -> id map, checked when it is
built by `mrl.train.build.build_teacher`) is read at the student's token ids. A teacher with
another tokenizer (`"sampled"` only) reads the student's response decoded and re-encoded in its
own tokens, and its log-probs are attributed back to the student's tokens by character offsets
(`mrl.train.retokenize`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from mrl.batch import Batch
from mrl.engine.objectives import JOB_GROUP

__all__ = ["Teacher", "teacher_logprobs", "teacher_rows", "teacher_problems", "teacher_process_groups"]


@dataclasses.dataclass
class Teacher:
    engine: object          # mrl.engine.Engine, frozen
    vocab_size: int         # the teacher's tokenizer vocabulary (its hf config)
    tokenizer: object = None          # the teacher's, where it differs from the student's (else None)
    student_tokenizer: object = None  # the student's, with `tokenizer`
    tp_group: object = JOB_GROUP      # its vocabulary's tensor-parallel group: the job's, None (whole), or its own
    copies: int = 1                   # job TP / teacher TP: the student's vocabulary shard is 1/copies of this rank's


def teacher_process_groups(tensor: int):
    """(megatron `ProcessGroupCollection`, tensor-parallel group) of a teacher split over `tensor`
    ranks inside the job's tensor-parallel groups of `T` ranks: the group is None at `tensor = 1`
    (whole on each rank); `(None, JOB_GROUP)` where `tensor == T` (the job's own groups).

    Each TP group of the job holds `k = T / tensor` copies: the teacher's group of job TP rank
    `r` is the ranks `r' = r mod k` of its job group (strided), in which `r` is teacher rank
    `r // k`. The teacher's vocabulary is padded as the student's (`vocab_multiple` 128 k), so
    this rank's shard of it contains the student's shard, at offset `(r mod k) V_pad / T`
    (`teacher_rows`). Megatron keeps one parallel state per process; the teacher's layers take
    these groups through megatron's `pg_collection` instead (as do its weights: `mrl.weights.layout`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    job = ps.get_tensor_model_parallel_world_size()
    if tensor == job:
        return None, JOB_GROUP
    k, r = job // tensor, ps.get_tensor_model_parallel_rank()
    ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()) if job > 1 else [dist.get_rank()]
    mine = dist.new_group(ranks[r % k::k], use_local_synchronization=True)   # only its members create it
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.tp = mine
    return groups, (mine if tensor > 1 else None)


def teacher_logprobs(teacher: Teacher, batch: Batch, budget: int, temperature: float,
                     kernels: str) -> tuple[torch.Tensor, dict[str, float]]:
    """(`[B, R]` the teacher's log-probs of the student's response tokens, at the rollout
    temperature as the student's; metrics). With another tokenizer, the log-probs of its own
    tokens of the response's text, attributed to the student's tokens chunk by chunk
    (`mrl.train.retokenize.attribute`, reading `old_logprobs`); the metric
    `distill/student_tokens_per_chunk` says how far the two tokenizations agree (1: token for token)."""
    from mrl.engine.objectives import actor_outputs

    outputs = actor_outputs(temperature, vocab_size=teacher.vocab_size, kernels=kernels, group=teacher.tp_group)
    if teacher.tokenizer is None:
        return teacher.engine.forward_only(batch, outputs, micro_batch_tokens=budget)["logprobs"].cpu(), {}
    from mrl.train.retokenize import align, attribute

    prompts, responses = [], []
    for i, n in enumerate(batch["response_lengths"].tolist()):
        prompts.append(batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist())
        responses.append(batch["response_ids"][i, :n].tolist())
    aligned = [align(teacher.student_tokenizer, teacher.tokenizer, p, r) for p, r in zip(prompts, responses)]
    theirs = Batch.from_sequences([a.prompt for a in aligned], [a.response for a in aligned],
                                  group_index=batch["group_index"].tolist())
    lq = teacher.engine.forward_only(theirs, outputs, micro_batch_tokens=budget)["logprobs"].cpu()
    old = batch["old_logprobs"].cpu()
    out = torch.zeros_like(old)
    for i, (a, r) in enumerate(zip(aligned, responses)):
        out[i, :len(r)] = attribute(old[i, :len(r)], lq[i, :len(a.response)], a)
    from mrl.platform.collectives import dp_sum

    chunks = sum(max(a.student_chunk, default=-1) + 1 for a in aligned)
    tokens, chunks = dp_sum(torch.tensor([sum(map(len, responses)), chunks], dtype=torch.float64),
                            "teacher chunk counts").tolist()
    return out, {"distill/student_tokens_per_chunk": tokens / max(chunks, 1.0)}


def teacher_rows(teacher: Teacher):
    """`fn(mb) -> [N, V/tp]`: the teacher's logits at the response tokens of a packed micro-batch of
    the student's update (no gradient; Megatron's vocabulary padding at -inf), for the
    full-vocabulary reverse KL (`distill.estimator = "full"`). The teacher runs on the same
    packed row as the student, so its vocabulary shards line up with the student's (one
    pipeline stage: the validator refuses `parallel.pipeline > 1` with it); a teacher at a
    smaller tensor-parallel size gives the student's shard out of its larger one."""
    from megatron.core import parallel_state as ps

    from mrl.engine.objectives import _tp_group
    from mrl.models.head import at_rows
    from mrl.models.roles import mask_padded_vocab

    model = teacher.engine.chunks[0]
    group = _tp_group() if teacher.tp_group is JOB_GROUP else teacher.tp_group
    part = ps.get_tensor_model_parallel_rank() % teacher.copies

    def fn(mb) -> torch.Tensor:
        with torch.no_grad():
            with at_rows(model, mb.response_positions) if mb.head_rows else contextlib.nullcontext():
                out = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
            rows = mask_padded_vocab(mb.take(out), teacher.vocab_size,
                                     tp_rank=torch.distributed.get_rank(group) if group else 0)
            width = rows.shape[-1] // teacher.copies
            return rows[..., part * width:(part + 1) * width]

    return fn


def teacher_problems(spec, tokenizer=None, student_vocab=None) -> list[tuple[str, str]]:
    """(key, problem) for what `build_teacher` refuses, found before any model is built (`mrl
    validate` asks too): a teacher with no weights; a `distill.parallel.tensor` that does not
    divide `parallel.tensor`, or differs from it for a mixture-of-experts teacher (its expert
    layers keep the job's groups); with another tokenizer, `distill.estimator = "full"` (it
    compares the two distributions id by id) or a tokenizer without character offsets (a slow
    one: the sampled estimator aligns the two tokenizations by them); another vocabulary size
    with `"full"`. `tokenizer` and `student_vocab` are the student's (loaded from `spec.model`
    when not given)."""
    from mrl.models.facts import facts_from_hf_config, has_hf_weights
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer

    cfg, key = spec.distill, "distill.model_path"
    if not has_hf_weights(cfg.model_path):
        return [(key, f"{cfg.model_path!r} holds no weights (a teacher must be a trained checkpoint)")]
    teacher = dataclasses.replace(spec.model, path=cfg.model_path, tokenizer=None)
    problems = []
    tp, job = cfg.parallel.tensor, spec.parallel.tensor
    if tp is not None and job % tp:
        problems.append(("distill.parallel.tensor", f"{tp} does not divide parallel.tensor = {job} (the teacher is split "
                                                    "inside the job's tensor-parallel groups)"))
    elif tp is not None and tp != job and facts_from_hf_config(hf_config(teacher), "teacher").num_experts:
        problems.append(("distill.parallel.tensor", f"a mixture-of-experts teacher takes the job's tensor parallelism "
                                                    f"({job}, not {tp}): its expert layers use the job's groups"))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.model)
    theirs = load_tokenizer(teacher)
    if theirs.get_vocab() != tokenizer.get_vocab():
        if cfg.estimator == "full":
            problems.append((key, f"the teacher's tokenizer ({len(theirs.get_vocab())} tokens) differs from the student's "
                                  f"({len(tokenizer.get_vocab())}); distill.estimator = 'full' compares the two "
                                  "distributions token id by token id, so they must share one (or use 'sampled')"))
        elif not getattr(theirs, "is_fast", False):
            problems.append((key, f"the teacher's tokenizer ({type(theirs).__name__}) differs from the student's and gives "
                                  "no character offsets (a slow tokenizer); the sampled estimator aligns the two "
                                  "tokenizations by them: give the teacher a tokenizer.json"))
    if cfg.estimator == "full":
        student_vocab = student_vocab if student_vocab is not None else int(hf_config(spec.model)["vocab_size"])
        if hf_config(teacher)["vocab_size"] != student_vocab:
            problems.append((key, f"the teacher's vocabulary size {hf_config(teacher)['vocab_size']} differs from the "
                                  f"student's {student_vocab}; distill.estimator = 'full' compares their whole "
                                  "distributions shard by shard (use 'sampled')"))
    return problems
