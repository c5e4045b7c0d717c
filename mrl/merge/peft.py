"""A LoRA checkpoint as a PEFT adapter directory: `adapter_config.json` + `adapter_model.safetensors`.

`peft.PeftModel.from_pretrained(base, out)` loads it over the base model the job trained on
(`base_model_name_or_path`). The tensors are the adapters themselves, streamed through the
weight-mapping layer (`Exporter(..., adapters=True)`, rows `tables.LORA_ADAPTERS`), so they are
gathered over TP and PP exactly as full weights are. mrl keeps one `A` and one `B` per Hugging
Face projection even where megatron fuses the base weight (q/k/v, gate/up), which is PEFT's
layout: `...q_proj.lora_A.weight [r, hidden]`, `...q_proj.lora_B.weight [q rows, r]`, and the
scale is PEFT's `lora_alpha / r`. No tensor is split, duplicated or rescaled on the way out.

`write_adapter` works in any parallel layout (only `targets` writes); `mrl merge --format peft`
calls it on the single-process model it loaded from the checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.errors import UserError
from mrl.models.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS



def adapter_config(lora: dict[str, Any], base: str) -> dict[str, Any]:
    """PEFT's `LoraConfig` as JSON for mrl's adapter settings (`rank`, `alpha`, `dropout`,
    `target_modules`): plain LoRA (no rsLoRA, DoRA or bias), every decoder layer."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": list(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_base(model_path: Optional[str]) -> str:
    """`base_model_name_or_path`: the job's `model.path` (a local directory made absolute, a Hub id
    as is). A `builtin:` preset has no Hugging Face checkpoint PEFT could load: a user error."""
    from mrl.models.facts import builtin_preset

    if model_path is None:
        raise UserError("merge --format peft: the checkpoint does not record its base model; pass --model")
    if builtin_preset(model_path) is not None:
        raise UserError(f"merge --format peft: the base model is the preset {model_path!r}, which has no Hugging "
                        "Face checkpoint for peft to load; merge into full weights instead (--format hf)")
    path = Path(model_path)
    return str(path.resolve()) if path.is_dir() else model_path


def write_adapter(chunks, hf: dict[str, Any], lora: dict[str, Any], out_dir: str | Path, *, base: str,
                  dtype: Optional[torch.dtype] = None, stored: Optional[dict[str, torch.dtype]] = None,
                  targets: int = 0) -> int:
    """Write the adapters of `chunks` (this rank's model chunks, any TP/PP) as a PEFT directory at
    `out_dir` on global rank `targets`; every rank must call it. Each tensor is cast to `dtype`,
    else to its `stored` entry (megatron parameter name -> the checkpoint's dtype), else kept as
    the parameter is. Returns the tensor count (0 on the other ranks)."""
    import torch.distributed as dist

    from mrl.merge.writer import save_tensors
    from mrl.weights import Exporter
    from mrl.weights.tables import PEFT_PREFIX

    exporter = Exporter(chunks, hf, dtype=dtype, adapters=True)
    if not exporter.plan:
        raise UserError("merge --format peft: the model carries no LoRA adapters")
    keep = {}
    for p in exporter.placements:
        if stored and p.name.split("/", 1)[1] in stored:
            keep.update({n: stored[p.name.split("/", 1)[1]] for n in p.hf_names})
    tensors = {PEFT_PREFIX + name: (t.to(keep[name]) if name in keep else t)
               for name, t in exporter.stream(targets=targets)}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != targets:
        return 0
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors.items(), out_dir / ADAPTER_WEIGHTS)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, base), indent=2) + "\n")
    return len(tensors)


def peft_logits(out_dir: Path, base: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of `base` (float32) with the adapter directory loaded by `peft`."""
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError("merge --format peft --verify: verification loads the adapter with the `peft` package, "
                        "which is not installed (pip install peft, or pass --no-verify)") from None
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, str(out_dir)).eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    with torch.no_grad():
        return model(tokens).logits.float()
