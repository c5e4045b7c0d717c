"""verl's legacy reward keys moved into the `reward.*` namespace of verl 0.9, as verl 0.9.1 itself
moves them before it reads them (`migrate_legacy_reward_impl`, verl/experimental/reward_loop):

- `reward_model.num_workers` -> `reward.num_workers`; `reward_model.reward_manager` ->
  `reward.reward_manager.name` (`reward_loop_source/module_path/class_name` -> `reward.reward_manager.source/module.*`);
- `custom_reward_function.*` (when any is set) replaces `reward.custom_reward_function.*`
  (so `custom_reward_function.reward_kwargs.*` becomes the function's keyword arguments);
- `reward_model.enable/enable_resource_pool/n_gpus_per_node/nnodes` -> `reward.reward_model.*`,
  `reward_model.model.path` -> `reward.reward_model.model_path`, `reward_model.rollout.*` ->
  `reward.reward_model.rollout.*`;
- `reward_model.reward_kwargs.*` (DAPO's overlong buffer) replaces `reward.reward_kwargs.*`;
- `sandbox_fusion.*` (when any is set) replaces `reward.sandbox_fusion.*`.

And the spelling of DAPO recipes before `reward_kwargs` (`reward_model.overlong_buffer.*`) becomes
`reward.reward_kwargs.overlong_buffer_cfg.*` where that is not set. Each moved key keeps the name
the user wrote (`aliases`), so the job's comments name it.
"""
from __future__ import annotations

from typing import Any

from mrl.convert.verl_config import VerlConfig, flatten

_EXACT = {
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "reward_model.reward_loop_module_path": "reward.reward_manager.module.path",
    "reward_model.reward_loop_class_name": "reward.reward_manager.module.name",
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.model.path": "reward.reward_model.model_path",
}
# (legacy prefix, new prefix, whole): a whole table replaces the new one when any of its keys is set
_TABLES = (("custom_reward_function.", "reward.custom_reward_function.", True),
           ("reward_model.reward_kwargs.", "reward.reward_kwargs.", True),
           ("sandbox_fusion.", "reward.sandbox_fusion.", True),
           ("reward_model.rollout.", "reward.reward_model.rollout.", False))
OLD_OVERLONG, NEW_OVERLONG = "reward_model.overlong_buffer.", "reward.reward_kwargs.overlong_buffer_cfg."


def migrate(cfg: VerlConfig, resolved: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Move legacy reward keys in `cfg` (raw values) and `resolved` to verl 0.9's names.
    Returns (new key -> legacy key, notes)."""
    aliases: dict[str, str] = {}
    notes: list[str] = []
    _expand_dicts(cfg, resolved)

    def replaced(k: str, by: str) -> None:
        """`k` is dropped the way verl drops it; a value the user gave is said to be unread."""
        if cfg.origin.get(k) != "verl default":
            notes.append(f"{aliases.get(k, k)} = {resolved.get(k)!r}: not read by verl {_version()}, which replaces "
                         f"it with {by} (migrate_legacy_reward_impl)")
        _drop(cfg, resolved, k)

    def move(old: str, new: str) -> None:
        for k in [k for k in cfg.raw if k == new or k.startswith(new + ".")]:
            replaced(k, old)
        cfg.raw[new], cfg.origin[new] = cfg.raw.pop(old), cfg.origin.pop(old)
        resolved[new] = resolved.pop(old)
        aliases[new] = aliases.pop(old, old)

    for old, new in _EXACT.items():
        if resolved.get(old) is not None:
            move(old, new)
    for old_prefix, new_prefix, whole in _TABLES:
        keys = [k for k in cfg.raw if k.startswith(old_prefix) and resolved.get(k) is not None and resolved.get(k) != {}]
        if not keys:
            continue
        if whole:
            for k in [k for k in cfg.raw if k.startswith(new_prefix)]:
                replaced(k, old_prefix + "*")
            keys = [k for k in cfg.raw if k.startswith(old_prefix)]
        for k in keys:
            move(k, new_prefix + k[len(old_prefix):])
    for k in [k for k in cfg.raw if k.startswith(OLD_OVERLONG)]:
        new = NEW_OVERLONG + k[len(OLD_OVERLONG):]
        if new in cfg.raw and cfg.origin.get(new) != "verl default":
            if resolved[new] == resolved[k]:      # the recipe's own interpolation already carried it over
                notes.append(f"{k} = {resolved[k]!r}: verl reads it as {aliases.get(new, new)}")
                _drop(cfg, resolved, k)
            continue
        if cfg.origin.get(k) != "verl default" or new not in cfg.raw:
            move(k, new)
    return aliases, notes


def _version() -> str:
    from mrl.convert.verl_config import verl_version

    return verl_version()


def _drop(cfg: VerlConfig, resolved: dict, key: str) -> None:
    cfg.raw.pop(key, None)
    cfg.origin.pop(key, None)
    resolved.pop(key, None)


def _expand_dicts(cfg: VerlConfig, resolved: dict) -> None:
    """A reward key whose interpolation resolved to a table (`overlong_buffer_cfg:
    ${reward_model.overlong_buffer}`) becomes its leaves, so each leaf maps on its own."""
    for key in [k for k, v in resolved.items() if isinstance(v, dict) and v and
                k.startswith(("reward_model.", "reward.", "custom_reward_function."))]:
        origin = cfg.origin.get(key)
        value = resolved[key]
        _drop(cfg, resolved, key)
        for k, v in flatten(value, key + "."):
            cfg.raw[k], cfg.origin[k], resolved[k] = v, origin, v
