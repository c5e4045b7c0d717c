"""Closest-key suggestions for unknown keys, including verl's names for the same setting."""
from __future__ import annotations

import difflib

from mrl.config.verl_table import reasons as _reasons
from mrl.config.verl_table import verl_table

# verl key -> mrl key, and verl keys with no mrl counterpart -> why: views of the verl key table
# (mrl/config/verl_keys.toml, also read by `mrl convert` and `mrl keys --verl`; CONTRIBUTING.md prints it).
VERL_TO_MRL: dict[str, str] = {k: m.target for k, m in verl_table().mapped.items()}
VERL_NOT_APPLICABLE: dict[str, str] = dict(verl_table().not_applicable)

_PARAM_OFFLOAD = _reasons()["param_offload"]
_SKIP_TOKENIZER = _reasons()["skip_tokenizer"]
_BALANCE = _reasons()["balance"]

# mrl keys that existed once and were removed because mrl did not act on them: a job that still
# sets one gets this reason instead of "unknown key".
REMOVED_KEYS: dict[str, str] = {
    "actor.offload_params": _PARAM_OFFLOAD,
    "critic.offload_params": _PARAM_OFFLOAD,
    "ref.offload_params": _PARAM_OFFLOAD,
    "rollout.skip_tokenizer_init": _SKIP_TOKENIZER,
    "trainer.balance_batch": _BALANCE,
    "checkpoint.async_save": "checkpoints are written synchronously (atomic rename, manifest last); background "
                             "saves are not built, so the key was removed",
}


def explain_unknown(unknown: str, siblings: list[str], valid_keys: list[str]) -> str:
    """The message for an unknown key: why a removed or inapplicable key has no mrl setting, or
    "unknown key; did you mean `x`?"."""
    reason = REMOVED_KEYS.get(unknown) or verl_table().reason(unknown)
    if reason is None and "sft.examples_per_step" in valid_keys:   # an SFT job: verl's SFT trainer names
        from mrl.sft.config import VERL_SFT_NOT_APPLICABLE

        reason = VERL_SFT_NOT_APPLICABLE.get(unknown)
    if reason is not None:
        return f"not an mrl key: {reason}; remove it"
    hint = suggest(unknown, siblings, valid_keys)
    return "unknown key" + (f"; did you mean `{hint}`?" if hint else "")

# Leaf names that are too generic to map on their own ("enable", "path", ...).
_AMBIGUOUS_LEAVES = {"enable", "path", "name", "type", "lr", "len"}


def _verl_leaf_map() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for verl, mrl in VERL_TO_MRL.items():
        leaf = verl.rsplit(".", 1)[-1]
        if verl.rsplit(".", 1)[-1] == mrl.rsplit(".", 1)[-1]:
            continue  # same name: the sibling/leaf search finds it
        out.setdefault(leaf, []).append(mrl)
    return out


_VERL_LEAVES = _verl_leaf_map()


def suggest(unknown: str, siblings: list[str], valid_keys: list[str]) -> str | None:
    """The most likely intended dotted key for `unknown`, or None.

    Tries, in order: verl's name for an mrl key (the table's exact entry); a close sibling at the same level; the same leaf
    name at another level (`actor.lr` -> `actor.optim.lr`); a close match over all dotted keys.
    """
    verl = VERL_TO_MRL
    if "sft.examples_per_step" in valid_keys:   # an SFT job: verl's SFT trainer names (mrl/sft/config.py)
        from mrl.sft.config import VERL_SFT_TO_MRL as verl
    if unknown in verl:   # the table's exact entry wins over any close-name guess
        return verl[unknown]
    prefix, _, leaf = unknown.rpartition(".")
    prefix = prefix + "." if prefix else ""
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return prefix + close[0]
    top = unknown.split(".", 1)[0]
    if leaf in _VERL_LEAVES and leaf not in _AMBIGUOUS_LEAVES:
        targets = _VERL_LEAVES[leaf]
        same_section = [t for t in targets if t.split(".", 1)[0] == top]
        return (same_section or targets)[0]
    same_leaf = [k for k in valid_keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        same_section = [k for k in same_leaf if k.split(".", 1)[0] == top]
        return min(same_section or same_leaf, key=len)
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return prefix + close[0]
    close = difflib.get_close_matches(unknown, valid_keys, n=1, cutoff=0.7)
    return close[0] if close else None
