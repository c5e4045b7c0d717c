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
    no_counterpart: str | None = None   # verl reads it here, and mrl has nothing that does the same (why)
    refused: str | None = None     # a capability mrl lacks: no job is written


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
        # verl's budget is per GPU of a Ulysses group (a micro-batch holds tokens x sp); Ulysses maps to
        # parallel.context, whose budget is per rank too: the same number
        sp = max([int(cfg.get(k) or 1) for k in m.params.get("sp", [])] or [1])
        if sp > 1:
            return Translation({m.target: int(tokens)},
                               note=f"token budget ({m.params['dynamic']} = true): {tokens} per GPU of a Ulysses group "
                                    f"of {sp} = per rank of parallel.context {sp}")
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


CUSTOM_PATH, CUSTOM_NAME = "reward.custom_reward_function.path", "reward.custom_reward_function.name"
RM_ENABLE, RM_PATH = "reward.reward_model.enable", "reward.reward_model.model_path"


def generative_rm(cfg: dict) -> bool:
    """verl 0.9.1 (reward_loop.py): with the reward model enabled, a custom reward function means
    the model is generative and the function prompts it; without one the model is a scalar
    (discriminative) reward model whose output is the score."""
    return bool(cfg.get(RM_ENABLE)) and bool(cfg.get(CUSTOM_PATH))


def reward_function(m: Mapping, key: str, cfg: dict) -> Translation:
    """`path:name` of verl's custom reward function; with none (and no reward model) verl scores
    with its default_compute_score by data source: mrl's builtin "auto" (when the entry lists
    reward.builtin among its targets). verl calls the function with its own arguments
    (data_source, solution_str, ground_truth, extra_info): an entry that lists reward.signature
    sets it to "verl", so the function is called that way whatever its parameter names. With a
    generative reward model the function prompts that model itself: mrl's judge does the prompting
    instead, so the user must write the function's prompt and parsing as the judge's."""
    path = cfg.get(m.params["path"])
    if key == m.params["name"]:     # the path's entry writes path:name
        return _skip(f"read with {m.params['path']}" + ("" if path else ", which is not set"))
    if not path:
        others = [k for k in (CUSTOM_PATH, "reward_model.reward_fn.path") if cfg.get(k)]
        if "reward.builtin" in m.targets and not others and not cfg.get(RM_ENABLE):
            return Translation({"reward.builtin": "auto"}, note="no custom reward function: verl scores by data source")
        return _skip(f"{m.params['path']} is not set")
    name = cfg.get(m.params["name"]) or "compute_score"
    if m.params["path"] == CUSTOM_PATH and generative_rm(cfg):
        return Translation(problem=f"{CUSTOM_PATH} = {path}:{name} prompts the generative reward model "
                                   f"{cfg.get(RM_PATH)} itself; mrl's judge ([reward.judge], converted from it) "
                                   "prompts it with reward.judge.template and reads the score with "
                                   "reward.judge.pattern: set both to what the function does")
    out = {m.target: f"{path}:{name}"}
    if "reward.signature" in m.targets:
        out["reward.signature"] = "verl"
    return Translation(out, note="called as verl calls it" if "reward.signature" in m.targets else "")


def reward_model(m: Mapping, key: str, cfg: dict) -> Translation:
    """verl 0.9's reward model: a scalar reward model (no custom function) is mrl's
    reward.model_path; a generative one (a custom function prompts it) is mrl's judge on a local
    engine of its own (reward.reward_model.rollout.name: the engine)."""
    path = cfg.get(RM_PATH)
    if not cfg.get(RM_ENABLE):
        return _skip(f"verl reads it only when {RM_ENABLE} is true")
    if not path:
        return Translation(problem=f"{RM_ENABLE} = true without {RM_PATH}: supply reward.model_path")
    if key == RM_ENABLE:
        return _skip(f"read with {RM_PATH}")
    engine = cfg.get("reward.reward_model.rollout.name")
    if key != RM_PATH:      # the engine's name
        if not generative_rm(cfg):
            return Translation(no_counterpart="a scalar reward model runs in mrl's trainer (reward.model_path), "
                                              "not on an inference engine")
        if cfg.get("reward.reward_model.enable_resource_pool"):
            return Translation(no_counterpart="the engine of the server you start for reward.judge.url")
        note = "" if engine in (None, "vllm", "???") else f"verl serves it with {engine}; mrl's judge engines are hf and vllm"
        return Translation({"reward.judge.engine": "vllm" if engine in ("vllm", "sglang", "trtllm") else "hf"}, note=note)
    if not generative_rm(cfg):
        return Translation({"reward.model_path": path}, note="a scalar reward model (no custom reward function)")
    if cfg.get("reward.reward_model.enable_resource_pool"):
        return Translation(problem=f"{RM_PATH} = {path}: verl serves this generative reward model on GPUs of its own "
                                   "(reward.reward_model.enable_resource_pool); mrl's local judge shares the trainer's: "
                                   "serve it with vLLM's OpenAI server and give reward.judge.url and reward.judge.model "
                                   "(docs/rewards.md), or drop enable_resource_pool")
    return Translation({"reward.judge.model": path},
                       note="a generative reward model (the custom reward function prompts it): mrl's judge on a local engine")


def judge(m: Mapping, key: str, cfg: dict) -> Translation:
    """A serving setting of verl's reward model: the judge's, when the model is generative."""
    if not cfg.get(RM_ENABLE):
        return _skip(f"verl reads it only when {RM_ENABLE} is true")
    if generative_rm(cfg) and cfg.get("reward.reward_model.enable_resource_pool"):
        return Translation(no_counterpart="a serving setting of the judge's own GPUs: the server you start for "
                                          "reward.judge.url sets it")
    if not generative_rm(cfg):
        return Translation(no_counterpart="a scalar reward model runs in mrl's trainer (reward.model_path), "
                                          "not on an inference engine")
    value = cfg.get(key)
    if m.params.get("plus"):
        other = cfg.get(m.params["plus"])
        if value is None or other is None:
            return _skip("null in verl: mrl's default applies")
        return Translation({m.target: int(value) + int(other)}, note=f"{value} + {m.params['plus']} ({other})")
    return copy(m, key, cfg)


def overlong(m: Mapping, key: str, cfg: dict) -> Translation:
    """DAPO's overlong penalty (`reward_kwargs.overlong_buffer_cfg`): read by verl's dapo reward
    manager only, and only when enabled; mrl's algorithm.overlong, measured against
    rollout.max_response_tokens where verl uses reward_kwargs.max_resp_len."""
    manager = cfg.get("reward.reward_manager.name")
    if manager != "dapo":
        return _skip(f"verl reads it only with the dapo reward manager (reward.reward_manager.name is {manager!r})")
    prefix = "reward.reward_kwargs.overlong_buffer_cfg."
    if not cfg.get(prefix + "enable"):
        return _skip(f"verl reads it only when {prefix}enable is true") if key != prefix + "enable" \
            else Translation({m.target: False})
    if key == "reward.reward_kwargs.max_resp_len":
        value, length = cfg.get(key), cfg.get(RESPONSE_LEN)
        if value is not None and length is not None and int(value) != int(length):
            return Translation(problem=f"{key} = {value}: mrl measures the overlong buffer from "
                                       f"rollout.max_response_tokens ({RESPONSE_LEN} = {length}); make them equal")
        return _skip(f"= {RESPONSE_LEN}: mrl measures the buffer from rollout.max_response_tokens")
    return copy(m, key, cfg)


def kwargs(m: Mapping, key: str, cfg: dict) -> Translation:
    """Every key under the entry's prefix as one dict (verl's reward_kwargs of the function)."""
    prefix = m.params["prefix"]
    tree: dict = {}
    for k in sorted(cfg):
        if k.startswith(prefix) and cfg[k] is not None and cfg[k] != {}:
            node = tree
            parts = k[len(prefix):].split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = cfg[k]
    if not tree:
        return _skip("empty")
    return Translation({m.target: tree}, note="keyword arguments of the reward function")


def reward_manager(m: Mapping, key: str, cfg: dict) -> Translation:
    """verl's reward managers call the reward function per response (naive, dapo, gdpo, prime,
    limited, remote): mrl's reward pool does the same. A custom manager class computes rewards
    its own way, which mrl cannot carry over."""
    source = cfg.get("reward.reward_manager.source") or "register"
    name = cfg.get("reward.reward_manager.name")
    if source != "register":
        module = cfg.get("reward.reward_manager.module.path")
        return Translation(problem=f"reward.reward_manager.source = {source!r}: a reward manager of your own "
                                   f"({module}:{cfg.get('reward.reward_manager.module.name')}) computes the rewards; "
                                   "mrl has no reward managers: write it as a reward function (reward.function)")
    if name in ("naive", "dapo", "gdpo", "prime", "limited", "remote"):
        return _skip(f"{name}: mrl's reward pool calls the function per response as verl's {name} manager does"
                     + ("; its overlong penalty is algorithm.overlong" if name == "dapo" else ""))
    return Translation(problem=f"{key} = {name!r}: a reward manager mrl does not know; mrl's reward pool calls "
                               "reward.function per response")


def refuse_unless(m: Mapping, key: str, cfg: dict) -> Translation:
    """The value, when it is one of `allowed`; otherwise mrl lacks the capability: refused."""
    value = cfg.get(key)
    if value is None or value in m.params["allowed"]:
        return copy(m, key, cfg)
    return Translation(refused=f"{key} = {value!r}: {m.params['why']}")


def refuse_if_true(m: Mapping, key: str, cfg: dict) -> Translation:
    if cfg.get(key):
        return Translation(refused=f"{key} = true: {m.params['why']}")
    return _skip("false: nothing to convert")


def is_threshold(m: Mapping, key: str, cfg: dict) -> Translation:
    """rollout_is_threshold: a number (or "2.0") caps the weights (TIS: correction.threshold); a
    "lower_upper" string zeroes the weights outside [lower, upper] (IcePop, verl 0.9.1's
    `_parse_rollout_is_threshold`): correction.mode = "mask" with mask_low / mask_high."""
    value = cfg.get(key)
    if value is None:
        return _skip("null in verl: mrl's default applies")
    if isinstance(value, str) and "_" in value:
        low, _, high = value.partition("_")
        return Translation({"algorithm.correction.mode": "mask", "algorithm.correction.mask_low": float(low),
                            "algorithm.correction.mask_high": float(high)},
                           note=f"{value!r}: weights outside [{low}, {high}] are zeroed (IcePop)")
    return Translation({"algorithm.correction.threshold": float(value)})


def save_freq(m: Mapping, key: str, cfg: dict) -> Translation:
    """trainer.save_freq: -1 (verl: never save) is checkpoint.every_steps = -1; N > 0 is N."""
    value = cfg.get(key)
    if value is None or int(value) == 0:
        return _skip("null in verl: mrl's default applies")
    if int(value) < 0:
        return Translation({m.target: -1}, note="-1: never save (as verl)")
    return Translation({m.target: int(value)})


def clip_low(m: Mapping, key: str, cfg: dict) -> Translation:
    """clip_ratio_low; CISPO's official setting 10 puts the lower bound below 0 (no lower clip in
    verl, since ratios are positive): mrl's losses clamp at 1 - clip_low the same way."""
    t = copy(m, key, cfg)
    value = cfg.get(key)
    if t.values and value is not None and float(value) >= 1:
        t.note = f"1 - {value} <= 0: no lower clip (ratios are positive), as in verl"
    return t


def loss_aggregation(m: Mapping, key: str, cfg: dict) -> Translation:
    """loss_agg_mode; verl ignores it for geo_mean (GMPO) and sapo, which aggregate per sequence."""
    loss = cfg.get("actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss in ("geo_mean", "sapo"):
        return _skip(f"verl ignores it with policy_loss.loss_mode = {loss!r} (a per-sequence loss; mrl uses "
                     "seq-mean-token-mean for it)")
    return copy(m, key, cfg)


def rollout_is(m: Mapping, key: str, cfg: dict) -> Translation:
    """rollout_correction.rollout_is: in bypass mode with the ppo_clip loss verl 0.9.1 computes the
    IS weights for metrics only (the loss does not use them), so mrl's correction stays off."""
    pre = "algorithm.rollout_correction."
    if cfg.get(pre + "bypass_mode") and (cfg.get(pre + "loss_type") or "ppo_clip") == "ppo_clip":
        return _skip("verl 0.9.1 computes these weights for metrics only in bypass mode with loss_type ppo_clip; "
                     "mrl's correction.level stays off")
    return copy(m, key, cfg)


def when(m: Mapping, key: str, cfg: dict) -> Translation:
    """The value, when verl acts on it: `flag` is true, or above `above` when that is given
    (Megatron's sequence parallelism needs tensor parallelism > 1; verl turns it off otherwise)."""
    flag = cfg.get(m.params["flag"])
    above = m.params.get("above")
    if (not flag) if above is None else (flag is None or flag <= above):
        return _skip(f"{m.params['flag']} is {flag!r}: verl does not act on it")
    return copy(m, key, cfg)


def read_with_estimator(m: Mapping, key: str, cfg: dict) -> Translation:
    """The value, when verl 0.9.1's trainer reads it for the job's estimator: `only` lists the
    estimators that read it, `except` those that ignore it (`compute_advantage` in
    verl/trainer/ppo/ray_trainer.py: `use_pf_ppo` only in the GAE branch; `norm_adv_by_std_in_grpo`
    not passed to grpo_vectorized or gdpo, which keep their default). Otherwise mrl keeps its own
    default, which is what verl then does (mrl applies both settings with every estimator)."""
    estimator = str(cfg.get("algorithm.adv_estimator", "gae"))
    only, unless = m.params.get("only"), m.params.get("except") or []
    if (only is not None and estimator not in only) or estimator in unless:
        return _skip(f"verl ignores it with algorithm.adv_estimator = {estimator!r}")
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
    "read_with_estimator": read_with_estimator,
    "pair": pair, "times": times, "more_than_one": more_than_one, "clip_ratio": clip_ratio,
    "reward_model": reward_model, "judge": judge, "overlong": overlong, "kwargs": kwargs,
    "reward_manager": reward_manager, "save_freq": save_freq, "clip_low": clip_low,
    "loss_aggregation": loss_aggregation, "rollout_is": rollout_is, "refuse_unless": refuse_unless,
    "refuse_if_true": refuse_if_true, "is_threshold": is_threshold,
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
    try:
        return RULES[m.rule](m, key, cfg)
    except (TypeError, ValueError) as e:    # a number that is not one (e.g. a shell expression left as text)
        return Translation(problem=f"{key} = {cfg.get(key)!r}: not a value mrl convert can translate ({e}); "
                                   f"supply {m.target}")
