"""The job spec root: one section per component, plus the `job` section itself."""
from __future__ import annotations

from mrl.algos.config import AlgorithmConfig
from mrl.checkpoint.config import CheckpointConfig
from mrl.data.config import DataConfig
from mrl.models.config import ModelConfig
from mrl.platform.config import ParallelConfig, PlatformConfig
from mrl.reward.config import RewardConfig
from mrl.rollout.config import RolloutConfig
from mrl.schema.section import SEED_MAX, option, section
from mrl.tracking.config import TrackingConfig
from mrl.train.config import ActorConfig, CriticConfig, DistillConfig, RefConfig, TrainerConfig


@section
class JobConfig:
    """Identity of the run."""

    name: str = option("", help="run name (default: the job file's stem); a plain name: the run directory <output_dir>/<name>")
    seed: int = option(1, ge=0, le=SEED_MAX, help="global seed")
    output_dir: str = option("runs", help="runs go under <output_dir>/<name>")
    description: str = option("", help="free text: the MLflow run's description")


@section
class JobSpec:
    """A whole job. Every field is a section table in the TOML file."""

    job: JobConfig = option(factory=JobConfig)
    platform: PlatformConfig = option(factory=PlatformConfig)
    parallel: ParallelConfig = option(factory=ParallelConfig)
    model: ModelConfig = option()
    data: DataConfig = option(factory=DataConfig)
    rollout: RolloutConfig = option(factory=RolloutConfig)
    algorithm: AlgorithmConfig = option(factory=AlgorithmConfig)
    actor: ActorConfig = option(factory=ActorConfig)
    critic: CriticConfig = option(factory=CriticConfig)
    ref: RefConfig = option(factory=RefConfig)
    distill: DistillConfig = option(factory=DistillConfig)
    reward: RewardConfig = option(factory=RewardConfig)
    trainer: TrainerConfig = option(factory=TrainerConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    tracking: TrackingConfig = option(factory=TrackingConfig)
