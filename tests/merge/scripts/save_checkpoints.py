"""Save Megatron checkpoints of tiny HF models at a multi-rank layout, under torchrun (gloo).

For each `NAME:ARCH_DIR:ROLE:LAYOUT:DTYPE` case: build the role's model at LAYOUT (tp2, ep2, ...),
import the HF weights from ARCH_DIR (or keep the seeded init for `builtin:` presets), save it
with `mrl.checkpoint.state.save` under `<out>/NAME` with the `extra` the training loop writes,
and (rank 0) write the exported HF tensors to `<out>/NAME.expected.safetensors`, the reference a
merge must reproduce bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def save_case(out: Path, name: str, source: str, role: str, layout: str, dtype: str) -> None:
    from safetensors.torch import save_file

    from mrl.checkpoint import state
    from mrl.models.megatron import complete_hf_config, hf_config
    from mrl.models.config import ModelConfig
    from mrl.models.roles import build_role_model
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import Exporter, load_hf_checkpoint

    sizes = {"tp": 1, "pp": 1, "ep": 1}
    sizes[layout[:2]] = int(layout[2:])
    world = int(os.environ["WORLD_SIZE"])
    parallel = ParallelConfig(tensor=sizes["tp"], pipeline=sizes["pp"], expert=sizes["ep"], distributed_optimizer=False)
    setup(PlatformConfig(device="cpu", ranks_per_node=world, collective_timeout_s=120), parallel, seed=3)
    builtin = source.startswith("builtin:")
    hf = hf_config(ModelConfig(path=source)) if builtin else complete_hf_config(
        json.loads((Path(source) / "config.json").read_text()))
    model = build_role_model(role, hf, parallel, dtype=dtype, device="cpu")
    if not builtin:
        load_hf_checkpoint([model], source, hf, role=role)
    extra = {"hf_config": hf, "model_path": source, "tokenizer": None, "dtype": dtype,
             "spec_toml": "", "role": role}
    state.save(out / name, 10, chunks=[model], extra=extra)
    from mrl.weights.stacked import stack_experts

    got = dict(stack_experts(Exporter([model], hf).stream(targets=0), hf))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in got.items()}, str(out / f"{name}.expected.safetensors"))
        print(f"SAVED {name} {layout} {len(got)} tensors", flush=True)
    teardown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="+", help="NAME:SOURCE:ROLE:LAYOUT:DTYPE")
    a = ap.parse_args()
    for case in a.cases:
        name, source, role, layout, dtype = case.split(":", 1)[0], *case.split(":", 1)[1].rsplit(":", 3)
        save_case(Path(a.out), name, source, role, layout, dtype)


if __name__ == "__main__":
    main()
