"""`train(spec)`: run a job from its first step, or resume it from its latest checkpoint.

Checkpoints live in `checkpoint.dir` (default `<output_dir>/<name>/checkpoints`): one
`actor/` root (and `critic/`), each atomic with a `latest` pointer. The actor's `extra` holds
the sampler position, the KL controller, the MLflow run id and the step (and, with a separate
rollout, the rollouts already generated for later steps), so a resumed run continues the same
prompts, the same MLflow run and the same metrics. `checkpoint.resume`: "auto" resumes when a
checkpoint exists, "never" starts fresh, "must" requires one.

With `rollout.placement = "separate"` the trainer ranks run `train` below and the rollout ranks
run `mrl.train.queue.serve`.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mrl.config.job import JobSpec
from mrl.errors import UserError
from mrl.platform.dist import wait_for_peers
from mrl.train.build import build, close
from mrl.train.parts import Learner, Run, SampleLog
from mrl.train.step import train_step
from mrl.train.validate import validate

log = logging.getLogger(__name__)


def checkpoint_root(spec: JobSpec) -> Path:
    return Path(spec.checkpoint.dir)   # resolved: <job.output_dir>/<job.name>/checkpoints unless set


def _resume(run: Run, learner: Learner) -> tuple[int, dict]:
    """(last completed step, the actor checkpoint's extra) or (0, {}) for a fresh start."""
    from mrl.checkpoint import state

    ck = run.spec.checkpoint
    root = Path(ck.load_from) if ck.load_from else checkpoint_root(run.spec) / "actor"
    if ck.resume == "never" and not ck.load_from:
        return 0, {}
    # the newest intact checkpoint (a damaged newer one is skipped, said in one line)
    critic_of = (lambda ckpt: [ckpt.parent.parent / "critic" / ckpt.name]) if learner.critic is not None else None
    found = state.find_resumable(root, must=ck.resume == "must", companions=critic_of)
    if found is None:
        if ck.resume == "must" or ck.load_from:
            raise UserError(f"checkpoint{'.load_from' if ck.load_from else '.resume'}: no checkpoint in {root}"
                            + (" (checkpoint.resume = 'must')" if not ck.load_from else ""))
        return 0, {}
    from mrl.checkpoint.compat import before_load

    before_load(found, run.hf, run.spec.reward)   # another model: one line; a changed reward file: a warning
    actor = learner.actor
    loaded = state.load(found, chunks=actor.chunks, optimizer=actor.optimizer, scheduler=actor.scheduler, verified=True)
    if learner.critic is not None:
        critic_dir = found.parent.parent / "critic" / found.name
        if not critic_dir.is_dir():
            raise UserError(f"checkpoint: {found} has no critic checkpoint at {critic_dir}")
        state.load(critic_dir, chunks=learner.critic.chunks, optimizer=learner.critic.optimizer,
                   scheduler=learner.critic.scheduler, verified=True)
    extra = loaded.extra
    if "kl_coef" in extra and learner.kl is not None:
        learner.kl.value = extra["kl_coef"]
    actor.steps = extra.get("actor_updates", actor.steps)
    if learner.critic is not None:
        learner.critic.steps = extra.get("critic_updates", learner.critic.steps)
    return loaded.step, extra


def _save(run: Run, learner: Learner, rollouts, step: int, tracker_run_id) -> None:
    from mrl.checkpoint import state

    from mrl.config.dump import to_toml

    spec = run.spec
    root = checkpoint_root(spec)
    position = rollouts.state(step)   # the data position (and the rollouts queued for later steps)
    if dist.is_initialized() and dist.get_world_size() > 1:   # rank 0 owns the MLflow run: every rank stores its id
        from mrl.platform.dist import stage

        box = [tracker_run_id]
        with stage("checkpoint save"):
            dist.broadcast_object_list(box, src=0)
        tracker_run_id = box[0]
    # What `mrl merge` needs to rebuild the model without the job file.
    model = {"hf_config": run.hf, "model_path": spec.model.path, "tokenizer": spec.model.tokenizer,
             "dtype": spec.model.dtype, "spec_toml": to_toml(spec)}
    from mrl.checkpoint.compat import job_reward_files

    extra = {**position, "mlflow_run_id": tracker_run_id, "actor_updates": learner.actor.steps, **model, "role": "actor",
             "reward_files": job_reward_files(spec.reward)}
    if learner.kl is not None:
        extra["kl_coef"] = learner.kl.value
    if learner.critic is not None:
        extra["critic_updates"] = learner.critic.steps
        state.save(root / "critic", step, chunks=learner.critic.chunks, optimizer=learner.critic.optimizer,
                   scheduler=learner.critic.scheduler, extra={**model, "role": "critic"},
                   keep_last=spec.checkpoint.keep_last)
    state.save(root / "actor", step, chunks=learner.actor.chunks,
               optimizer=learner.actor.optimizer if spec.checkpoint.save_optimizer else None,
               scheduler=learner.actor.scheduler, extra=extra, keep_last=spec.checkpoint.keep_last)


def _check_disk(spec: JobSpec, learner: Learner) -> None:
    """Before the first step, on every trainer rank: the run directory and the checkpoint
    directory are writable, and the latter has room for one checkpoint (estimated from the
    model's size)."""
    from mrl.checkpoint import state, store
    from mrl.tracking.tracker import run_dir_of

    store.check_writable(run_dir_of(spec), 0, "job.output_dir")
    need = state.estimated_bytes(learner.actor.chunks, with_optimizer=spec.checkpoint.save_optimizer)
    if learner.critic is not None:
        need += state.estimated_bytes(learner.critic.chunks, with_optimizer=True)
    store.check_writable(checkpoint_root(spec), need, "checkpoint.dir")


def _max_over_ranks(seconds: float) -> float:
    """The slowest rank's time for a stage every rank ran (validation, checkpoint)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    from mrl.platform.dist import stage

    t = torch.tensor([seconds], dtype=torch.float64)
    with stage("timing all-reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Means over data-parallel ranks (ranks of one model replica hold the same values); `*_max`,
    `time/*` and `memory/*` keys are maxima over all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return metrics
    from megatron.core import parallel_state as ps

    from mrl.platform.dist import stage
    from mrl.reward.compose import is_count

    everyone = [None] * dist.get_world_size()
    with stage("metrics all-gather"):
        dist.all_gather_object(everyone, metrics)
    dp = ps.get_data_parallel_world_size()
    keys = sorted(set().union(*everyone))
    out = {}
    for k in keys:
        vals = [m[k] for m in everyone if k in m and not math.isnan(m[k])]
        if vals and is_count(k):   # events counted on each data-parallel replica: their sum
            out[k] = sum(vals) / len(vals) * dp
            continue
        if vals:
            # a stage takes as long as its slowest rank: timings are maxima, not means
            out[k] = max(vals) if k.endswith("_max") or k.startswith(("time/", "memory/")) else sum(vals) / len(vals)
    return out


def train(spec: JobSpec) -> dict[str, float]:
    """Run `spec` to `trainer.total_steps` (or its epochs); returns the last step's metrics
    (on a rollout-only rank: {})."""
    from mrl.train.lifecycle import run_lifecycle

    run, learner, generation, prompts = build(spec)
    with run_lifecycle(spec, rank=run.ctx.global_rank, checkpoint_root=checkpoint_root(spec),
                       close=lambda: close(generation)) as life:
        if learner is None:   # a rollout rank of a separate placement
            from mrl.train.queue import serve

            serve(run, generation, prompts)
            life.finished()
            return {}
        from mrl.tracking.tracker import Tracker
        from mrl.train.queue import ColocatedRollouts, SeparateRollouts

        rollouts = (SeparateRollouts(run, learner, prompts.dataset) if run.separate
                    else ColocatedRollouts(run, learner, generation, prompts))
        _check_disk(spec, learner)
        start, extra = _resume(run, learner)
        restored = rollouts.load_state(extra, start) if extra else ""
        from mrl.tracking.origin import tracking_start

        resume_run_id, origin = tracking_start(spec, start, extra)   # load_from another run: a new run
        life.tracker = Tracker.from_spec(spec, total_steps=run.total_steps, rank=run.ctx.rank,
                                         resume_run_id=resume_run_id, start_step=start, origin=origin)
        last = _train(run, learner, generation, prompts, rollouts, life.tracker, start, restored)
        life.finished(export_steps=run.total_steps)
        return last


def _train(run: Run, learner: Learner, generation, prompts, rollouts, tracker, start: int,
           restored: str) -> dict[str, float]:
    """The trainer ranks' loop from step `start + 1`; returns the last step's metrics."""
    from mrl.tracking.perf import actor_mfu, throughput
    from mrl.tracking.profile import profile_step
    from mrl.tracking.tracker import run_dir_of

    spec = run.spec
    samples = SampleLog()
    last: dict[str, float] = {}
    validated: dict[str, float] = {}   # the newest validation the rollout side sent (separate)
    try:
        if start == 0:
            tracker.log_spec(spec)
            tracker.log_params({f"data/{k}": v for k, v in prompts.dataset.stats.items()})
        elif start >= run.total_steps:
            tracker.message(f"resumed at step {start}: the run is already complete ({run.total_steps} steps); "
                            "raise trainer.total_steps to train further")
        else:
            tracker.message(f"resumed from step {start} of {run.total_steps}" + (f"; {restored}" if restored else ""))
        wait_for_peers("tracking setup")   # rank 0 alone creates or re-attaches the MLflow run
        rollouts.start(start)
        every = spec.checkpoint.every_steps
        val_every = spec.trainer.val_every_steps
        if spec.trainer.val_before_train and start == 0 and not run.separate:
            rollouts.sync_for_validation(0)
            tracker.log_metrics(validate(run, generation, prompts, 0, samples, learner.reward_model), 0)
            rollouts.release()
        for step in range(start + 1, run.total_steps + 1):
            with profile_step(spec.trainer.profile_steps, step, run_dir_of(spec), run.ctx.rank):
                step_metrics = train_step(run, learner, rollouts, step, on_stage=tracker.stage, samples=samples)
                rollouts.after_update(step)
            metrics = _reduce_metrics(step_metrics)
            metrics.update(throughput(metrics, run.dp))
            if torch.cuda.is_available():   # model FLOP utilisation of the actor update
                world = dist.get_world_size() if dist.is_initialized() else 1
                metrics.update(actor_mfu(metrics, run.hf, world, torch.cuda.get_device_name()))
            if val_every and (step % val_every == 0 or step == run.total_steps) and not run.separate:
                tracker.stage("validation")
                started = time.perf_counter()
                rollouts.sync_for_validation(step)   # the update just changed the policy
                metrics.update(validate(run, generation, prompts, step, samples, learner.reward_model))
                rollouts.release()
                metrics["time/validation"] = _max_over_ranks(time.perf_counter() - started)
            metrics["train/epoch"] = float(rollouts.epoch())
            tracker.log_metrics(metrics, step)
            for split in ("train", "validation"):
                rows = samples.take(split)
                if rows:
                    tracker.log_samples(split, rows)
            last = metrics
            validated.update(_log_validations(tracker, rollouts.validations()))   # separate: the rollout side's
            wait_for_peers("tracking")   # rank 0 alone writes the step's metrics and samples
            if (every and step % every == 0) or step == run.total_steps:
                tracker.stage("checkpoint")
                started = time.perf_counter()
                _save(run, learner, rollouts, step, tracker.run_id)
                tracker.log_metrics({"time/checkpoint": _max_over_ranks(time.perf_counter() - started)}, step,
                                    console=False)
        # separate: wait for the validations still running on the rollout side (the last steps')
        validated.update(_log_validations(tracker, rollouts.validations(upto=run.total_steps)))
        if last and validated:
            last = {**last, **validated}
    except BaseException:
        rollouts.close(wait=False)
        raise
    rollouts.close()
    return last


def _log_validations(tracker, results) -> dict[str, float]:
    """Log validations the rollout side ran (separate placement) under the step they validated;
    returns the newest one's metrics ({} when none arrived)."""
    newest: dict[str, float] = {}
    for r in results:
        tracker.log_metrics(r.metrics, r.version, console=False)
        tracker.message(f"validation of step {r.version}: reward {r.metrics['val/reward_mean']:.4g}")
        newest = r.metrics
        if r.rows:
            tracker.log_samples("validation", r.rows)
    return newest
