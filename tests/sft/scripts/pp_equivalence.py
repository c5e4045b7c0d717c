"""SFT steps at pipeline 2 vs pipeline 1, full fine-tuning and LoRA, in one 2-rank launch.

`torchrun --nproc_per_node 2 pp_equivalence.py JOB STEPS OUT [overrides]`: for each of full
fine-tuning and LoRA (`sft.lora.rank=4`, every projection), runs `STEPS` optimizer steps of the
job at PP2 (one decoder layer per stage) and then, in a fresh platform, at PP1 (the two ranks
data-parallel, the same global batch); prints on rank 0 `RESULT {...}` with each run's per-step
`train/loss` and `train/grad_norm`, its validation loss after the steps, and (LoRA) the gathered
adapters after the steps; LoRA runs also write their PEFT adapter directory to `OUT/peft_pp<N>`.
"""
import json
import os
import sys


def run(job: str, steps: int, overrides: list[str], peft_dir: str | None = None) -> dict:
    import torch.distributed as dist

    from mrl.config.loader import load
    from mrl.platform import teardown
    from mrl.sft.loop import build, train_step, validation_loss
    from mrl.weights.layout import unwrap

    spec, _ = load(job, overrides)
    r = build(spec)
    out = {"loss": [], "grad_norm": []}
    for _ in range(steps):
        m = train_step(r)
        out["loss"].append(m["train/loss"])
        out["grad_norm"].append(m["train/grad_norm"])
    out["val_loss"] = validation_loss(r)
    # the adapters after the steps, every PP stage's sent to rank 0 by name (global layer numbers)
    mine = {}
    for chunk in r.engine.chunks:
        model = unwrap(chunk)
        for name, p in model.named_parameters():
            if ".lora." in name:
                parts = name.split(".")
                parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
                mine[".".join(parts)] = p.detach().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    adapters = {}
    for d in everyone:   # PP2: each stage's layer; PP1 (DP2): the same full set twice
        adapters.update(d)
    out["adapters"] = {k: v.tolist() for k, v in sorted(adapters.items())}
    if adapters and peft_dir:   # the PEFT adapter directory, gathered over the stages by the exporter
        from mrl.merge.peft import write_adapter

        lora = spec.sft.lora
        write_adapter(r.engine.chunks, r.hf, {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                              "target_modules": lora.target_modules}, peft_dir, base=spec.model.path)
    teardown()
    return out


def main():
    job, steps, out, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    results = {}
    for kind, extra in (("full", []), ("lora", ["sft.lora.rank=4", "sft.optim.lr=1e-2"])):
        for pp in (2, 1):
            results[f"{kind}_pp{pp}"] = run(job, steps, [*rest, *extra, f"parallel.pipeline={pp}"],
                                            peft_dir=f"{out}/peft_pp{pp}")
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
