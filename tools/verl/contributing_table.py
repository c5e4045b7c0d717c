"""Rewrite the verl key tables of CONTRIBUTING.md from mrl/config/verl_keys.toml (after editing the
table; `tests/config/test_load.py` and `tests/convert/` check that the page lists every entry).

    python tools/verl/contributing_table.py
"""
from __future__ import annotations

import re
from pathlib import Path

from mrl.config.verl_table import _describe, verl_table

PAGE = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"


def tables() -> dict[str, str]:
    t = verl_table()

    def how(m):
        also = f"also `{'`, `'.join(m.targets[1:])}`" if len(m.targets) > 1 else ""
        return "; ".join(x for x in (also, _describe(m).replace("|", "/")) if x)

    def when(condition):   # "key" (set) or "key=a|b" (one of these values): no "|" inside a table cell
        flag, _, wanted = condition.partition("=")
        return f"`{flag}`" + (" is " + " or ".join(f"`{v}`" for v in wanted.split("|")) if wanted else "")
    return {
        "| verl keys | read only when |": "\n".join(f"| `{k}*` | {when(v)} |" for k, v in t.read_only_when.items()),
        "| verl key | mrl key | value translation |": "\n".join(f"| `{k}` | `{m.target}` | {how(m)} |"
                                                           for k, m in t.mapped.items()),
        "| verl key | why |": "\n".join([*(f"| `{k}` | {r} |" for k, r in t.not_applicable.items()),
                                        *(f"| `{k}*` | {r} |" for k, r in t.prefixes.items()),
                                        *(f"| `*.{k}.*` | {r} |" for k, r in t.segments.items())]),
    }


def main() -> None:
    text = PAGE.read_text()
    for header, rows in tables().items():
        pattern = re.compile(re.escape(header) + r"\n\|[- |]+\|\n(?:\|.*\|\n)*")
        separator = "| " + " | ".join("---" for _ in header.strip("|").split("|")) + " |"
        text, n = pattern.subn(lambda _: f"{header}\n{separator}\n{rows}\n", text, count=1)
        assert n == 1, header
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
