"""verl's rule scorers, reimplemented to give the same scores (verl 0.9.1, `verl/utils/reward_score`).

`reward.builtin = "auto"` routes each row by its data source exactly as verl's
`default_compute_score` does (`VERL_ROUTES`), so a curve trained on mrl compares with a published
verl curve. These scorers are deliberately strict where verl is strict (gsm8k wants `#### 42` as
text; math_dapo gives -1 to a wrong answer, or to no answer at all); mrl's forgiving scorers (`gsm8k`,
`math`, ...) stay available under their own names.

| scorer | verl module | score |
| --- | --- | --- |
| `gsm8k` | `gsm8k.py` (strict) | 1 when the last `#### <number>` in the last 300 characters equals the ground truth as text, else 0 |
| `math_reward` | `math_reward.py` | 1 when the last `\\boxed{}` equals the ground truth after Hendrycks' MATH normalisation, else 0 |
| `math_dapo` | `math_dapo.py` | +1 / -1: the last `Answer:` line of the last 300 characters, Minerva-normalised, equals the normalised ground truth; without one, the last `\\boxed{}` of the last 100 characters equals the ground truth as text |
| `prime_math` | `prime_math/` | 1 when PRIME's answer (after "answer is", the last boxed, ...) is equal by PRM800K's or ToRA's grader (`mrl.reward.prime_math`), else 0 |
| `geo3k` | `geo3k.py` (mathruler) | 0.9 when the last boxed answer is equal by mathruler's copy of PRM800K's grader, + 0.1 for `<think>...</think>...\\boxed{}` |
| `search_r1_qa` | `search_r1_like_qa_em.py` | 1 when the last `<answer>` matches a target after SQuAD normalisation (1/4 with more than 10 answer tags), else 0 |

Where verl would compare a table with text (a misconfigured answer column), these raise instead:
the reward pool counts an error, never a silent 0. verl routes code contests to a sandbox
(sandbox_fusion or prime_code); `auto` sends them to mrl's sandboxed `code` builtin.
"""
from __future__ import annotations

import re
import string as _string
from typing import Any, Callable

from mrl.reward.hendrycks import hendrycks_equal, hendrycks_normalize  # hendrycks_normalize: verl's name, re-exported

CLIP_CHARS = 300  # verl scores only the end of a response (gsm8k.py, math_dapo.py)


def _text(ground_truth: Any, scorer: str) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        hint = ("; set data.answer_key to the field holding the answer (verl: reward_model.ground_truth)"
                if isinstance(ground_truth, dict) else "")
        raise ValueError(f"{scorer}: cannot read a ground truth of type {type(ground_truth).__name__}{hint}")
    return str(ground_truth)


# ---------------------------------------------------------------- gsm8k (strict)
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_answer(response: str) -> str | None:
    """verl's strict extraction: the last `#### ` followed directly by digits, dots and commas
    (commas removed), searched in the last 300 characters; None without one."""
    found = _GSM8K_STRICT.findall(response[-CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k(response: str, ground_truth: Any) -> float:
    """1.0 when `gsm8k_answer` is the ground truth's text exactly ("42.0", "042" are not "42")."""
    answer = gsm8k_answer(response)
    return float(answer is not None and answer == _text(ground_truth, "gsm8k"))


# ---------------------------------------------------------------- MATH (Hendrycks)
def _closing_brace(text: str, start: int) -> int | None:
    """The index of the `}` that closes the first `{` at or after `start`, or None (unbalanced)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def hendrycks_last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` with its braces (or `\\boxed xyz` up to a `$`, or the last `\\fbox{...}`)."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = _closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def unbox(boxed: str) -> str:
    """The content of `\\boxed{...}` / `\\boxed ...`; anything else (an `\\fbox`) is an error verl catches."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(boxed)
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(boxed)
    return boxed[len("\\boxed{"):-1]


def math_reward(response: str, ground_truth: Any) -> float:
    """1.0 when the last boxed answer equals the ground truth (`hendrycks_equal`), else 0.0."""
    truth = _text(ground_truth, "math_reward")
    boxed = hendrycks_last_boxed(response)
    if boxed is None:
        return 0.0
    try:
        return float(hendrycks_equal(unbox(boxed), truth))
    except Exception:  # noqa: BLE001 - an unboxable match (\fbox, a bad \frac) scores 0 in verl
        return 0.0


# ---------------------------------------------------------------- DAPO (Minerva)
_MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
                          ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
                    r",\!", "{,}", '"', "\\dots")
_MINERVA_REWRITES = ((re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"), (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
                     (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"), (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
                     (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"), (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
                     (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"))
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def minerva_normalize(answer: str) -> str:
    """The Minerva paper's final-answer normalisation (verl's `math_dapo.normalize_final_answer`):
    the text after the last `=`, units and filler words removed, `$...$` / `\\text{}` / `\\boxed{}`
    unwrapped, `\\frac12` -> `\\frac{1}{2}`, `1,000` -> `1000`."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in _MINERVA_REMOVED:
        answer = answer.replace(removed, "")
    for pattern, repl in _MINERVA_REWRITES:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


BOX_CHARS = 100  # math_dapo's `\boxed{}` fallback reads the last 100 of those 300 characters


def dapo_last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (balanced braces) of `text`, or None (verl's
    `math_dapo.last_boxed_only_string` then `remove_boxed`; only `\\boxed{`, no `\\fbox`)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = _closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def math_dapo(response: str, ground_truth: Any) -> dict:
    """+1 / -1 as verl 0.9.1's `math_dapo.compute_score`, on the response's last 300 characters:
    the last `Answer: ...` line, compared with the ground truth after `minerva_normalize`; without
    such a line, the last `\\boxed{...}` of the last 100 characters, compared as text with the
    ground truth (not normalised); with neither, -1. `pred` is what was compared ("[INVALID]":
    nothing)."""
    truth = _text(ground_truth, "math_dapo")
    tail = response[-CLIP_CHARS:]
    found = _ANSWER_LINE.findall(tail)
    pred = minerva_normalize(found[-1] if found else "[INVALID]")
    correct = pred == minerva_normalize(truth)
    if pred == "[INVALID]":
        boxed = dapo_last_boxed(tail[-BOX_CHARS:])
        if boxed is not None:
            pred, correct = boxed, boxed == truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ---------------------------------------------------------------- Search-R1 QA exact match
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(_string.punctuation)


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def search_r1_qa(response: str, ground_truth: Any) -> float:
    """Exact match of the last `<answer>` with any of `ground_truth["target"]` (text or a list):
    1.0, or 0.25 when the response has more than 10 opening or closing answer tags; else 0.0."""
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(f"search_r1_qa: the ground truth must be a table with 'target' (verl's searchR1 data), "
                         f"got {type(ground_truth).__name__}")
    tags = _ANSWER_TAG.findall(response)
    if not tags:
        return 0.0
    targets = ground_truth["target"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    answer = squad_normalize(tags[-1].strip())
    if not any(squad_normalize(t) == answer for t in targets):
        return 0.0
    return 0.25 if response.count("<answer>") > 10 or response.count("</answer>") > 10 else 1.0


# ---------------------------------------------------------------- routing
Scorer = Callable[[str, Any], "float | dict"]


def prime_math(response: str, ground_truth: Any) -> float:
    """verl's `prime_math` (PRIME's grader: PRM800K's then ToRA's equivalence), 0 or 1; `mrl.reward.prime_math`."""
    from mrl.reward import prime_math as prime

    return prime.compute_score(response, _text(ground_truth, "prime_math"))


def geo3k(response: str, ground_truth: Any) -> float:
    """verl's geo3k (geometry3k): 0.9 for the last boxed answer graded equal by mathruler's grader,
    plus 0.1 for the `<think>...</think> ... \\boxed{}` format; `mrl.reward.prime_math.geo3k_score`."""
    from mrl.reward import prime_math as prime

    return prime.geo3k_score(response, _text(ground_truth, "geo3k"))


SCORERS: dict[str, Scorer] = {"gsm8k": gsm8k, "math_reward": math_reward, "math_dapo": math_dapo,
                              "search_r1_qa": search_r1_qa, "prime_math": prime_math, "geo3k": geo3k}

# data source -> scorer, verl's `default_compute_score` table (exact names; "aime*" by prefix).
VERL_ROUTES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"), "math_reward"),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), "math_dapo"),
    **dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                     "numina_cn_k12", "numina_olympiads"), "prime_math"),
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "code"),
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys(("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"), "search_r1_qa"),
}
VERL_PREFIX_ROUTES = (("aime", "math_dapo"),)
CODE_SOURCE_PREFIXES = ("livecodebench",)   # code data verl scores only through a sandbox reward

# Routes verl has and mrl scores with no scorer of its own (none now: code contests go to the sandboxed
# `code` builtin, `mrl.reward.code`); a route named here is a reward error saying why.
UNSUPPORTED: dict[str, str] = {}


def verl_route(data_source: str) -> str | None:
    """verl's scorer name for `data_source` (a key of `SCORERS` or `UNSUPPORTED`), None where verl has none."""
    if data_source in VERL_ROUTES:
        return VERL_ROUTES[data_source]
    if data_source.startswith(CODE_SOURCE_PREFIXES):
        return "code"
    return next((scorer for prefix, scorer in VERL_PREFIX_ROUTES if data_source.startswith(prefix)), None)


def unsupported_message(data_source: str) -> str | None:
    """The error for a data source verl routes to a scorer mrl does not have, else None."""
    route = verl_route(data_source)
    return f"data source {data_source!r} {UNSUPPORTED[route]}" if route in UNSUPPORTED else None
