"""Hendrycks' MATH answer normalisation (verl's `math_reward.strip_string`), shared by the verl
scorers (`mrl.reward.verl_scores`) and PRIME's grader (`mrl.reward.prime_math`): a module of its
own so neither imports the other for it."""
from __future__ import annotations


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1b` -> `\\frac{1}{b}`; a `\\frac` with one character after it is left as is."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":   # an empty part (text ending in \frac) raises IndexError, as verl's does
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b if b == "{" else "{" + b + "}") + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    """`3/4` (two plain integers) -> `\\frac{3}{4}`."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(s)   # verl asserts; is_equiv then compares the raw strings
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def hendrycks_normalize(s: str, percents: tuple[str, ...] = ("\\\\%", "\\%")) -> str:
    """Hendrycks' MATH answer normalisation (verl's `math_reward.strip_string`); `percents` are
    the percent signs removed (mathruler's copy removes `\\%` and a bare `%`)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _remove_right_units(s)
    for percent in percents:
        s = s.replace(percent, "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def hendrycks_equal(a: str, b: str) -> bool:
    """Equal after `hendrycks_normalize`; when normalising fails, equal as raw text."""
    try:
        return hendrycks_normalize(a) == hendrycks_normalize(b)
    except Exception:  # noqa: BLE001 - verl falls back to comparing the raw strings
        return a == b
