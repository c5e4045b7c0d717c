"""Regenerate mrl/config/verl_defaults.json: verl's default value of every key, per named config.

`mrl convert` starts from the config a verl command composes (`--config-name`, `model_engine=`,
a recipe's entry point), then applies the YAMLs and overrides. It drops keys equal to verl's
default that have no mrl counterpart (or map to mrl's own default), so that a YAML dumped by verl,
which holds every default, converts into a short job. The defaults come from the generated configs
that verl ships in its sdist (one per model engine), and the recipe configs (DAPO, entropy) are
those generated configs with the recipe YAML merged over them:

    pip download --no-deps --no-binary :all: verl==0.9.1 -d /tmp/verl091 && tar xzf /tmp/verl091/verl-0.9.1.tar.gz -C /tmp/verl091
    python tools/verl/defaults.py /tmp/verl091/verl-0.9.1 [VERL_RECIPE_CHECKOUT]

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
ENGINES = {"ppo_trainer": "_generated_ppo_trainer.yaml", "ppo_megatron_trainer": "_generated_ppo_megatron_trainer.yaml",
           "ppo_veomni_trainer": "_generated_ppo_veomni_trainer.yaml",
           "ppo_torchtitan_trainer": "_generated_ppo_torchtitan_trainer.yaml"}
RECIPES = {"dapo_trainer": "dapo/config/dapo_trainer.yaml", "dapo_megatron_trainer": "dapo/config/dapo_megatron_trainer.yaml",
           "entropy_trainer": "entropy/config/entropy_trainer.yaml"}


def _overlay(base: dict, tree: dict) -> dict:
    out = dict(base)
    for key, value in flatten(tree):
        for k in [k for k in out if k == key or k.startswith(key + ".") or key.startswith(k + ".")]:
            del out[k]      # a value replaces the subtree (or the scalar) it lands on
        out[key] = value
    return out


def main(sdist: str, recipe: str | None = None) -> None:
    config_dir = Path(sdist) / "verl" / "trainer" / "config"
    version = next((line.split(":", 1)[1].strip() for line in (Path(sdist) / "PKG-INFO").read_text().splitlines()
                    if line.startswith("Version:")), "?") if (Path(sdist) / "PKG-INFO").exists() else "?"
    configs = {name: dict(flatten(yaml.safe_load((config_dir / f).read_text()))) for name, f in ENGINES.items()}
    if recipe:
        for name, rel in RECIPES.items():
            tree = yaml.safe_load((Path(recipe) / rel).read_text())
            base = next(d for d in tree.pop("defaults") if isinstance(d, str) and d != "_self_")
            tree.pop("hydra", None)
            configs[name] = _overlay(configs[base], tree)
    OUT.write_text(json.dumps({"verl": version, "configs": configs}, indent=0, sort_keys=True) + "\n")
    print(f"{OUT}: verl {version}; " + ", ".join(f"{n} {len(d)} keys" for n, d in configs.items()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
