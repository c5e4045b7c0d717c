"""`sft(spec)`: supervised fine-tuning on the RL trainer's engine, checkpoints and tracking.

One step = `sft.examples_per_step` examples (drawn by the same seeded, DP-sharded, resumable
sampler as RL prompts), each rank packing its share into token-balanced micro-batches of
`sft.micro_batch_tokens`, one optimizer update (`Engine.train_mini_batch`: megatron's schedule,
TP/PP/DP, the guarded step). Checkpoints go to `<checkpoint.dir>/actor` with the same `extra`
as an RL actor's (model config, model path, tokenizer, spec), so `mrl merge` turns one into a
Hugging Face directory (and `checkpoint.save_hf_at_end` does it at the end) that an `mrl train`
job takes as `model.path`. Resume is exact: model, optimizer, scheduler, RNG and sampler
position come back, and the run continues the same MLflow run.

Metrics per step: `train/loss` (token-mean cross-entropy of the step), `train/grad_norm`,
`train/lr`, `train/loss_tokens` and `train/examples` (whole step), `train/epoch`,
`time/step_s`; with `sft.val_every_steps`, `val/loss` (token-mean over the validation set) every
N steps and at the end.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class SFTRun:
    spec: Any
    ctx: Any
    hf: dict
    tokenizer: Any
    engine: Any
    train: Any                  # ExampleSet
    val: Optional[Any]
    sampler: Any
    total_steps: int
    extras: dict = field(default_factory=dict)


def steps_planned(spec, examples: int) -> int:
    s = spec.sft
    return s.total_steps or s.epochs * (examples // s.examples_per_step)


def build_engine(spec, hf: dict, device: str, total_optimizer_steps: int):
    """The trained model (LoRA adapters when `sft.lora.rank > 0`), its optimizer and scheduler."""
    from mrl.engine import Engine
    from mrl.optim.build import build_optimizer, build_scheduler, wrap_ddp
    from mrl.train.build import load_weights, role_chunks, with_adapters

    s = spec.sft
    chunks = role_chunks("actor", spec, hf, device, s.recompute)
    load_weights(chunks, spec.model.path, hf, "actor")
    if s.lora.rank:
        chunks = with_adapters(chunks, s.lora, spec, hf, "sft.lora")
    if s.vision.trainable:   # before DDP: it buckets what requires gradients
        from mrl.models.vlm_gpt import set_vision_trainable

        set_vision_trainable(chunks, True)
    ddp = wrap_ddp(chunks, distributed_optimizer=spec.parallel.distributed_optimizer)
    optimizer = build_optimizer(ddp, s.optim, distributed_optimizer=spec.parallel.distributed_optimizer, section="sft")
    scheduler = build_scheduler(optimizer, s.optim, s.schedule, total_optimizer_steps)
    return Engine(ddp, optimizer=optimizer, scheduler=scheduler, name="sft", grad_clip=s.optim.grad_clip,
                  nonfinite=s.optim.nonfinite)


def build(spec) -> SFTRun:
    from mrl.data.sampler import PromptSampler
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.platform import setup
    from mrl.sft.data import load_examples

    from mrl.tracking.startup import STARTUP

    ctx = setup(spec.platform, spec.parallel, seed=spec.job.seed)
    par = spec.parallel
    STARTUP.say(f"process groups: world {spec.platform.world_size}, TP {par.tensor} x PP {par.pipeline}"
                + (f" x CP {par.context}" if par.context > 1 else "") + f" x DP {ctx.dp}",
                timed=True)
    hf = hf_config(spec.model)
    from mrl.models.vlm import sft_problem

    problem = sft_problem(spec, hf)
    if problem:
        raise UserError(problem)
    tokenizer = load_tokenizer(spec.model)
    from mrl.data.images import model_image_processor

    images = model_image_processor(spec.model.path, hf)
    train = load_examples(spec, tokenizer, "train", images=images)
    s = spec.sft
    if len(train) < s.examples_per_step:
        raise UserError(f"sft.examples_per_step: {s.examples_per_step} is more than the {len(train)} training "
                        f"examples ({train.stats})")
    val = None
    if s.val_every_steps:
        val = load_examples(spec, tokenizer, "val", images=images)
    total = steps_planned(spec, len(train))
    STARTUP.say(f"data: {len(train)} training examples" + (f", {len(val)} validation" if val is not None else "")
                + f", tokenizer of {spec.model.tokenizer or spec.model.path}", timed=True)
    sampler = PromptSampler(len(train), s.examples_per_step, dp_rank=ctx.dp_rank, dp_size=ctx.dp,
                            seed=spec.data.seed, shuffle=spec.data.shuffle)
    engine = build_engine(spec, hf, ctx.platform, total)
    lora = s.lora
    STARTUP.say(f"model: {spec.model.path}" + (f", LoRA rank {lora.rank}" if lora.rank else "")
                + (f" from {lora.adapter_path}" if lora.adapter_path else ""), timed=True)
    return SFTRun(spec=spec, ctx=ctx, hf=hf, tokenizer=tokenizer, engine=engine, train=train, val=val,
                  sampler=sampler, total_steps=total)


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else (tokenizer.eos_token_id or 0))


def kernel_backend(spec) -> str:
    return "auto" if spec.model.use_fused_kernels else "torch"


def train_step(r: SFTRun) -> dict[str, float]:
    """One optimizer update on the next `sft.examples_per_step` examples."""
    from mrl.sft.data import to_batch
    from mrl.sft.objective import SFTObjective

    start = time.perf_counter()
    picked = r.sampler.next()
    batch = to_batch([r.train.examples[i] for i in picked.indices], _pad_id(r.tokenizer))
    objective = SFTObjective(vocab_size=r.hf["vocab_size"], kernels=kernel_backend(r.spec))
    m = r.engine.train_mini_batch(batch, objective, micro_batch_tokens=r.spec.sft.micro_batch_tokens)
    counts = torch.tensor([float(batch["response_mask"].sum()), float(len(batch))], dtype=torch.float64)
    if r.engine.dp > 1:
        from mrl.platform.collectives import dp_all_reduce

        counts = dp_all_reduce(counts.to(r.engine.device), "sft token counts")
    return {"train/loss": m["loss"], "train/grad_norm": m["grad_norm"], "train/lr": m["lr"],
            "train/updated": m["updated"], "train/micro_batches": m["micro_batches"],
            "train/loss_tokens": float(counts[0]), "train/examples": float(counts[1]),
            "train/epoch": float(r.sampler.epoch), "time/step_s": time.perf_counter() - start}


def validation_loss(r: SFTRun) -> float:
    """Token-mean cross-entropy over the whole validation set (its share on each DP rank)."""
    from mrl.sft.data import to_batch
    from mrl.sft.objective import token_nll_sum

    mine = r.val.examples[r.ctx.dp_rank::r.ctx.dp]
    if not mine:
        mine = r.val.examples[:1]   # every DP rank must run the pass; its tokens are counted twice then
    batch = to_batch(mine, _pad_id(r.tokenizer))
    total, tokens = token_nll_sum(r.engine, batch, micro_batch_tokens=r.spec.sft.micro_batch_tokens,
                                  vocab_size=r.hf["vocab_size"], kernels=kernel_backend(r.spec))
    return total / max(tokens, 1.0)


def checkpoint_root(spec) -> Path:
    return Path(spec.checkpoint.dir) / "actor"


def _save(r: SFTRun, step: int, run_id) -> None:
    from mrl.checkpoint.run_state import ModelFacts, RunState, job_identity, save_run

    spec = r.spec
    state = RunState(trainer="sft", sampler=r.sampler.state_dict(), tracking_run_id=run_id,
                     actor_updates=r.engine.steps, model=ModelFacts.of(spec, r.hf), lora=_lora_extra(spec.sft.lora))
    save_run(Path(spec.checkpoint.dir), step, r.engine, state, spec.checkpoint,
             with_optimizer=spec.checkpoint.save_optimizer, job=job_identity(spec))


def _lora_extra(cfg) -> dict:
    """What `mrl merge` needs to rebuild adapters (empty for full fine-tuning)."""
    if not cfg.rank:
        return {}
    return {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout, "target_modules": list(cfg.target_modules)}


def _resume(r: SFTRun):
    """(last completed step, its run state) or (0, None) for a fresh start."""
    from mrl.checkpoint.run_state import job_identity, resume_run

    from mrl.checkpoint.compat import before_load

    # another model: one line before megatron reads a tensor
    start, state = resume_run(Path(r.spec.checkpoint.dir), r.engine, r.spec.checkpoint, trainer="sft",
                              before_load=lambda found: before_load(found, r.hf), job=job_identity(r.spec))
    if state is not None:
        r.sampler.load_state_dict(state.sampler)
    return start, state


def sft(spec) -> dict[str, float]:
    """Run the SFT job `spec` to its last step (or resume it); returns the last step's metrics."""
    from mrl.checkpoint.config import saves_at
    from mrl.platform.dist import create_wait_group, wait_for_peers
    from mrl.tracking.tracker import Tracker, run_dir_of
    from mrl.train.lifecycle import run_lifecycle
    from mrl.train.metrics import reduce_over_ranks

    from mrl.tracking.startup import STARTUP

    STARTUP.say("building: process groups, data, model (loading weights) ...", mark=False)
    started = time.monotonic()
    r = build(spec)
    STARTUP.say(f"built ({time.monotonic() - started:.1f}s in all)", mark=False)
    last: dict[str, float] = {}
    with run_lifecycle(spec, rank=r.ctx.rank, checkpoint_root=Path(spec.checkpoint.dir)) as life:
        from mrl.checkpoint import state, store

        create_wait_group(spec.platform.collective_timeout_s)
        store.check_writable(run_dir_of(spec), 0, "job.output_dir")
        store.check_writable(Path(spec.checkpoint.dir),
                             state.estimated_bytes(r.engine.chunks, with_optimizer=spec.checkpoint.save_optimizer),
                             "checkpoint.dir")
        start, saved = _resume(r)
        from mrl.tracking.origin import tracking_start

        # load_from another run: a new run
        resume_run_id, origin = tracking_start(spec, start, saved.to_extra() if saved is not None else {})
        tracker = life.tracker = Tracker(spec.tracking, run_dir=run_dir_of(spec), total_steps=r.total_steps,
                                         rank=r.ctx.rank, resume_run_id=resume_run_id, start_step=start,
                                         log_every_steps=spec.sft.log_every_steps, origin=origin)
        if start == 0 or origin:   # a new MLflow run
            tracker.log_spec(spec)
            tracker.log_params({f"data/{k}": v for k, v in r.train.stats.items()})
        elif start >= r.total_steps:
            tracker.message(f"resumed at step {start}: the run is already complete ({r.total_steps} steps); "
                            "raise sft.total_steps to train further")
        else:
            tracker.message(f"resumed from step {start} of {r.total_steps}")
        wait_for_peers("tracking setup")   # rank 0 alone creates or re-attaches the MLflow run
        every, val_every = spec.checkpoint.every_steps, spec.sft.val_every_steps
        for step in range(start + 1, r.total_steps + 1):
            tracker.stage("train")
            metrics = reduce_over_ranks(train_step(r), r.ctx.dp)
            if val_every and (step % val_every == 0 or step == r.total_steps):
                tracker.stage("validation")
                metrics["val/loss"] = validation_loss(r)
            tracker.log_metrics(metrics, step)
            last = metrics
            if saves_at(step, every, r.total_steps):
                _save(r, step, tracker.run_id)
        life.finished(export_steps=r.total_steps)
        return last
