"""`mrl eval`: the training loop's validation (`mrl.train.evaluate.evaluate`: the validation set,
the validation sampling settings, the job's rewards) of a checkpoint's policy, in one process.
The metrics are the `val/*` ones a training run logs at that step."""
from __future__ import annotations

import dataclasses
from typing import Optional

from mrl.offline.target import Target


@dataclasses.dataclass
class EvalReport:
    """`val/*` metrics of one checkpoint and the sample rows validation logged."""

    source: str                 # what was evaluated (`Target.label`)
    step: int
    metrics: dict[str, float]
    samples: Optional[list]     # rows of `mrl.tracking.samples.sample_rows` (trainer.log_samples_every > 0)

    def table(self) -> str:
        width = max(len(k) for k in self.metrics)
        lines = [f"mrl eval: {self.source}"]
        lines += [f"  {k:<{width}}  {v:.6g}" for k, v in sorted(self.metrics.items())]
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"source": self.source, "step": self.step, "metrics": self.metrics, "samples": self.samples}


def evaluate_target(target: Target) -> EvalReport:
    """Validate `target`'s weights exactly as the training loop validates policy version `step`."""
    from mrl.offline.session import session
    from mrl.train.evaluate import evaluate, validation_set
    from mrl.train.parts import Prompts, SampleLog

    with session(target) as (run, gen, reward_model):
        val = validation_set(run, Prompts(dataset=None, samplers={}, tool_schemas=gen.tool_schemas))
        prompts = Prompts(dataset=val, samplers={}, val_dataset=val)
        samples = SampleLog()
        metrics = evaluate(run, gen, prompts, target.step, samples=samples, reward_model=reward_model)
    return EvalReport(source=target.label, step=target.step, metrics=metrics, samples=samples.take("validation"))
