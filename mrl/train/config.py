"""The sections of the models a training step updates or reads, next to the code that reads them
(`mrl.train.build`, `mrl.train.step`, `mrl.train.plan`): `actor` (how the policy is updated),
`critic` (the value model for GAE), `ref` (the frozen reference policy for KL) and `trainer`
(length of the run, validation and logging cadence)."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.models.config import VisionConfig
from mrl.models.lora import LoraConfig
from mrl.optim.config import OptimConfig, ScheduleConfig
from mrl.schema.section import option, section


@section
class MoeConfig:
    """Mixture-of-experts training (`mrl.engine.routing`, docs/algorithms.md "Routing replay")."""

    routing_replay: Literal["off", "r2", "r3"] = option(
        "off", help="replay MoE routes in the trainer: 'r2' the experts of the trainer's own old-log-prob pass in "
                    "the update passes; 'r3' the experts the rollout engine chose, in every actor pass (hf engine)")


@section
class ActorConfig:
    """Policy update. A step's responses are split into mini-batches (one optimizer step each),
    and each rank's share of a mini-batch into token-balanced micro-batches."""

    mini_batch_prompts: Optional[int] = option(None, ge=1, help="prompts per optimizer step (default: data.prompts_per_step); all their responses go in")
    micro_batch_tokens: int = option(16384, ge=1, help="token budget of one micro-batch on one rank (forward/backward)")
    logprob_micro_batch_tokens: Optional[int] = option(None, ge=1, help="token budget for log-prob-only passes (default: micro_batch_tokens)")
    epochs: int = option(1, ge=1, help="passes over each step's data (verl: ppo_epochs)")
    shuffle: bool = option(False, help="shuffle responses between epochs")
    recompute: Literal["none", "selective", "full"] = option("none", help="activation recomputation")
    optim: OptimConfig = option(factory=OptimConfig, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA adapters (rank 0 = full fine-tuning); with adapters "
                              "the reference model is the base with adapters off")
    moe: MoeConfig = option(factory=MoeConfig, help="mixture-of-experts options (routing replay)")
    vision: VisionConfig = option(factory=VisionConfig, help="the vision tower of a vision-language model")


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@section
class CriticConfig:
    """Value model trained alongside the actor; needed by the gae estimator."""

    enable: Optional[bool] = option(None, help="default: on exactly when algorithm.advantage = 'gae'")
    model_path: Optional[str] = option(None, help="initial checkpoint (default: model.path; the LM head is replaced by a value head)")
    mini_batch_prompts: Optional[int] = option(None, ge=1, help="prompts per critic optimizer step (default: actor.mini_batch_prompts)")
    micro_batch_tokens: int = option(16384, ge=1, help="token budget of one micro-batch on one rank")
    epochs: int = option(1, ge=1, help="passes over each step's data")
    warmup_steps: int = option(0, ge=0, help="train only the critic for this many steps first")
    recompute: Literal["none", "selective", "full"] = option("none", help="activation recomputation")
    optim: OptimConfig = option(factory=_critic_optim, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule")


@section
class RefConfig:
    """Frozen reference model; needed when a KL term is on."""

    enable: Optional[bool] = option(None, help="default: on exactly when algorithm.kl_loss or algorithm.kl_reward is on")
    model_path: Optional[str] = option(None, help="checkpoint (default: model.path)")
    micro_batch_tokens: Optional[int] = option(None, ge=1, help="token budget per forward (default: actor.micro_batch_tokens)")


@section
class TeacherParallelConfig:
    """The teacher's own layout within the job's ranks (`mrl.train.teacher.teacher_process_groups`)."""

    tensor: Optional[int] = option(None, ge=1, help="the teacher's tensor-parallel size, a divisor of parallel.tensor "
                                                    "(default: parallel.tensor); each tensor-parallel group of the job "
                                                    "holds parallel.tensor / this copies of the teacher")


@section
class DistillConfig:
    """On-policy distillation (`algorithm.advantage = "distill"`): a frozen teacher scores the
    student's own tokens; the advantage is the per-token reverse KL to it (docs/algorithms.md)."""

    model_path: Optional[str] = option(None, help="the teacher's checkpoint (a Hugging Face directory or builtin preset); "
                                                  "another tokenizer than the student's is read through its re-encoding of the "
                                                  "response (estimator 'sampled' only; docs/algorithms.md)")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = option(None, help="the teacher's dtype (default: model.dtype)")
    micro_batch_tokens: Optional[int] = option(None, ge=1, help="token budget per teacher forward (default: actor.micro_batch_tokens)")
    estimator: Literal["sampled", "full"] = option("sampled", help="sampled: the advantage coef * (lp_teacher - lp_old) "
                                                                   "at the student's token; full: coef * the reverse KL over "
                                                                   "the whole vocabulary as a loss term (pipeline 1)")
    parallel: TeacherParallelConfig = option(factory=TeacherParallelConfig, help="the teacher's own parallel layout "
                                                                                 "(pipeline: the job's)")
    coef: float = option(1.0, gt=0, help="weight of the distillation term")
    task_weight: float = option(0.0, ge=0, help="weight of the task reward's GRPO advantage added to it (0: distillation only)")


@section
class TrainerConfig:
    """Run length and cadence. `total_steps` wins over `epochs` when both are set."""

    epochs: int = option(1, ge=1, help="passes over the prompt set")
    total_steps: Optional[int] = option(None, ge=1, help="stop after this many steps")
    val_every_steps: int = option(0, ge=0, help="validate every N steps; 0 = never")
    val_before_train: bool = option(False, help="validate once before the first step")
    log_samples_every: int = option(10, ge=0, help="every N steps (and the last) MLflow gets a table of sample generations (prompt, response, score) in samples/train.json, and every validation in samples/validation.json; 0 = never")
    log_every_steps: int = option(1, ge=1, help="the console prints a progress line every N steps (and the last); MLflow records every step")
    profile_steps: tuple[int, ...] = option((), ge=1, help="steps traced with torch.profiler: <job.output_dir>/<job.name>/profile/step_<N>/rank_<r>.json (Chrome trace)")
