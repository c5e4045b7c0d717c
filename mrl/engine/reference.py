"""The reference model of a LoRA actor: the actor's own modules with every adapter off, so the
KL is to the model the adapters started from and no second copy of the weights is held."""
from __future__ import annotations

from mrl.engine.engine import Engine
from mrl.models.lora import adapters_disabled
from mrl.weights.layout import unwrap


def reference_engine(actor):
    """An eval-only engine over `actor`'s own modules whose passes run with every adapter off:
    the reference model of a LoRA actor is its frozen base, so no second copy of the weights is
    held (the KL is to the model the adapters started from)."""

    class _Reference(Engine):
        def forward_only(self, batch, output_fn, **kw):
            with adapters_disabled(self.chunks):
                return super().forward_only(batch, output_fn, **kw)

    return _Reference([unwrap(c) for c in actor.chunks], name="ref")
