"""What a checkpoint carries besides the weights, typed (`RunState`), and the one save/resume path
of `mrl train` and `mrl sft` (`save_run`, `resume_run`).

A checkpoint's `extra` (rank 0's plain values, read back with `weights_only=True`) is written
only by `RunState.to_extra` and read only by `RunState.from_extra`, here. Its keys stay those
older checkpoints hold, so they still resume and merge:

| field | key | written by | read by |
| --- | --- | --- | --- |
| trainer | "trainer" ("sft"; absent for RL) | RL, SFT | SFT resume (refuses an RL checkpoint) |
| role | "role" | RL, SFT | `mrl merge` |
| data position | "sampler" | RL, SFT | resume |
| tracking run | "mlflow_run_id" | RL, SFT | resume (same MLflow run) |
| actor / critic updates | "actor_updates", "critic_updates" | RL, SFT | resume (schedules) |
| KL coefficient | "kl_coef" | RL | resume |
| partial groups in hand | "rollout_carry" | RL | resume (`mrl.train.carry`) |
| queued rollouts | "rollout_queue" | RL, separate | resume (`mrl.train.codec`) |
| model facts | "hf_config", "model_path", "tokenizer", "dtype", "spec_toml" | RL, SFT | `mrl merge` |
| adapters | "lora" | SFT | `mrl merge` |
| reward files | "reward_files" | RL | resume (`mrl.checkpoint.compat`: a changed reward file is a warning) |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from mrl.errors import UserError


@dataclass
class ModelFacts:
    """What `mrl merge` needs to rebuild the model without the job file."""

    hf_config: Optional[dict] = None
    model_path: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Optional[str] = None
    spec_toml: Optional[str] = None

    @classmethod
    def of(cls, spec, hf: dict) -> "ModelFacts":
        from mrl.schema.dump import to_toml

        return cls(hf_config=hf, model_path=spec.model.path, tokenizer=spec.model.tokenizer, dtype=spec.model.dtype,
                   spec_toml=to_toml(spec))


@dataclass
class RunState:
    """A run's state besides the weights, as one checkpoint stores it."""

    role: str = "actor"                        # "actor" | "critic"
    trainer: str = "rl"                        # "rl" | "sft"
    sampler: Optional[dict] = None             # the data position
    tracking_run_id: Optional[str] = None
    actor_updates: Optional[int] = None
    critic_updates: Optional[int] = None
    kl_coef: Optional[float] = None
    rollout_carry: Optional[dict] = None       # partial rollouts in hand (encoded)
    rollout_queue: list = field(default_factory=list)   # rollouts queued for later steps (encoded)
    model: ModelFacts = field(default_factory=ModelFacts)
    lora: Optional[dict] = None                # adapter settings (SFT)
    reward_files: Optional[dict] = None        # hashes of the reward files that scored it (RL; resume warns on a change)

    def to_extra(self) -> dict:
        out = {"hf_config": self.model.hf_config, "model_path": self.model.model_path,
               "tokenizer": self.model.tokenizer, "dtype": self.model.dtype, "spec_toml": self.model.spec_toml,
               "role": self.role}
        if self.role == "critic":   # a critic's checkpoint holds its model facts only
            return out
        out.update({"sampler": self.sampler, "mlflow_run_id": self.tracking_run_id,
                    "actor_updates": self.actor_updates})
        if self.trainer != "rl":
            out["trainer"] = self.trainer
        optional = {"kl_coef": self.kl_coef, "critic_updates": self.critic_updates, "lora": self.lora,
                    "reward_files": self.reward_files}
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.trainer == "rl":
            out["rollout_carry"] = self.rollout_carry or {}
            if self.rollout_queue:
                out["rollout_queue"] = list(self.rollout_queue)
        return out

    @classmethod
    def from_extra(cls, extra: dict) -> "RunState":
        facts = ModelFacts(**{k: extra.get(k) for k in ("hf_config", "model_path", "tokenizer", "dtype", "spec_toml")})
        return cls(role=extra.get("role") or "actor", trainer=extra.get("trainer") or "rl",
                   sampler=extra.get("sampler"), tracking_run_id=extra.get("mlflow_run_id"),
                   actor_updates=extra.get("actor_updates"), critic_updates=extra.get("critic_updates"),
                   kl_coef=extra.get("kl_coef"), rollout_carry=extra.get("rollout_carry"),
                   rollout_queue=list(extra.get("rollout_queue") or []), model=facts, lora=extra.get("lora"),
                   reward_files=extra.get("reward_files"))


def job_identity(spec) -> dict:
    """What identifies a job's checkpoints (recorded in each manifest): its name and its run
    directory (`<job.output_dir>/<job.name>`, absolute), which also holds its MLflow run."""
    return {"name": spec.job.name, "run_dir": str((Path(spec.job.output_dir) / spec.job.name).resolve())}


def refuse_foreign(root: Path, job: Optional[dict], roles: tuple[str, ...] = ("actor",)) -> None:
    """A checkpoint directory belongs to one job: `UserError` when `root/<role>` holds a
    checkpoint whose manifest names another job (checkpoints of older mrl versions name none)."""
    from mrl.checkpoint import manifest, store

    if job is None:
        return
    for role in roles:
        for found in store.checkpoints(root / role):
            other = manifest.job_of(found)
            if other is not None and other != job:
                raise UserError(
                    f"checkpoint.dir: {found} was saved by job {other.get('name')!r} (run directory "
                    f"{other.get('run_dir')}), not by this job {job['name']!r} ({job['run_dir']}); two jobs cannot "
                    "share one checkpoint.dir: give this job its own, or start from that checkpoint with "
                    "checkpoint.load_from (a new run)")


def save_run(root: Path, step: int, engine, state: RunState, checkpoint, *, with_optimizer: bool,
             companions: Optional[dict] = None, job: Optional[dict] = None) -> None:
    """Save `engine` (the actor) under `root/actor` with `state`, and each companion engine
    (`{"critic": engine}`) under `root/<name>` with its model facts; `checkpoint` is the job's
    `[checkpoint]` section, `job` its `job_identity` (recorded in every manifest). The tracking
    run id is rank 0's on every rank (it owns the run)."""
    from mrl.checkpoint import state as ckpt
    from mrl.platform.collectives import broadcast_object

    state.tracking_run_id = broadcast_object(state.tracking_run_id, "checkpoint save")
    for name, other in (companions or {}).items():
        ckpt.save(root / name, step, chunks=other.chunks, optimizer=other.optimizer, scheduler=other.scheduler,
                  extra=RunState(role=name, model=state.model).to_extra(), keep_last=checkpoint.keep_last, job=job)
    ckpt.save(root / "actor", step, chunks=engine.chunks, optimizer=engine.optimizer if with_optimizer else None,
              scheduler=engine.scheduler, extra=state.to_extra(), keep_last=checkpoint.keep_last, job=job)


def resume_run(root: Path, engine, checkpoint, *, companions: Optional[dict] = None,
               trainer: str = "rl", before_load: Optional[Callable[[Path], None]] = None,
               job: Optional[dict] = None) -> tuple[int, Optional[RunState]]:
    """(last completed step, its `RunState`) of the newest intact checkpoint under `root/actor`
    (or `checkpoint.load_from`) loaded into `engine` and the companions (`{"critic": engine}`,
    found beside it), or (0, None) for a fresh start (`checkpoint.resume`). `before_load(found)`
    runs before any tensor is read (checks that may refuse the checkpoint). First, `root` must
    hold no other job's checkpoint (`refuse_foreign`): this job saves, prunes and resumes there,
    and would otherwise continue that job's checkpoint and MLflow run."""
    from mrl.checkpoint import state as ckpt

    refuse_foreign(root, job, ("actor", *(companions or {})))
    given = checkpoint.load_from
    actor_root = Path(given) if given else root / "actor"
    if checkpoint.resume == "never" and not given:
        return 0, None
    names = list(companions or {})
    beside = (lambda found: [found.parent.parent / n / found.name for n in names]) if names else None
    found = ckpt.find_resumable(actor_root, must=checkpoint.resume == "must", companions=beside)
    if found is None:
        if checkpoint.resume == "must" or given:
            raise UserError(f"checkpoint{'.load_from' if given else '.resume'}: no checkpoint in {actor_root}"
                            + (" (checkpoint.resume = 'must')" if not given and trainer == "rl" else ""))
        return 0, None
    if before_load is not None:
        before_load(found)
    loaded = ckpt.load(found, chunks=engine.chunks, optimizer=engine.optimizer, scheduler=engine.scheduler,
                       verified=True)
    run_state = RunState.from_extra(loaded.extra)
    if trainer == "sft" and run_state.trainer != "sft":
        raise UserError(f"checkpoint {found} was not written by mrl sft (an RL actor's checkpoint); start the SFT "
                        "run in another checkpoint.dir, or pass the merged model as model.path")
    for name, other in (companions or {}).items():
        where = found.parent.parent / name / found.name
        if not where.is_dir():
            raise UserError(f"checkpoint: {found} has no {name} checkpoint at {where}")
        ckpt.load(where, chunks=other.chunks, optimizer=other.optimizer, scheduler=other.scheduler, verified=True)
    if run_state.actor_updates is not None:
        engine.steps = run_state.actor_updates
    if run_state.critic_updates is not None and "critic" in (companions or {}):
        companions["critic"].steps = run_state.critic_updates
    return loaded.step, run_state
