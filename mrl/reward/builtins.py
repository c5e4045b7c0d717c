"""Built-in rule rewards, with the user-function signature `score(prompt, response, ground_truth, extra)`.

`gsm8k`, `math` and `auto_mrl` are mrl's forgiving scorers; `auto` and `verl_*` give verl 0.9.1's
scores (`mrl.reward.verl_scores`, -1 included), so curves compare with published verl runs.

They run in the reward worker pool like user functions (math parsing can be slow on adversarial
text), and return a float (in [0, 1], or -1/+1 for verl_math_dapo) or a dict with "score" plus
numbers worth logging.

| name | rewards |
| --- | --- |
| `exact_match` | the final answer (last `<answer>` tag, else last `\\boxed{}`, else the whole response) equals the ground truth as text |
| `gsm8k` | the number after the last `#### ` in the response equals the ground truth's (a GSM8K solution "... #### 72" or "72") |
| `math` | math-verify finds the response's answer (boxed first) mathematically equal to the ground truth |
| `reasoning_gym` | the task's own reasoning-gym scorer on the last `<answer>` tag (the row's task from `extra`) |
| `format_boxed` | the response has a non-empty `\\boxed{...}` |
| `format_answer_tags` | the response has exactly one non-empty `<answer>...</answer>` |
| `format_think_answer` | the response is `<think>...</think>` then `<answer>...</answer>` and nothing else |
| `auto` | verl's `default_compute_score`: each row's data source routed to verl's own scorer with verl's scores (`verl_scores.VERL_ROUTES`); `reasoning_gym/<task>` rows by the task's scorer; verl's code sources (codecontests, apps, codeforces, taco, livecodebench*) by `code` |
| `auto_mrl` | by each row's data source, mrl's forgiving scorers: `gsm8k`, `math` or `reasoning_gym` (see `SOURCE_RULES`) |
| `verl_gsm8k` | verl's strict gsm8k: `#### <answer>` exactly as the ground truth's text (`#### 42.0` is not 42), 0 or 1 |
| `verl_math` | verl's `math_reward` (Hendrycks MATH normalisation of the last boxed answer), 0 or 1 |
| `verl_math_dapo` | verl's `math_dapo`: the last `Answer:` line, Minerva normalisation, +1 or -1 |
| `verl_prime_math` | verl's `prime_math` (numina_* data): PRIME's answer, PRM800K's then ToRA's equivalence, 0 or 1 |
| `verl_geo3k` | verl's `geo3k`: 0.9 for the last boxed answer (mathruler's grader) + 0.1 for `<think>...</think>...\\boxed{}` |
| `verl_search_r1_qa` | verl's Search-R1 exact match of the last `<answer>` with any `ground_truth["target"]` |
| `code` | the response's program passes the row's tests, run sandboxed (`mrl.reward.code`; pass rate or all-pass, `[reward.code]`) |

A ground truth a builtin cannot read (a table, a list, text with no number for `gsm8k`, nothing
math-verify can parse for `math`) raises an error naming it: the reward pool counts it as a reward
error instead of scoring the response 0 as if it were wrong.
"""
from __future__ import annotations

import json
import re
from typing import Any

from mrl.reward import verl_scores

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER_CHARS = re.compile(r"[,$\s]")
_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>`, stripped, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def final_answer(response: str) -> str:
    """The response's final answer: last `<answer>` tag, else last `\\boxed{}`, else the stripped response."""
    for found in (answer_tag(response), last_boxed(response)):
        if found is not None:
            return found.strip()
    return response.strip()


def _truth_text(ground_truth: Any, name: str) -> str:
    """The ground truth as text; a table or list (e.g. verl's whole `reward_model` column) is an error."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        hint = ("; set data.answer_key to the field holding the answer (verl: reward_model.ground_truth)"
                if isinstance(ground_truth, dict) else "")
        raise ValueError(f"{name}: cannot read a ground truth of type {type(ground_truth).__name__}{hint}")
    return str(ground_truth)


def exact_match(prompt: Any, response: str, ground_truth: Any, extra: dict) -> float:
    return float(final_answer(response) == _truth_text(ground_truth, "exact_match").strip())


def _gsm8k_number(text: str) -> str | None:
    found = _GSM8K.findall(text)
    if not found:
        return None
    number = _NUMBER_CHARS.sub("", found[-1])
    try:
        value = float(number)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else str(value)


def gsm8k(prompt: Any, response: str, ground_truth: Any, extra: dict) -> dict:
    """GSM8K's strict format: the answer follows `#### ` (verl's `gsm8k` strict mode)."""
    truth = _truth_text(ground_truth, "gsm8k")
    expected = _gsm8k_number(truth) if "####" in truth else _gsm8k_number("#### " + truth)
    if expected is None:
        raise ValueError(f"gsm8k: no number in the ground truth {truth[:80]!r}")
    got = _gsm8k_number(response)
    correct = float(got is not None and got == expected)
    return {"score": correct, "acc": correct, "formatted": float(got is not None)}


def math(prompt: Any, response: str, ground_truth: Any, extra: dict) -> dict:
    """math-verify equivalence (1/2 = 0.5 = \\frac{1}{2}); the last boxed answer wins over other candidates
    (earlier boxed answers included: the last one is the model's correction)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    truth = _truth_text(ground_truth, "math").strip()
    gold = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$")
    if not gold:
        gold = parse(truth)
    if not gold:
        raise ValueError(f"math: math-verify cannot parse the ground truth {truth[:80]!r}")
    boxed = last_boxed(response)   # a self-correction "\\boxed{3} ... \\boxed{4}" answers 4, not {3, 4}
    answer = (parse(f"$\\boxed{{{boxed}}}$", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)])
              if boxed is not None and boxed.strip() else None)
    if not answer:
        answer = parse(response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])
    correct = float(bool(gold) and bool(answer) and verify(gold, answer))
    return {"score": correct, "acc": correct, "parsed": float(bool(answer))}


def reasoning_gym(prompt: Any, response: str, ground_truth: Any, extra: dict) -> dict:
    """The reasoning-gym task's exact scorer. The task and entry come from a generated row's
    `extra["reasoning_gym"]` or a written row's `extra_info.reasoning_gym` (`mrl data gym`); another file row may name the task in its data source ("reasoning_gym/<task>")."""
    from mrl.data import gym

    info = extra.get(gym.EXTRA_KEY) if isinstance(extra, dict) else None
    written = (extra.get("extra_info") or {}).get(gym.EXTRA_KEY) if isinstance(extra, dict) else None
    if info is None and isinstance(written, str):   # a row `mrl data gym` wrote: the entry as JSON
        info = json.loads(written)
    if info is not None:
        task, entry = info["task"], info["entry"]
    else:
        source = str(extra.get("data_source", "")) if isinstance(extra, dict) else ""
        if not source.startswith("reasoning_gym/"):
            raise ValueError("row has no reasoning-gym task: generate it with data.generator = 'reasoning_gym:<task>' "
                             "or give it the data source 'reasoning_gym/<task>'")
        task, entry = source.split("/", 1)[1], {"question": prompt, "answer": ground_truth, "metadata": {}}
    answer = gym.extract_answer(response)
    score = float(gym.scorer(task)(answer, entry))
    return {"score": score, "acc": float(score == 1.0), "tagged": float(answer is not None)}


def format_boxed(prompt: Any, response: str, ground_truth: Any, extra: dict) -> float:
    boxed = last_boxed(response)
    return float(boxed is not None and bool(boxed.strip()))


def format_answer_tags(prompt: Any, response: str, ground_truth: Any, extra: dict) -> float:
    found = _ANSWER_TAG.findall(response)
    return float(len(found) == 1 and bool(found[0].strip()))


def format_think_answer(prompt: Any, response: str, ground_truth: Any, extra: dict) -> float:
    m = _THINK_ANSWER.match(response)
    return float(m is not None and bool(m.group(1).strip()))


def code(prompt: Any, response: str, ground_truth: Any, extra: dict, **settings: Any) -> dict:
    """The code-execution reward (`mrl.reward.code.code`); `settings` come from `[reward.code]`."""
    from mrl.reward.code import code as run_code

    return run_code(prompt, response, ground_truth, extra, **settings)


# The numbers each builtin returns besides its score (`algorithm.dynamic_sampling.metric` may name
# one; "acc" is 1 for a fully correct response, DAPO's filter metric).
OUTPUTS: dict[str, tuple[str, ...]] = {
    "exact_match": (), "gsm8k": ("acc", "formatted"), "math": ("acc", "parsed"), "reasoning_gym": ("acc", "tagged"),
    "format_boxed": (), "format_answer_tags": (), "format_think_answer": (),
    "code": ("passed", "tests", "no_code", "wrong", "error", "timeout", "cpu", "memory", "output_limit", "skipped"),
    "auto": ("acc", "tagged", "passed", "tests"), "auto_mrl": ("acc", "formatted", "parsed", "tagged"),
    "verl_gsm8k": (), "verl_math": (), "verl_math_dapo": ("acc",), "verl_prime_math": (), "verl_geo3k": (),
    "verl_search_r1_qa": (),
}

# data source -> builtin for `auto_mrl`: exact names, then prefixes (verl's data_source values).
SOURCE_RULES: tuple[tuple[str, str], ...] = (
    ("openai/gsm8k", "gsm8k"), ("gsm8k", "gsm8k"),
    ("lighteval/MATH", "math"), ("DigitalLearningGmbH/MATH-lighteval", "math"), ("HuggingFaceH4/MATH-500", "math"),
    ("math", "math"), ("math_dapo", "math"), ("aime", "math"), ("numina", "math"),
    ("reasoning_gym/", "reasoning_gym"),
    ("codecontests", "code"), ("apps", "code"), ("codeforces", "code"), ("taco", "code"),
)


def builtin_for_source(source: str) -> str | None:
    """The builtin `auto_mrl` uses for a data source: an exact rule, else the longest matching prefix
    (case-insensitive: "aime2024", "math_dapo_17k"); None when no rule matches."""
    low = source.lower()
    for name, builtin in SOURCE_RULES:
        if low == name.lower():
            return builtin
    prefixes = [(len(name), builtin) for name, builtin in SOURCE_RULES if low.startswith(name.lower())]
    return max(prefixes)[1] if prefixes else None


def auto_mrl(prompt: Any, response: str, ground_truth: Any, extra: dict, **code_settings: Any) -> dict:
    """mrl's forgiving builtin for the row's data source (`builtin_for_source`); an unknown source is an error.
    `code_settings` (`[reward.code]`) go to the `code` builtin."""
    source = str(extra.get("data_source", "")) if isinstance(extra, dict) else ""
    name = builtin_for_source(source)
    if name is None:
        known = ", ".join(sorted({n for n, _ in SOURCE_RULES}))
        raise ValueError(f"auto_mrl: no builtin reward for data source {source!r} (known: {known}); "
                         "name one with reward.builtin or reward.function")
    if name == "code":
        return code(prompt, response, ground_truth, extra, **code_settings)
    out = globals()[name](prompt, response, ground_truth, extra)
    return out if isinstance(out, dict) else {"score": float(out)}


def _verl(scorer: str):
    def run(prompt: Any, response: str, ground_truth: Any, extra: dict):
        return verl_scores.SCORERS[scorer](response, ground_truth)

    run.__name__ = run.__qualname__ = f"verl_{scorer}"
    run.__doc__ = f"verl's `{scorer}` scorer (`mrl.reward.verl_scores.{scorer}`), whatever the data source."
    return run


verl_gsm8k, verl_math, verl_math_dapo, verl_prime_math, verl_geo3k, verl_search_r1_qa = (
    _verl(n) for n in ("gsm8k", "math_reward", "math_dapo", "prime_math", "geo3k", "search_r1_qa"))


def auto(prompt: Any, response: str, ground_truth: Any, extra: dict, **code_settings: Any) -> dict:
    """verl's `default_compute_score`: the scorer verl routes the row's data source to
    (`verl_scores.VERL_ROUTES`), with verl's scores; "reasoning_gym/<task>" rows (which verl does not
    route) use the task's scorer, and code contests (verl: sandbox_fusion or prime_code with
    continuous scores) the sandboxed `code` builtin with `code_settings` (`[reward.code]`). `acc`
    is the score where the scorer returns a number, as in verl's reward loop. A source verl does
    not route is an error naming it, counted as a reward error."""
    source = str(extra.get("data_source", "")) if isinstance(extra, dict) else ""
    if source.startswith("reasoning_gym/"):
        return reasoning_gym(prompt, response, ground_truth, extra)
    route = verl_scores.verl_route(source)
    if route == "code":
        out = code(prompt, response, ground_truth, extra, **code_settings)
        return {**out, "acc": out["score"]}
    if route is None:
        raise ValueError(f"auto: no builtin reward for data source {source!r} (verl's default_compute_score routes "
                         "none either); name one with reward.builtin or reward.function, or use 'auto_mrl'")
    if route in verl_scores.UNSUPPORTED:
        raise ValueError(f"auto: {verl_scores.unsupported_message(source)}")
    out = verl_scores.SCORERS[route](response, ground_truth)
    return out if isinstance(out, dict) else {"score": float(out), "acc": float(out)}


BUILTINS = ("exact_match", "gsm8k", "math", "reasoning_gym", "format_boxed", "format_answer_tags", "format_think_answer",
            "auto", "auto_mrl", "verl_gsm8k", "verl_math", "verl_math_dapo", "verl_prime_math", "verl_geo3k",
            "verl_search_r1_qa", "code")


def builtin_ref(name: str) -> str:
    """The `module:function` reference of builtin `name` (what the worker pool loads)."""
    return f"{__name__}:{name}"
