"""Built-in rule rewards, with the user-function signature `score(prompt, response, ground_truth, extra)`.

They run in the reward worker pool like user functions (math parsing can be slow on adversarial
text), and return a float in [0, 1] or a dict with "score" plus numbers worth logging.

| name | rewards |
| --- | --- |
| `exact_match` | the final answer (last `<answer>` tag, else last `\\boxed{}`, else the whole response) equals the ground truth as text |
| `gsm8k` | the number after the last `#### ` in the response equals the ground truth's (a GSM8K solution "... #### 72" or "72") |
| `math` | math-verify finds the response's answer (boxed first) mathematically equal to the ground truth |
| `reasoning_gym` | the task's own reasoning-gym scorer on the last `<answer>` tag (the row's task from `extra`) |
| `format_boxed` | the response has a non-empty `\\boxed{...}` |
| `format_answer_tags` | the response has exactly one non-empty `<answer>...</answer>` |
| `format_think_answer` | the response is `<think>...</think>` then `<answer>...</answer>` and nothing else |
| `code` | the response's program passes the row's tests, run sandboxed (`mrl.reward.code`; pass rate or all-pass, `[reward.code]`) |
| `auto` | by each row's data source, with verl's names: `gsm8k`, `math`, `reasoning_gym` or `code` (see `SOURCE_RULES`) |

A ground truth a builtin cannot read (a table, a list, text with no number for `gsm8k`, nothing
math-verify can parse for `math`) raises an error naming it: the reward pool counts it as a reward
error instead of scoring the response 0 as if it were wrong.
"""
from __future__ import annotations

import re
from typing import Any

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
    """math-verify equivalence (1/2 = 0.5 = \\frac{1}{2}); the boxed answer wins over other candidates."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    truth = _truth_text(ground_truth, "math").strip()
    gold = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$")
    if not gold:
        gold = parse(truth)
    if not gold:
        raise ValueError(f"math: math-verify cannot parse the ground truth {truth[:80]!r}")
    answer = parse(response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])
    correct = float(bool(gold) and bool(answer) and verify(gold, answer))
    return {"score": correct, "acc": correct, "parsed": float(bool(answer))}


def reasoning_gym(prompt: Any, response: str, ground_truth: Any, extra: dict) -> dict:
    """The reasoning-gym task's exact scorer. The task and entry come from a generated row's
    `extra["reasoning_gym"]`; a file row may name the task in its data source ("reasoning_gym/<task>")."""
    from mrl.data import gym

    info = extra.get(gym.EXTRA_KEY) if isinstance(extra, dict) else None
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
    "auto": ("acc", "formatted", "parsed", "tagged"),
}

# data source -> builtin for `auto`: exact names, then prefixes (verl's data_source values).
SOURCE_RULES: tuple[tuple[str, str], ...] = (
    ("openai/gsm8k", "gsm8k"), ("gsm8k", "gsm8k"),
    ("lighteval/MATH", "math"), ("DigitalLearningGmbH/MATH-lighteval", "math"), ("HuggingFaceH4/MATH-500", "math"),
    ("math", "math"), ("math_dapo", "math"), ("aime", "math"), ("numina", "math"),
    ("reasoning_gym/", "reasoning_gym"),
    ("codecontests", "code"), ("apps", "code"), ("codeforces", "code"), ("taco", "code"),
)


def builtin_for_source(source: str) -> str | None:
    """The builtin `auto` uses for a data source: an exact rule, else the longest matching prefix
    (case-insensitive: "aime2024", "math_dapo_17k"); None when no rule matches."""
    low = source.lower()
    for name, builtin in SOURCE_RULES:
        if low == name.lower():
            return builtin
    prefixes = [(len(name), builtin) for name, builtin in SOURCE_RULES if low.startswith(name.lower())]
    return max(prefixes)[1] if prefixes else None


def auto(prompt: Any, response: str, ground_truth: Any, extra: dict, **code_settings: Any) -> dict:
    """The builtin for the row's data source (`builtin_for_source`); an unknown source is an error.
    `code_settings` (`[reward.code]`) go to the `code` builtin."""
    source = str(extra.get("data_source", "")) if isinstance(extra, dict) else ""
    name = builtin_for_source(source)
    if name is None:
        known = ", ".join(sorted({n for n, _ in SOURCE_RULES}))
        raise ValueError(f"auto: no builtin reward for data source {source!r} (known: {known}); "
                         "name one with reward.builtin or reward.function")
    if name == "code":
        return code(prompt, response, ground_truth, extra, **code_settings)
    out = globals()[name](prompt, response, ground_truth, extra)
    return out if isinstance(out, dict) else {"score": float(out)}


BUILTINS = ("exact_match", "gsm8k", "math", "reasoning_gym", "format_boxed", "format_answer_tags", "format_think_answer",
            "auto", "code")


def builtin_ref(name: str) -> str:
    """The `module:function` reference of builtin `name` (what the worker pool loads)."""
    return f"{__name__}:{name}"
