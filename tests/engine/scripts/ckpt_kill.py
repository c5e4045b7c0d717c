"""One-rank helper for the SIGKILL test (usage: ckpt_kill.py save|load DIR).

`save` writes checkpoints of steps 1, 2, 3, ... forever (weights of step s = base + s/100),
printing `SAVED s` after each; the test kills it during a save. `load` loads the latest
checkpoint and checks its weights are exactly those of the step it names (prints `LOADED s`)."""
import sys

import torch

from mrl import checkpoint
from mrl.models import tiny_model as tm
from mrl.platform import setup, teardown
from mrl.platform.config import ParallelConfig, PlatformConfig

# ~7M parameters: a save takes long enough to be interrupted half-way
SPEC = tm.TinyGPTSpec(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=512, vocab_size=8192, seq_length=16)


def weights(model, step):
    torch.manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape) * 0.02 + step / 100)


def main(mode, root):
    setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=1, collective_timeout_s=120), ParallelConfig(), seed=1)
    model = tm.build_tiny_gpt(SPEC)
    if mode == "save":
        step = 1
        while True:
            weights(model, step)
            checkpoint.save(root, step, chunks=[model], extra={"step_marker": step}, keep_last=2)
            print(f"SAVED {step}", flush=True)
            step += 1
    got = checkpoint.load(root, chunks=[model])
    want = tm.build_tiny_gpt(SPEC)
    weights(want, got.step)
    expected = dict(want.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, expected[n]), f"{n}: loaded weights are not those of step {got.step}"
    assert got.extra == {"step_marker": got.step}, got.extra
    print(f"LOADED {got.step}", flush=True)
    teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
