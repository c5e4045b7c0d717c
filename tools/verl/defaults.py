"""Regenerate mrl/config/verl_defaults.json: verl's default value of every `main_ppo` key.

`mrl convert` drops keys whose value is verl's default when they have no mrl counterpart (or map
to mrl's own default), so that a YAML dumped by verl, which holds every default, converts into a
short job. The defaults come from verl's generated configs, one set per backend (FSDP, and
Megatron for `actor_rollout_ref.actor.strategy=megatron`):

    python tools/verl/defaults.py VERL_CHECKOUT/verl/trainer/config

Values are kept as verl writes them (interpolations unresolved).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mrl.convert.verl_config import flatten  # noqa: E402 - the one flattening rule the converter uses

OUT = Path(__file__).resolve().parents[2] / "mrl" / "config" / "verl_defaults.json"
FILES = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")




def main(config_dir: str) -> None:
    defaults = {}
    for backend, name in zip(("fsdp", "megatron"), FILES):
        tree = yaml.safe_load((Path(config_dir) / name).read_text())
        defaults[backend] = dict(flatten(tree))
    OUT.write_text(json.dumps(defaults, indent=0, sort_keys=True) + "\n")
    print(f"{OUT}: {', '.join(f'{b} {len(d)} keys' for b, d in defaults.items())}")


if __name__ == "__main__":
    main(sys.argv[1])
