"""The teacher of on-policy distillation (`[distill]`, `algorithm.advantage = "distill"`).

A frozen megatron-core model like the reference (`mrl.models.roles`, role "ref": eval mode, no
gradients, no optimizer), built from its own Hugging Face config at `distill.model_path` in
`distill.dtype`, laid out with the job's tensor / pipeline parallelism, and driven by the same
`Engine.forward_only` pass: vocabulary-parallel log-probs through `mrl_kernels` (the fused
kernels on CUDA), Megatron's vocabulary padding masked at the teacher's own vocabulary size
(`teacher_logprobs`, `distill.estimator = "sampled"`); or run on each packed micro-batch of the
student's update for the full-vocabulary reverse KL (`teacher_rows`, `"full"`).

The teacher must share the student's tokenizer (the same token -> id map, checked when it is
built by `mrl.train.build.build_teacher`): its log-probs are read at the student's token ids.
"""
from __future__ import annotations

import dataclasses

import torch

from mrl.batch import Batch

__all__ = ["Teacher", "teacher_logprobs", "teacher_rows", "teacher_problems"]


@dataclasses.dataclass
class Teacher:
    engine: object          # mrl.engine.Engine, frozen
    vocab_size: int         # the teacher's tokenizer vocabulary (its hf config)


def teacher_logprobs(teacher: Teacher, batch: Batch, budget: int, temperature: float, kernels: str) -> torch.Tensor:
    """`[B, R]` the teacher's log-probs of the student's response tokens (at the rollout
    temperature, as the student's)."""
    from mrl.engine.objectives import actor_outputs

    out = teacher.engine.forward_only(batch, actor_outputs(temperature, vocab_size=teacher.vocab_size, kernels=kernels),
                                      micro_batch_tokens=budget)
    return out["logprobs"].cpu()


def teacher_rows(teacher: Teacher):
    """`fn(mb) -> [N, V/tp]`: the teacher's logits at the response tokens of a packed micro-batch of
    the student's update (no gradient; Megatron's vocabulary padding at -inf), for the
    full-vocabulary reverse KL (`distill.estimator = "full"`). The teacher runs on the same
    packed row as the student, so its vocabulary shards line up with the student's (one
    pipeline stage: the validator refuses `parallel.pipeline > 1` with it)."""
    from mrl.engine.objectives import _tp_group
    from mrl.models.roles import mask_padded_vocab

    model = teacher.engine.chunks[0]

    def fn(mb) -> torch.Tensor:
        with torch.no_grad():
            out = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
            group = _tp_group()
            return mask_padded_vocab(mb.take(out), teacher.vocab_size,
                                     tp_rank=torch.distributed.get_rank(group) if group else 0)

    return fn


def teacher_problems(spec, tokenizer=None, student_vocab=None) -> list[str]:
    """What `build_teacher` refuses, found before any model is built (`mrl validate` asks too):
    a teacher with no weights, another tokenizer (its log-probs are read at the student's token
    ids), or another vocabulary size with `distill.estimator = "full"`. `tokenizer` and
    `student_vocab` are the student's (loaded from `spec.model` when not given)."""
    from mrl.models.facts import has_hf_weights
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer

    cfg = spec.distill
    if not has_hf_weights(cfg.model_path):
        return [f"{cfg.model_path!r} holds no weights (a teacher must be a trained checkpoint)"]
    teacher = dataclasses.replace(spec.model, path=cfg.model_path, tokenizer=None)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.model)
    theirs = load_tokenizer(teacher)
    problems = []
    if theirs.get_vocab() != tokenizer.get_vocab():
        problems.append(f"the teacher's tokenizer ({len(theirs.get_vocab())} tokens) differs from the student's "
                        f"({len(tokenizer.get_vocab())}); distillation reads the teacher at the student's token ids, "
                        "so they must share one")
    if cfg.estimator == "full":
        student_vocab = student_vocab if student_vocab is not None else int(hf_config(spec.model)["vocab_size"])
        if hf_config(teacher)["vocab_size"] != student_vocab:
            problems.append(f"the teacher's vocabulary size {hf_config(teacher)['vocab_size']} differs from the "
                            f"student's {student_vocab}; distill.estimator = 'full' compares their whole "
                            "distributions shard by shard (use 'sampled')")
    return problems
