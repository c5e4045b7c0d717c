"""`train(spec)`: run a job from its first step, or resume it from its latest checkpoint.

Checkpoints live in `checkpoint.dir` (default `<output_dir>/<name>/checkpoints`): one
`actor/` root (and `critic/`), each atomic with a `latest` pointer. The actor's `extra` holds
the sampler position, the KL controller, the MLflow run id and the step, so a resumed run
continues the same prompts, the same MLflow run and the same metrics. `checkpoint.resume`:
"auto" resumes when a checkpoint exists, "never" starts fresh, "must" requires one.
"""
from __future__ import annotations

import logging
import math
import time
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from mrl.config.job import JobSpec
from mrl.errors import UserError
from mrl.platform.dist import wait_for_peers
from mrl.train.components import Components, build, close
from mrl.train.rollout import release_engine, sync_weights
from mrl.train.step import train_step
from mrl.train.validate import validate

log = logging.getLogger(__name__)


def checkpoint_root(spec: JobSpec) -> Path:
    return Path(spec.checkpoint.dir)   # resolved: <job.output_dir>/<job.name>/checkpoints unless set


def _kl_controller(spec: JobSpec):
    from mrl.algos.kl import AdaptiveController, FixedController

    k = spec.algorithm.kl_reward
    if k.controller == "adaptive":
        return AdaptiveController(k.coef, k.target, k.horizon)
    return FixedController(k.coef)


def _resume(c: Components) -> tuple[int, dict]:
    """(last completed step, the actor checkpoint's extra) or (0, {}) for a fresh start."""
    from mrl.checkpoint import state

    ck = c.spec.checkpoint
    root = Path(ck.load_from) if ck.load_from else checkpoint_root(c.spec) / "actor"
    if ck.resume == "never" and not ck.load_from:
        return 0, {}
    # the newest intact checkpoint (a damaged newer one is skipped, said in one line)
    critic_of = (lambda ckpt: [ckpt.parent.parent / "critic" / ckpt.name]) if c.critic is not None else None
    found = state.find_resumable(root, must=ck.resume == "must", companions=critic_of)
    if found is None:
        if ck.resume == "must" or ck.load_from:
            raise UserError(f"checkpoint{'.load_from' if ck.load_from else '.resume'}: no checkpoint in {root}"
                            + (" (checkpoint.resume = 'must')" if not ck.load_from else ""))
        return 0, {}
    loaded = state.load(found, chunks=c.actor.chunks, optimizer=c.actor.optimizer, scheduler=c.actor.scheduler,
                        verified=True)
    if c.critic is not None:
        critic_dir = found.parent.parent / "critic" / found.name
        if not critic_dir.is_dir():
            raise UserError(f"checkpoint: {found} has no critic checkpoint at {critic_dir}")
        state.load(critic_dir, chunks=c.critic.chunks, optimizer=c.critic.optimizer, scheduler=c.critic.scheduler,
                   verified=True)
    extra = loaded.extra
    c.sampler.load_state_dict(extra["sampler"])
    if "kl_coef" in extra and "kl_controller" in c.extras:
        c.extras["kl_controller"].value = extra["kl_coef"]
    c.actor.steps = extra.get("actor_updates", c.actor.steps)
    if c.critic is not None:
        c.critic.steps = extra.get("critic_updates", c.critic.steps)
    return loaded.step, extra


def _save(c: Components, step: int, tracker_run_id) -> None:
    from mrl.checkpoint import state

    from mrl.config.dump import to_toml

    root = checkpoint_root(c.spec)
    if dist.is_initialized() and dist.get_world_size() > 1:   # rank 0 owns the MLflow run: every rank stores its id
        from mrl.platform.dist import stage

        box = [tracker_run_id]
        with stage("checkpoint save"):
            dist.broadcast_object_list(box, src=0)
        tracker_run_id = box[0]
    # What `mrl merge` needs to rebuild the model without the job file.
    model = {"hf_config": c.hf, "model_path": c.spec.model.path, "tokenizer": c.spec.model.tokenizer,
             "dtype": c.spec.model.dtype, "spec_toml": to_toml(c.spec)}
    extra = {"sampler": c.sampler.state_dict(), "mlflow_run_id": tracker_run_id, "actor_updates": c.actor.steps,
             **model, "role": "actor"}
    if "kl_controller" in c.extras:
        extra["kl_coef"] = c.extras["kl_controller"].value
    if c.critic is not None:
        extra["critic_updates"] = c.critic.steps
        state.save(root / "critic", step, chunks=c.critic.chunks, optimizer=c.critic.optimizer,
                   scheduler=c.critic.scheduler, extra={**model, "role": "critic"}, keep_last=c.spec.checkpoint.keep_last)
    state.save(root / "actor", step, chunks=c.actor.chunks,
               optimizer=c.actor.optimizer if c.spec.checkpoint.save_optimizer else None,
               scheduler=c.actor.scheduler, extra=extra, keep_last=c.spec.checkpoint.keep_last)


def _terminate_by_exit():
    """SIGTERM raises `SystemExit(143)` in the main thread, so the run unwinds: the MLflow run is
    marked KILLED and reward workers and the rollout engine are closed. Returns the previous
    handler (None off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, on_sigterm)


def _check_disk(c: Components) -> None:
    """Before the first step, on every rank: the run directory and the checkpoint directory are
    writable, and the latter has room for one checkpoint (estimated from the model's size)."""
    from mrl.checkpoint import state, store
    from mrl.tracking.tracker import run_dir_of

    store.check_writable(run_dir_of(c.spec), 0, "job.output_dir")
    need = state.estimated_bytes(c.actor.chunks, with_optimizer=c.spec.checkpoint.save_optimizer)
    if c.critic is not None:
        need += state.estimated_bytes(c.critic.chunks, with_optimizer=True)
    store.check_writable(checkpoint_root(c.spec), need, "checkpoint.dir")


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
    """Run `spec` to `trainer.total_steps` (or its epochs); returns the last step's metrics."""
    from mrl.platform import teardown
    from mrl.tracking.perf import actor_mfu, throughput
    from mrl.tracking.profile import profile_step
    from mrl.tracking.tracker import Tracker, run_dir_of

    c = build(spec)
    tracker = None
    status = "FAILED"
    last: dict[str, float] = {}
    previous_sigterm = _terminate_by_exit()
    try:
        _check_disk(c)
        if spec.algorithm.kl_reward.enable:
            c.extras["kl_controller"] = _kl_controller(spec)
        start, extra = _resume(c)
        tracker = Tracker.from_spec(spec, total_steps=c.total_steps, rank=c.ctx.rank,
                                    resume_run_id=extra.get("mlflow_run_id"), start_step=start)
        if start == 0:
            tracker.log_spec(spec)
            tracker.log_params({f"data/{k}": v for k, v in c.dataset.stats.items()})
        elif start >= c.total_steps:
            tracker.message(f"resumed at step {start}: the run is already complete ({c.total_steps} steps); "
                            "raise trainer.total_steps to train further")
        else:
            tracker.message(f"resumed from step {start} of {c.total_steps}")
        wait_for_peers("tracking setup")   # rank 0 alone creates or re-attaches the MLflow run
        every = spec.checkpoint.every_steps
        val_every = spec.trainer.val_every_steps
        if spec.trainer.val_before_train and start == 0:
            sync_weights(c)
            tracker.log_metrics(validate(c, 0), 0)
            release_engine(c)
        for step in range(start + 1, c.total_steps + 1):
            with profile_step(spec.trainer.profile_steps, step, run_dir_of(spec), c.ctx.rank):
                step_metrics = train_step(c, step, on_stage=tracker.stage)
            metrics = _reduce_metrics(step_metrics)
            metrics.update(throughput(metrics, c.ctx.dp))
            if torch.cuda.is_available():   # model FLOP utilisation of the actor update
                world = dist.get_world_size() if dist.is_initialized() else 1
                metrics.update(actor_mfu(metrics, c.hf, world, torch.cuda.get_device_name()))
            if val_every and (step % val_every == 0 or step == c.total_steps):
                tracker.stage("validation")
                started = time.perf_counter()
                sync_weights(c)   # the update just changed the policy
                metrics.update(validate(c, step))
                release_engine(c)
                metrics["time/validation"] = _max_over_ranks(time.perf_counter() - started)
            metrics["train/epoch"] = float(c.sampler.epoch)
            tracker.log_metrics(metrics, step)
            for split in ("train", "validation"):
                rows = c.extras.pop(f"samples/{split}", None)
                if rows:
                    tracker.log_samples(split, rows)
            last = metrics
            wait_for_peers("tracking")   # rank 0 alone writes the step's metrics and samples
            if (every and step % every == 0) or step == c.total_steps:
                tracker.stage("checkpoint")
                started = time.perf_counter()
                _save(c, step, tracker.run_id)
                tracker.log_metrics({"time/checkpoint": _max_over_ranks(time.perf_counter() - started)}, step,
                                    console=False)
        status = "FINISHED"
        return last
    except (KeyboardInterrupt, SystemExit):   # Ctrl-C, or SIGTERM from torchrun, Slurm or kill
        status = "KILLED"
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if tracker is not None:
            tracker.finish(status)
        close(c)
        teardown()
        if status == "FINISHED" and spec.checkpoint.save_hf_at_end:
            from mrl.train.export import export_hf

            export_hf(spec, checkpoint_root(spec), c.total_steps, rank=c.ctx.rank)
