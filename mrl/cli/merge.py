"""`mrl merge`: a training checkpoint -> a Hugging Face directory (or a PEFT adapter)."""
from __future__ import annotations

import argparse



def cmd_merge(args) -> int:
    import logging

    from mrl.merge import merge
    from mrl.outputs import check_output

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    check_output(args.out, what="mrl merge: output", kind="dir", inputs=[args.checkpoint])
    report = merge(args.checkpoint, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                   verify=args.verify, model=args.model, format=args.format)
    print(report.summary())
    return 0


def add(sub) -> None:
    """The parser of `mrl merge`."""
    p = sub.add_parser("merge", help="convert a training checkpoint (any TP/PP/EP) into a Hugging Face directory",
                       description="Convert a training checkpoint (any TP/PP/EP) into a Hugging Face model directory; "
                                   "a LoRA checkpoint's adapters are merged into full weights (W + alpha/r BA), or with "
                                   "--format peft written as a PEFT adapter directory (adapter_config.json + "
                                   "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads over the base "
                                   "model.")
    p.add_argument("checkpoint", metavar="CKPT", help="a run directory (its checkpoints/actor), a checkpoint root (e.g. RUN/checkpoints/actor) or a step_* directory")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB (default 2GB)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="dtype of the written weights (default: the checkpoint's)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="reload the output with transformers and compare logits with the checkpoint's model "
                        "(default: on below 2B parameters)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the job's model.path, for checkpoints that do not record their model config")
    p.add_argument("--format", choices=("hf", "peft"), default="hf",
                   help="hf: full Hugging Face weights, LoRA adapters merged in (default); peft: a LoRA "
                        "checkpoint's adapters as a PEFT adapter directory over the job's base model")
    p.set_defaults(func=cmd_merge)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "merge": ("mrl merge runs/quickstart-cpu runs/quickstart-cpu/hf",
              "mrl merge runs/my-lora-run out --format peft --dtype bfloat16"),
}
