"""Start LoRA adapters from a saved PEFT adapter directory (`actor.lora.adapter_path`, `sft.lora.adapter_path`;
verl: `lora_adapter_path`).

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` (`base_model.model.<HF module>.lora_A.weight [r, in]`, `lora_B.weight
[out, r]`), as `peft.PeftModel.save_pretrained` and `mrl merge --format peft` write it. The job's
adapter table must describe the same adapters: `adapter_problems` compares the directory's
config with it before any model is built (one line per disagreement, naming the key), and
`start_adapters` copies the tensors into the adapters `apply_lora` attached, TP-sliced on each
rank through the weight-mapping layer's `LORA_ADAPTERS` rows (the rows the PEFT export uses), so
every tensor is accounted for: a missing or unexpected one, or a wrong shape, is an error naming it.

The frozen base comes from `model.path` as always; the reference model of a LoRA job stays the
base with adapters off (verl's choice too), not the base with the saved adapter.

This module imports no torch at module level: `mrl validate` reads it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT options that change what the adapters compute; mrl's adapters are plain LoRA
_PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False}
_EMPTY = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "layers_pattern")


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The directory's `adapter_config.json` as a dict; ValueError with a one-line reason."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{path} has no {ADAPTER_CONFIG} (a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS})")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def adapter_problems(cfg, key: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) as (dotted key, message) for `cfg.adapter_path` against the adapter table
    `cfg` (`LoraConfig`) at `key` ("actor.lora"). A directory missing on this machine is a warning
    (the job may run elsewhere); everything the directory says that the table does not is an error."""
    errors: list[tuple[str, str]] = []
    where = f"{key}.adapter_path"
    path = cfg.adapter_path
    if path is None:
        return [], []
    if not cfg.rank:
        return [(where, f"starts adapters from {path}, but {key}.rank is 0 (no adapters); set {key}.rank to the "
                        "adapter's r")], []
    if not Path(path).exists():
        return [], [(where, f"{path!r} does not exist on this machine (fine if the job runs elsewhere)")]
    if not Path(path).is_dir():
        return [(where, f"{path} is not a directory (a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS})")], []
    try:
        saved = read_adapter_config(path)
    except ValueError as e:
        return [(where, str(e))], []
    if not (Path(path) / ADAPTER_WEIGHTS).is_file():
        other = " (adapter_model.bin is PEFT's pickle format: save it with safe_serialization=True)" \
            if (Path(path) / "adapter_model.bin").is_file() else ""
        errors.append((where, f"{path} has no {ADAPTER_WEIGHTS}{other}"))
    if saved.get("peft_type", "LORA") != "LORA":
        errors.append((where, f"{path} holds a {saved.get('peft_type')} adapter; only LORA adapters load"))
    if saved.get("r") != cfg.rank:
        errors.append((f"{key}.rank", f"{cfg.rank}, but the adapter at {path} has r = {saved.get('r')}"))
    alpha = saved.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != float(cfg.alpha):
        errors.append((f"{key}.alpha", f"{cfg.alpha:g}, but the adapter at {path} has lora_alpha = {alpha}"))
    targets = saved.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list):
        errors.append((f"{key}.target_modules", f"the adapter at {path} names its modules by the pattern "
                                                f"{targets!r}; mrl needs them listed"))
    elif set(targets) != set(cfg.target_modules):
        missing, extra = sorted(set(targets) - set(cfg.target_modules)), sorted(set(cfg.target_modules) - set(targets))
        said = "; ".join(part for part in (f"the adapter also adapts {missing}" if missing else "",
                                           f"the adapter has no {extra}" if extra else "") if part)
        errors.append((f"{key}.target_modules", f"{list(cfg.target_modules)} differ from the adapter's "
                                                f"{sorted(targets)} at {path}: {said}"))
    for option, plain in _PLAIN.items():
        if option in saved and saved[option] not in (plain, None):
            errors.append((where, f"{path}: {option} = {saved[option]!r}; mrl's adapters are plain LoRA "
                                  f"({option} = {plain!r})"))
    for option in _EMPTY:
        if saved.get(option):
            errors.append((where, f"{path}: {option} = {saved[option]!r} is not supported (adapters on every "
                                  "decoder layer, one rank and alpha)"))
    return errors, []


def start_adapters(chunks, cfg, hf: dict[str, Any], key: str, *, progress=None):
    """Copy the adapter tensors of `cfg.adapter_path` into this rank's adapted `chunks` (after
    `apply_lora`; `key`: the table's dotted name, for errors); a collective over the world.
    Returns the import report."""
    from mrl.errors import UserError
    from mrl.weights.hf_import import Checkpoint, load_hf_checkpoint
    from mrl.weights.tables import PEFT_PREFIX

    errors, _ = adapter_problems(cfg, key)
    if not Path(cfg.adapter_path).is_dir():
        raise UserError(f"{key}.adapter_path: {cfg.adapter_path} does not exist")
    if errors:
        raise UserError(f"{errors[0][0]}: {errors[0][1]}")
    ckpt = Checkpoint(cfg.adapter_path, file=ADAPTER_WEIGHTS, prefix=PEFT_PREFIX)
    return load_hf_checkpoint(chunks, ckpt, hf, adapters=True, progress=progress)
