"""`train(spec)`: run a job from its first step, or resume it from its latest checkpoint.

Checkpoints live in `checkpoint.dir` (default `<output_dir>/<name>/checkpoints`): one
`actor/` root (and `critic/`), each atomic with a `latest` pointer. The actor's run state
(`mrl.checkpoint.run_state.RunState`) holds the data position (and the rollouts or partial
groups in hand), the KL controller, the MLflow run id and the update counts, so a resumed run
continues the same prompts, the same MLflow run and the same metrics. `checkpoint.resume`: "auto" resumes when a
checkpoint exists, "never" starts fresh, "must" requires one.

The loop is the same whatever `rollout.placement`: a step takes its rollouts from a
`mrl.train.source.RolloutSource` and learns (`mrl.train.step.train_step`), then `publish` hands
the new weights to the rollout side; validations come back from the source. With a separate
placement the rollout ranks run `mrl.train.serve.serve` instead.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from mrl.checkpoint.config import saves_at
from mrl.checkpoint.run_state import ModelFacts, RunState, job_identity, resume_run, save_run
from mrl.config.job import JobSpec
from mrl.platform.collectives import world_max
from mrl.platform.dist import wait_for_peers
from mrl.train.build import build, close
from mrl.train.metrics import reduce_over_ranks
from mrl.train.parts import Learner, Run, SampleLog
from mrl.train.source import rollout_source
from mrl.train.step import train_step

log = logging.getLogger(__name__)


def checkpoint_root(spec: JobSpec) -> Path:
    return Path(spec.checkpoint.dir)   # resolved: <job.output_dir>/<job.name>/checkpoints unless set


def _resume(run: Run, learner: Learner) -> tuple[int, Optional[RunState]]:
    """(last completed step, its run state) or (0, None) for a fresh start; restores the KL
    controller (the engines' update counts are restored with their weights)."""
    from mrl.checkpoint.compat import before_load

    companions = {"critic": learner.critic} if learner.critic is not None else None
    # another model: one line; a changed reward file: a warning
    start, state = resume_run(checkpoint_root(run.spec), learner.actor, run.spec.checkpoint, companions=companions,
                              before_load=lambda found: before_load(found, run.hf, run.spec.reward),
                              job=job_identity(run.spec))
    if state is not None and state.kl_coef is not None and learner.kl is not None:
        learner.kl.value = state.kl_coef
    return start, state


def _save(run: Run, learner: Learner, rollouts, step: int, tracker_run_id) -> None:
    spec = run.spec
    from mrl.checkpoint.compat import job_reward_files

    state = RunState(**rollouts.state(step), tracking_run_id=tracker_run_id, actor_updates=learner.actor.steps,
                     critic_updates=learner.critic.steps if learner.critic is not None else None,
                     kl_coef=learner.kl.value if learner.kl is not None else None, model=ModelFacts.of(spec, run.hf),
                     reward_files=job_reward_files(spec.reward))
    save_run(checkpoint_root(spec), step, learner.actor, state, spec.checkpoint,
             with_optimizer=spec.checkpoint.save_optimizer,
             companions={"critic": learner.critic} if learner.critic is not None else None, job=job_identity(spec))


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


def train(spec: JobSpec) -> dict[str, float]:
    """Run `spec` to `trainer.total_steps` (or its epochs); returns the last step's metrics
    (on a rollout-only rank: {})."""
    from mrl.train.lifecycle import run_lifecycle

    from mrl.tracking.startup import STARTUP, say_summary

    STARTUP.say("building: process groups, prompts, models (loading weights), rollout engine ...", mark=False)
    started = time.monotonic()
    run, learner, generation, prompts = build(spec)
    STARTUP.say(f"built ({time.monotonic() - started:.1f}s in all)", mark=False)
    with run_lifecycle(spec, rank=run.ctx.global_rank, checkpoint_root=checkpoint_root(spec),
                       close=lambda: close(generation)) as life:
        if learner is None:   # a rollout-only rank (separate placement): the producer
            from mrl.train.serve import serve

            serve(run, generation, prompts)
            life.finished()
            return {}
        from mrl.tracking.tracker import Tracker

        samples = SampleLog()
        rollouts = rollout_source(run, learner, generation, prompts, samples)
        _check_disk(spec, learner)
        start, saved = _resume(run, learner)
        restored = rollouts.load_state(saved, start) if saved is not None else ""
        from mrl.tracking.origin import tracking_start

        # load_from another run: a new run
        resume_run_id, origin = tracking_start(spec, start, saved.to_extra() if saved is not None else {})
        life.tracker = Tracker.from_spec(spec, total_steps=run.total_steps, rank=run.ctx.rank,
                                         resume_run_id=resume_run_id, start_step=start, origin=origin)
        last = _train(run, learner, prompts, rollouts, samples, life.tracker, start, restored)
        say_summary(life.tracker, spec, steps=run.total_steps, checkpoint_root=checkpoint_root(spec))
        life.finished(export_steps=run.total_steps)
        return last


def _train(run: Run, learner: Learner, prompts, rollouts, samples: SampleLog, tracker, start: int,
           restored: str) -> dict[str, float]:
    """The trainer ranks' loop from step `start + 1`; returns the last step's metrics."""
    from mrl.tracking.perf import actor_mfu, throughput
    from mrl.tracking.profile import profile_step
    from mrl.tracking.timeline import StepTimeline
    from mrl.tracking.tracker import run_dir_of

    spec = run.spec
    last: dict[str, float] = {}
    validated: dict[str, float] = {}   # the newest validation logged on its own
    timeline = StepTimeline()           # wall-clock stage timestamps -> durations
    try:
        if start == 0:
            tracker.log_spec(spec)
            tracker.log_params({f"data/{k}": v for k, v in prompts.dataset.stats.items()})
        elif start >= run.total_steps:
            tracker.message(f"resumed at step {start}: the run is already complete ({run.total_steps} steps); "
                            "raise trainer.total_steps to train further")
        else:
            tracker.message(f"resumed from step {start} of {run.total_steps}" + (f"; {restored}" if restored else ""))
            tracker.log_resumed_spec(spec, start)   # overrides may differ from the first start
        wait_for_peers("tracking setup")   # rank 0 alone creates or re-attaches the MLflow run
        rollouts.start(start)   # publishes version `start`
        validated.update(_log_validations(tracker, rollouts.validations(start, on_stage=tracker.stage)))
        every = spec.checkpoint.every_steps
        for step in range(start + 1, run.total_steps + 1):
            with profile_step(spec.trainer.profile_steps, step, run_dir_of(spec), run.ctx.rank):
                step_metrics = train_step(run, learner, rollouts, step, on_stage=tracker.stage, samples=samples)
                rollouts.publish(step)   # the weights leave the trainer here, whatever the placement
            metrics = timeline.durations(reduce_over_ranks(step_metrics, run.dp))
            metrics.update(throughput(metrics, run.dp))
            if torch.cuda.is_available():   # model FLOP utilisation of the actor update
                world = dist.get_world_size() if dist.is_initialized() else 1
                metrics.update(actor_mfu(metrics, run.hf, world, torch.cuda.get_device_name()))
            results = rollouts.validations(step, on_stage=tracker.stage)
            own = [r for r in results if r.version == step]   # this step's validation: logged with it
            for r in own:
                metrics.update(r.metrics)
            tracker.log_metrics(metrics, step)
            for split, rows in [("train", samples.take("train"))] + [("validation", r.rows) for r in own]:
                if rows:
                    tracker.log_samples(split, rows)
            last = metrics
            validated.update(_log_validations(tracker, [r for r in results if r.version != step]))
            wait_for_peers("tracking")   # rank 0 alone writes the step's metrics and samples
            if saves_at(step, every, run.total_steps):
                tracker.stage("checkpoint")
                started = time.perf_counter()
                _save(run, learner, rollouts, step, tracker.run_id)
                tracker.log_metrics({"time/checkpoint": world_max(time.perf_counter() - started, "timing all-reduce")},
                                    step, console=False)
        # the validations still under way (separate: the rollout side's, of the last steps)
        validated.update(_log_validations(tracker, rollouts.validations(run.total_steps, final=True)))
        if last and validated:   # a step's own validation is newer than one logged apart before it
            last = {**validated, **last}
    except BaseException:
        rollouts.close(wait=False)
        raise
    rollouts.close()
    return last


def _log_validations(tracker, results) -> dict[str, float]:
    """Log validations under the step they validated, apart from a step's metrics (the rollout
    side's with a separate placement, or one before the first step); returns the newest one's
    metrics ({} when none)."""
    newest: dict[str, float] = {}
    for r in results:
        tracker.log_metrics(r.metrics, r.version, console=False)
        tracker.message(f"validation of step {r.version}: reward {r.metrics['val/reward_mean']:.4g}")
        newest = r.metrics
        if r.rows:
            tracker.log_samples("validation", r.rows)
    return newest
