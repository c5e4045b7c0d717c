"""verl's `prime_math` scorer (the numina_* data sources), reimplemented to give the same scores.

verl scores PRIME's math data in two passes over the answer `match_answer` pulls out of a response
(after "answer:" / "answer is", the last `\\boxed{}`, the text after the last "is " / "=" ...):

1. `grade_answer` (OpenAI's PRM800K grader): equal after Hendrycks' MATH normalisation, or after
   PRM800K's own (units, "million", LaTeX -> text with pylatexenc, mixed numbers), or element by
   element in a tuple with sympy proving the difference 0 (guarded by a 10 s alarm);
2. `math_equal` (ToRA's grader): numbers equal within 1e-4 relative (also x100 and /100 for
   percentages), intervals, tuples, "Point(...)" and matrices element by element. verl's final
   symbolic step (`symbolic_equal`) never compares anything (its timeout guard is used as a
   context manager and raises, which the step swallows), so it is `False` here too.

The score is 1.0 when either pass says equal, else 0.0. Where verl calls `eval` on the model's
text (`\\pi` answers and `[...]` matrix answers), this module evaluates arithmetic only (numbers,
+ - * / ** %, lists): the same value for every arithmetic text, an error (as eval's NameError is)
for anything else, and the model's text never runs as code. verl's `Matrix(...)` answers against a
`pmatrix` reference go through sympy's `parse_expr` (an eval); here they are not equal.
"""
from __future__ import annotations

import ast
import contextlib
import math
import operator
import re
import signal
from dataclasses import dataclass
from math import isclose
from typing import Any

from mrl.reward.hendrycks import hendrycks_normalize

SYMPY_TIMEOUT_S = 10  # verl's limit on one sympy simplification


# ---------------------------------------------------------------- pass 1: PRM800K's grade_answer
@dataclass(frozen=True)
class Flavour:
    """The two copies of PRM800K's grader verl uses differ in three details."""

    units: tuple[str, ...]  # unit words removed
    percents: tuple[str, ...]  # percent signs the first normalisation removes
    squeeze: bool  # the second normalisation also removes spaces and braces


_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")
PRIME = Flavour(units=_UNITS + ("liter",), percents=("\\\\%", "\\%"), squeeze=False)  # verl's prime_math copy
MATHRULER = Flavour(units=_UNITS, percents=("\\%", "%"), squeeze=True)  # mathruler 0.1.0 (verl's geo3k)


def _mathd_normalize(answer: str, flavour: Flavour = PRIME) -> str:
    """PRM800K's `math_normalize.normalize_answer`: `\\text{...}` unwrapped, then Hendrycks'
    normalisation; the stripped text itself when that fails."""
    answer = answer.strip()
    try:
        m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
        if m is not None:
            answer = m.group("text").strip()
        return hendrycks_normalize(answer, flavour.percents)
    except Exception:  # noqa: BLE001 - as PRM800K
        return answer


_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")


def _latex_to_text(expr: str) -> str:
    """LaTeX as plain text sympy can read (pylatexenc), with the unicode symbols spelled out."""
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, text in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, text)
    return expr.strip()


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001 - inf, nan
        return False


def _is_frac(text: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", text) is not None


def _strip_thousands(text: str) -> str:
    """`1,234,567` -> `1234567`, leaving tuple commas (`(1,2)`) alone."""
    while True:
        stripped = _THOUSANDS.sub(r"\1\3\4", text)
        if stripped == text:
            return stripped
        text = stripped


def _str_is_int(text: str) -> bool:
    try:
        x = float(_strip_thousands(text))
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001
        return False


def _prm_normalize(expr: str, flavour: Flavour = PRIME) -> str:
    """PRM800K's `_normalize`: units, dollars, percent, "million" and LaTeX removed, lower case."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in flavour.units:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)   # a mixed number 7 3/4 -> 7+3/4
    if flavour.squeeze:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _may_evaluate(expr: str) -> bool:
    """PRM800K lets sympy try only expressions with at most two unknown letters and no big powers."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return all(bad.search(expr) is None for bad in _BAD_REGEXES)


@contextlib.contextmanager
def _alarm(seconds: float):
    """TimeoutError after `seconds` (SIGALRM: the reward worker runs calls on its main thread;
    elsewhere no limit applies and the pool's reward.timeout_s still does)."""
    def expire(*_):
        raise TimeoutError(f"no result within {seconds} s")

    try:
        previous = signal.signal(signal.SIGALRM, expire)
    except ValueError:   # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _sympy_equal(truth: str, given: str) -> bool:
    """sympy simplifies `(truth)-(given)` to 0 (implicit multiplication allowed); False on any error."""
    from sympy import simplify
    from sympy.parsing import sympy_parser

    expr = f"({truth})-({given})"
    if not _may_evaluate(expr):
        return False
    try:
        with _alarm(SYMPY_TIMEOUT_S):
            transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
            return simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)) == 0
    except Exception:  # noqa: BLE001 - a parse error, or the time limit: not shown equal (verl counts both False)
        return False


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_thousands(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS and \
            not any(ch in expr[1:-1] for ch in _TUPLE_CHARS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: str | None, truth: str, flavour: Flavour = PRIME) -> bool:
    """PRM800K: equal after either normalisation, or each tuple element equal (fractions as text,
    integers only with integers, else by sympy)."""
    if given is None:
        return False
    if _mathd_normalize(truth, flavour) == _mathd_normalize(given, flavour):
        return True
    truth_n, given_n = _prm_normalize(truth, flavour), _prm_normalize(given, flavour)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = _split_tuple(truth_n), _split_tuple(given_n)
    if (len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1])) or \
            len(truth_elems) != len(given_elems):
        return False
    for t, g in zip(truth_elems, given_elems):
        if _is_frac(t) and _is_frac(g):
            ok = t == g
        elif _str_is_int(t) != _str_is_int(g):
            ok = False
        else:
            ok = _sympy_equal(t, g)
        if not ok:
            return False
    return True


# ---------------------------------------------------------------- pass 2: ToRA's math_equal
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}


def arithmetic_eval(text: str) -> Any:
    """The value of an arithmetic Python expression (numbers, + - * / ** % //, unary signs, lists
    and tuples); ValueError for anything else. Stands in for verl's `eval` of model output."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 10_000:
                raise ValueError("exponent too large")
            return _ARITHMETIC[type(node.op)](left, right)
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(str(e)) from None
    return value(tree.body)


def _number(s: Any) -> tuple[bool, float | None]:
    try:
        if "{,}" in str(s):
            return True, float(str(s).replace("{,}", ""))
        return True, float(str(s).replace(",", ""))
    except ValueError:
        return False, None


def _with_pi(text: str, pi: float) -> Any:
    """`2\\pi` -> 2*pi, `\\pi` -> 1*pi, then evaluated when that is arithmetic (else the text)."""
    idx = text.find("\\pi")
    while idx != -1:
        text = text[:idx] + (f"*{pi}" if idx > 0 and text[idx - 1].isdigit() else f"1*{pi}") + text[idx + 3:]
        idx = text.find("\\pi", idx + 1)
    with contextlib.suppress(Exception):
        return arithmetic_eval(text)
    return text


def _tora_normalize(answer: Any, pi: float) -> Any:
    """`$5` -> `5`, `50%` -> `50`, `101_2` -> 101 (a base subscript dropped), `\\pi` evaluated."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))   # ValueError on non-numbers, as verl's
    if isinstance(answer, str) and "\\pi" in answer:
        return _with_pi(answer, pi)
    return answer


_INTERVALS = ((re.compile(r"^Interval\((.*)\)$"), "[{}]"), (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
              (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"), (re.compile(r"^Interval\.open\((.*)\)$"), "({})"))


def _format_interval(prediction: str) -> str:
    for pattern, shape in _INTERVALS:
        m = pattern.match(prediction)
        if m:
            return shape.format(m.group(1))
    return prediction


def math_equal(prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4,
               pi: float = math.pi) -> bool:
    """ToRA's grader as verl runs it (see the module docstring); may raise where verl's raises."""
    prediction, reference = _tora_normalize(prediction, pi), _tora_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower() or \
                prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    try:
        (p_ok, p), (r_ok, r) = _number(prediction), _number(reference)
        if p_ok and r_ok:
            for item in ([r / 100, r, r * 100] if include_percentage else [r]):
                with contextlib.suppress(Exception):
                    if isclose(item, p, rel_tol=tolerance):
                        return True
            return False
    except Exception:  # noqa: BLE001 - as verl's
        pass
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), _format_interval(str(prediction).strip())
    pred_s, ref_s = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or \
            (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for ch in "{}()":
        pred_s, ref_s = pred_s.replace(ch, ""), ref_s.replace(ch, "")
    if pred_s == ref_s:
        return True

    def parts_equal(preds: list, refs: list) -> bool:   # every pair compared first, as verl's list comprehension
        return len(preds) == len(refs) and all([math_equal(p, r, include_percentage, tolerance) for p, r in zip(preds, refs)])

    if prediction and reference and prediction[0] in "([" and prediction[-1] in ")]" and \
            prediction[0] == reference[0] and prediction[-1] == reference[-1]:
        if parts_equal(prediction[1:-1].split(","), reference[1:-1].split(",")):
            return True
    if "," in prediction and "," in reference:
        preds, refs = [p.strip() for p in prediction.split(",")], [r.strip() for r in reference.split(",")]
        if len(preds) == len(refs):
            return parts_equal(preds, refs)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        if parts_equal(prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(",")):
            return True
    if r"\begin{pmatrix}" in reference and not prediction.startswith("Matrix") and \
            prediction.startswith("[") and prediction.endswith("]"):
        rows = arithmetic_eval(prediction)   # raises for non-arithmetic text, as verl's eval does
        if isinstance(rows, list):
            with contextlib.suppress(Exception):
                body = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                        .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}"))
                ref_rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
                if len(rows) == len(ref_rows) and all([math_equal(p, r, include_percentage, tolerance)
                                                       for r, p in zip(ref_rows, rows)]):
                    return True
    return False


# ---------------------------------------------------------------- the answer and the score
def _boxed_content(text: str) -> str | None:
    """The stripped content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    left = None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            left = i if left is None else left
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[left + 1:i].strip() if left is not None else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(found an answer with a digit, the answer text) as PRIME reads it from a response."""
    matched = False
    for marker in ("answer:", "answer is", "answers are"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            matched = True
            response = response[idx + len(marker):].strip()
            if response.endswith("\n"):
                response = response[:-2]
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            matched = True
            response = response[:idx].strip()
            if response.endswith("\n"):
                response = response[:-2]
    boxed = _boxed_content(response)
    if boxed:
        matched, response = True, boxed
    if ". " in response:
        response = response[:response.lower().rfind(". ")].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            matched = True
            response = response[idx + len(marker):].strip()
            if response.endswith("\n"):
                response = response[:-2]
    return matched and any(c.isdigit() for c in response), response


def compute_score(response: str, ground_truth: Any) -> float:
    """1.0 when PRIME's answer of `response` grades equal to `ground_truth` (either pass), else 0.0."""
    response, truth = str(response), str(ground_truth)
    _, answer = match_answer(response)
    if grade_answer(answer, truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in truth:
            return float(any([math_equal(answer, truth, pi=pi) for pi in (math.pi, 3.14)]))
        return float(math_equal(answer, truth))
    except Exception:  # noqa: BLE001 - verl scores an error 0
        return 0.0


# ---------------------------------------------------------------- geometry3k (verl's geo3k via mathruler)
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def mathruler_boxed(text: str) -> str:
    """mathruler's `extract_boxed_content`: the stripped content of the last `\\boxed{...}`, or the
    text "None" without one (which is then graded like any answer)."""
    start = text.rfind("\\boxed{")
    if start != -1:
        depth = 0
        content = text[start + len("\\boxed{"):]
        for i, ch in enumerate(content):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == -1:
                return content[:i].strip()
    return "None"


def geo3k_score(response: str, ground_truth: str) -> float:
    """verl's geo3k: 0.9 x (the last boxed answer grades equal, mathruler's grader) + 0.1 x (the
    response is `<think>...</think>` followed by text with a `\\boxed{}`)."""
    correct = 1.0 if grade_answer(mathruler_boxed(response), ground_truth, MATHRULER) else 0.0
    formatted = 1.0 if _GEO3K_FORMAT.fullmatch(response) else 0.0
    return (1.0 - 0.1) * correct + 0.1 * formatted
