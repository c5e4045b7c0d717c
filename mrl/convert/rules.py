"""Value translations from verl to mrl, named by the `rule` of a verl key table entry.

Each rule is a pure function of the entry, its verl key and the resolved verl config (flat dotted
keys), returning a `Translation`: the mrl values it sets, a note for the comment, or why it sets
nothing. Where verl counts sequences and mrl counts tokens, the rule says which numbers it used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mrl.config.verl_table import Mapping

PROMPT_LEN, RESPONSE_LEN = "data.max_prompt_length", "data.max_response_length"


@dataclass
class Translation:
    values: dict[str, Any] = field(default_factory=dict)   # mrl key -> value
    note: str = ""
    skipped: str | None = None     # why nothing is set (mrl's default applies)
    problem: str | None = None     # a value mrl cannot take: the user must choose


def _skip(why: str) -> Translation:
    return Translation(skipped=why)


def _named(m: Mapping, value: Any) -> Any:
    """A verl value through the entry's `values` table (bools are looked up as true/false)."""
    name = str(value).lower() if isinstance(value, bool) else str(value)
    return m.values.get(name, value)


def copy(m: Mapping, key: str, cfg: dict) -> Translation:
    value = cfg.get(key)
    if value in m.unset and not isinstance(value, bool):
        return _skip(f"{value!r} means not set in verl")
    if value is None:
        if m.none is None:
            return _skip("null in verl: mrl's default applies")
        return Translation({m.target: m.none}, note=f"null -> {m.none!r}")
    new = _named(m, value)
    return Translation({m.target: new}, note=f"{value!r} -> {new!r}" if new != value else "")


def each(m: Mapping, key: str, cfg: dict) -> Translation:
    """A list whose items are translated one by one; items without a counterpart are left out."""
    items = cfg.get(key)
    items = [items] if isinstance(items, str) else list(items or [])
    kept = [m.values[str(i)] for i in items if str(i) in m.values]
    dropped = [str(i) for i in items if str(i) not in m.values]
    note = f"{', '.join(dropped)} not available (mrl has {', '.join(sorted(set(m.values.values())))})" if dropped else ""
    if not kept:
        return Translation({m.target: ["console"]} if "console" in m.values.values() else {}, note=note)
    return Translation({m.target: kept}, note=note)


def token_budget(m: Mapping, key: str, cfg: dict) -> Translation:
    """verl's per-GPU micro-batch: a token budget under dynamic batching, else a count of sequences
    that mrl turns into tokens at the longest sequence (max prompt + max response tokens)."""
    if cfg.get(m.params["dynamic"]):
        tokens = cfg.get(m.params["tokens"])
        if tokens is None:
            return _skip(f"{m.params['tokens']} is null")
        return Translation({m.target: int(tokens)}, note=f"token budget ({m.params['dynamic']} = true)")
    sequences = cfg.get(m.params["sequences"])
    if sequences is None:
        if key == m.params["sequences"]:
            return _skip("null in verl: mrl's default budget applies")
        return _skip(f"verl reads it only with {m.params['dynamic']} = true")
    if key != m.params["sequences"]:
        return _skip(f"verl reads it only with {m.params['dynamic']} = true; {m.params['sequences']} sets the budget")
    longest = int(cfg.get(PROMPT_LEN) or 0) + int(cfg.get(RESPONSE_LEN) or 0)
    return Translation({m.target: int(sequences) * longest},
                       note=f"{sequences} sequences x {longest} tokens (max prompt + max response)")


def prompt_overflow(m: Mapping, key: str, cfg: dict) -> Translation:
    """data.filter_overlong_prompts and data.truncation together: filtered prompts are dropped;
    otherwise verl's truncation side."""
    if cfg.get("data.filter_overlong_prompts"):
        return Translation({m.target: "drop"}, note="filter_overlong_prompts = true: longer prompts are dropped")
    side = cfg.get("data.truncation") or "error"
    choice = {"error": "error", "left": "truncate_left"}.get(side)
    if choice is None:
        return Translation(problem=f"data.truncation = {side!r}: mrl keeps the end of a long prompt "
                                   "(truncate_left), drops it (drop) or stops (error); set data.prompt_overflow")
    return Translation({m.target: choice}, note=f"filter_overlong_prompts = false, truncation = {side!r}")


def sleep_level(m: Mapping, key: str, cfg: dict) -> Translation:
    value = cfg.get(key)
    if value is None:
        return _skip("null in verl: mrl's default applies")
    return Translation({m.target: 1 if value else 0}, note="true: the engine sleeps between rollouts (level 1)"
                       if value else "false: the engine stays awake")


def reward_function(m: Mapping, key: str, cfg: dict) -> Translation:
    """`path:name` of verl's custom reward function; with none (and no reward model) verl scores
    with its default_compute_score by data source: mrl's builtin "auto" (when the entry lists
    reward.builtin among its targets). verl calls the function with its own arguments
    (data_source, solution_str, ground_truth, extra_info): an entry that lists reward.signature
    sets it to "verl", so the function is called that way whatever its parameter names."""
    path = cfg.get(m.params["path"])
    if not path:
        others = [k for k in ("custom_reward_function.path", "reward_model.reward_fn.path") if cfg.get(k)]
        if "reward.builtin" in m.targets and not others and not cfg.get("reward_model.enable"):
            return Translation({"reward.builtin": "auto"}, note="no custom reward function: verl scores by data source")
        return _skip(f"{m.params['path']} is not set")
    name = cfg.get(m.params["name"]) or "compute_score"
    out = {m.target: f"{path}:{name}"}
    if "reward.signature" in m.targets:
        out["reward.signature"] = "verl"
    return Translation(out, note="called as verl calls it" if "reward.signature" in m.targets else "")


def when(m: Mapping, key: str, cfg: dict) -> Translation:
    """The value, when verl acts on it: `flag` is true, or above `above` when that is given
    (Megatron's sequence parallelism needs tensor parallelism > 1; verl turns it off otherwise)."""
    flag = cfg.get(m.params["flag"])
    above = m.params.get("above")
    if (not flag) if above is None else (flag is None or flag <= above):
        return _skip(f"{m.params['flag']} is {flag!r}: verl does not act on it")
    return copy(m, key, cfg)


def switches_to(m: Mapping, key: str, cfg: dict) -> Translation:
    """A verl switch that, when true, selects an mrl value (`values.true`): verl's
    `distillation.enabled` is mrl's `algorithm.advantage = "distill"`, whatever estimator verl
    names beside it (a note says that one is overridden); false leaves mrl's value alone."""
    if not cfg.get(key):
        return _skip(f"{cfg.get(key)!r}: off in verl")
    new = _named(m, True)
    return Translation({m.target: new}, note=f"true -> {new!r}")


def read_by(m: Mapping, key: str, cfg: dict) -> Translation:
    return _skip(f"read with {m.params['by']}")


def pair(m: Mapping, key: str, cfg: dict) -> Translation:
    value = cfg.get(key)
    if not isinstance(value, (list, tuple)) or len(value) != len(m.targets):
        return Translation(problem=f"{key} = {value!r}: expected {len(m.targets)} numbers")
    return Translation(dict(zip(m.targets, value)))


def times(m: Mapping, key: str, cfg: dict) -> Translation:
    ratio, base = cfg.get(key), cfg.get(m.params["of"])
    if ratio is None or base is None:
        return _skip("null in verl: mrl's default applies")
    return Translation({m.target: float(ratio) * float(base)}, note=f"{ratio} x {m.params['of']} ({base})")


def more_than_one(m: Mapping, key: str, cfg: dict) -> Translation:
    value = cfg.get(key)
    if value is None:
        return _skip("null in verl: mrl's default applies")
    return Translation({m.target: int(value) > 1}, note=f"{value} ranks")


def clip_ratio(m: Mapping, key: str, cfg: dict) -> Translation:
    """verl's clip_ratio is the fallback of clip_ratio_low / clip_ratio_high when they are null."""
    value = cfg.get(key)
    prefix = key.rsplit(".", 1)[0]
    out = {t: value for t, side in zip(m.targets, ("low", "high")) if cfg.get(f"{prefix}.clip_ratio_{side}") is None}
    if not out or value is None:
        return _skip("verl uses clip_ratio_low and clip_ratio_high, which are set")
    return Translation(out)


HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_PROJECTIONS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                        "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def lora_modules(m: Mapping, key: str, cfg: dict) -> Translation:
    """verl's LoRA target modules as Hugging Face projection names: "all-linear" is all seven;
    Megatron's fused names expand (linear_qkv = q/k/v, linear_fc1 = gate/up)."""
    value = cfg.get(key)
    if value is None:
        return _skip("null in verl: mrl's default applies")
    if value == "all-linear":
        return Translation({m.target: list(HF_PROJECTIONS)}, note="all-linear: every projection")
    names = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for name in names:
        for hf in MEGATRON_PROJECTIONS.get(name, (name,)):
            if hf not in out:
                out.append(hf)
    return Translation({m.target: out}, note="Megatron names as Hugging Face projections" if out != names else "")


RULES: dict[str, Callable[[Mapping, str, dict], Translation]] = {
    "lora_modules": lora_modules,
    "copy": copy, "each": each, "token_budget": token_budget, "prompt_overflow": prompt_overflow,
    "sleep_level": sleep_level, "reward_function": reward_function, "when": when, "switches_to": switches_to, "read_by": read_by,
    "pair": pair, "times": times, "more_than_one": more_than_one, "clip_ratio": clip_ratio,
}


def critic_in_use(cfg: dict) -> bool:
    """verl trains a critic when critic.enable is true, or when it is null and the estimator is GAE."""
    enable = cfg.get("critic.enable")
    return bool(enable) if enable is not None else cfg.get("algorithm.adv_estimator") == "gae"


# Keys under these prefixes are read only when the predicate holds; otherwise verl ignores them.
GATES: dict[str, tuple[Callable[[dict], bool], str]] = {
    "critic.": (critic_in_use, "no critic in this job (algorithm.adv_estimator is not gae and critic.enable is not true)"),
}


def translate(m: Mapping, key: str, cfg: dict, condition: str | None = None) -> Translation:
    """The entry's rule applied, unless verl would not read `key` here: a gate of GATES is closed, or
    `condition` (the table's [read_only_when] verl key for it) is false, null or zero."""
    for prefix, (active, why) in GATES.items():
        if key.startswith(prefix) and not active(cfg):
            return _skip(why)
    if condition is not None:
        flag, _, wanted = condition.partition("=")
        value = cfg.get(flag)
        if wanted:   # "key=a|b": verl reads it only when key is one of these values (true/false in lower case)
            if (str(value).lower() if isinstance(value, bool) else str(value)) not in wanted.split("|"):
                return _skip(f"verl reads it only when {flag} is {' or '.join(wanted.split('|'))} (it is {value!r})")
        elif flag != key and not value:
            return _skip(f"verl reads it only when {flag} is set (it is {value!r})")
    return RULES[m.rule](m, key, cfg)
