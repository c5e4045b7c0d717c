"""What `mrl.train.step.update` reports from an engine's per-update records."""
from types import SimpleNamespace

import torch

from mrl.train.step import update


class FakeEngine:
    dp = 1

    def update(self, batch, objective, **kw):
        self.kw = kw
        return [{"pg_loss": 1.0, "grad_norm": 2.0, "epoch": 0.0}, {"pg_loss": 3.0, "grad_norm": 5.0, "epoch": 1.0}]


def test_means_of_the_records_without_the_pass_index():
    engine = FakeEngine()
    batch = {"group_index": torch.tensor([0, 0, 1, 1])}

    class B(dict):
        def __len__(self):
            return 4

    section = SimpleNamespace(micro_batch_tokens=64)
    plan = SimpleNamespace(epochs=2, mini_batches_of=lambda prompts: 1)
    out = update(engine, B(batch), section, plan, objective=None, step=1, name="actor")
    assert out == {"actor/pg_loss": 2.0, "actor/grad_norm": 3.5, "actor/grad_norm_max": 5.0, "actor/updates": 2.0}
    assert engine.kw["epochs"] == 2 and engine.kw["mini_batches"] == 1
