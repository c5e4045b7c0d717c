"""Expansion, tests and arithmetic of the bash reader (`shell.py`): words to fields as bash splits
them, `${...}` parameter expansions, `[ ... ]` / `[[ ... ]]` tests and `$((...))` arithmetic,
evaluated on a restricted AST (integers only, C division, bounded exponents and shifts).

`Expansion` is the half of the interpreter that computes values; `shell._Interp` adds the
commands. A value it cannot know is a marker (`MARK` + index + `MARK`) carried to where it is used.
"""
from __future__ import annotations

import ast
import fnmatch
import operator
import re

from mrl.convert.shell_lex import Lexer, ShellError, Word, is_name

MARK = "\x00"                # an unknown value: MARK + index + MARK
MAX_VALUE_CHARS = 1_000_000  # no variable grows past this
_ARITH = re.compile(r"[0-9A-Za-z_+\-*/%()<>=!&|^~?: \t\n]*")


class Unknown(Exception):
    """A test or an arithmetic that depends on a value mrl convert cannot know."""


class Expansion:
    """Values of words, tests and arithmetic; the interpreter provides `vars`, `positional`,
    `path`, `cwd`, `status`, `unknowns`, `unset`, `step`, `unknown`, `what` and `run`."""

    # ---- tests and arithmetic ----
    def test(self, args: list[str]) -> bool:
        if not args:
            return False
        for op in ("||", "-o"):
            if op in args:
                i = args.index(op)
                return self.test(args[:i]) or self.test(args[i + 1:])
        for op in ("&&", "-a"):
            if op in args and len(args) != 2:
                i = args.index(op)
                return self.test(args[:i]) and self.test(args[i + 1:])
        if args[0] == "!":
            return not self.test(args[1:])
        if args[0] == "(" and args[-1] == ")":
            return self.test(args[1:-1])
        if len(args) == 1:
            return self.known(args[0]) != ""
        if len(args) == 2:
            op, a = args
            if op == "-z":
                return self.known(a) == ""
            if op == "-n":
                return self.known(a) != ""
            if op in ("-f", "-d", "-e", "-s", "-x", "-r", "-w", "-L"):
                raise Unknown(f"whether the file {self.what(a)!r} exists")
            raise Unknown(f"`{op} {a}`")
        if len(args) == 3:
            a, op, b = args
            if op in ("=", "==", "!="):
                a, b = self.known(a), self.known(b)
                same = fnmatch.fnmatchcase(a, b) if op == "==" else a == b
                return same if op != "!=" else not same
            if op in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
                x, y = self.integer(a), self.integer(b)
                return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}[op]
            if op == "=~":
                return re.search(self.known(b), self.known(a)) is not None
        raise Unknown(f"`{' '.join(self.what(a) for a in args)}`")

    def blank_unset(self, value: str) -> str:
        """`value` with the markers of unset variables read as bash reads them: empty."""
        for mark in self.unset:
            value = value.replace(mark, "")
        return value

    def known(self, value: str) -> str:
        value = self.blank_unset(value)
        if MARK in value:
            raise Unknown(repr(self.what(value)))
        return value

    def integer(self, value: str) -> int:
        value = self.known(value).strip()
        try:
            return int(value or "0")
        except ValueError:
            raise Unknown(f"{value!r} (not a number)")

    def arith(self, expr: str, line: int) -> int:
        text = self.expand_one(Word(tuple(_lex_operand(expr, line)), line))
        self.known(text)
        if not _ARITH.fullmatch(text):
            raise ShellError(line, f"`$(({expr}))`: not an integer expression")
        text = re.sub(r"&&", " and ", re.sub(r"\|\|", " or ", re.sub(r"!(?!=)", " not ", text)))
        try:
            tree = ast.parse(text.strip() or "0", mode="eval")
        except SyntaxError:
            raise ShellError(line, f"`$(({expr}))`: not an integer expression")
        return self.eval_arith(tree.body, line, 0)

    _BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: None,
            ast.FloorDiv: None, ast.Div: None, ast.Pow: operator.pow, ast.LShift: operator.lshift,
            ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
    _CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}

    def eval_arith(self, node, line: int, depth: int) -> int:
        if depth > 64:
            raise ShellError(line, "an arithmetic expression nested too deep")
        ev = lambda n: self.eval_arith(n, line, depth + 1)   # noqa: E731
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            value = self.vars.get(node.id, "")
            value = value[0] if isinstance(value, list) and value else (value or "0")
            if MARK in value:
                raise Unknown(repr(self.what(value)))
            value = value.strip()
            if is_name(value):
                return self.eval_arith(ast.Name(value), line, depth + 1)
            try:
                return int(value)
            except ValueError:
                raise ShellError(line, f"${node.id} = {value!r} is not an integer")
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return {ast.USub: -v, ast.UAdd: v, ast.Not: int(not v), ast.Invert: ~v}[type(node.op)]
        if isinstance(node, ast.BinOp) and type(node.op) in self._BIN:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                if b == 0:
                    raise ShellError(line, "division by 0 in an arithmetic expression")
                q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)     # C division, as bash
                return q if not isinstance(node.op, ast.Mod) else a - q * b
            if isinstance(node.op, ast.Pow) and (b < 0 or b > 64):
                raise ShellError(line, "exponent out of range in an arithmetic expression")
            if isinstance(node.op, ast.LShift) and b > 64:
                raise ShellError(line, "shift out of range in an arithmetic expression")
            return self._BIN[type(node.op)](a, b)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in self._CMP:
            return int(self._CMP[type(node.ops[0])](ev(node.left), ev(node.comparators[0])))
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return int(all(values)) if isinstance(node.op, ast.And) else int(any(values))
        raise ShellError(line, "an arithmetic expression mrl convert cannot evaluate")

    # ---- expansion ----
    def expand_one(self, w: Word, pattern: bool = False) -> str:
        """A word expanded without field splitting (assignments, case words)."""
        return " ".join(self.expand(w, split=False)) if w.parts else ""

    def expand(self, w: Word, split: bool = True) -> list[str]:
        fields: list[str] = []
        current: list[str] = []
        started = False
        for kind, text, quoted in w.parts:
            self.step(w.line)
            if kind == "lit":
                current.append(text)
                started = started or quoted or text != ""
                continue
            if kind == "var":
                value = self.parameter(text, w.line)
            elif kind == "arith":
                try:
                    value = str(self.arith(text, w.line))
                except Unknown as e:
                    value = self.unknown(f"$(({text})) with {e}")
            elif kind == "cmd":
                value = self.substitute(text, w.line)
            else:
                value = ""
            if isinstance(value, list):       # "${A[@]}": one field per item
                if not value:
                    continue
                if quoted or not split:
                    current.append(value[0])
                    for item in value[1:]:
                        fields.append("".join(current))
                        current = [item]
                    started = True
                    continue
                value = " ".join(value)
            if quoted or not split:
                current.append(value)
                started = True
                continue
            if value in self.unset and len(w.parts) == 1:   # an unquoted unset variable alone: no word at all
                continue
            pieces = value.split()
            if not pieces:
                continue
            if value[:1].isspace() and (current and "".join(current)):
                fields.append("".join(current))
                current = []
            current.append(pieces[0])
            for piece in pieces[1:]:
                fields.append("".join(current))
                current = [piece]
            if value[-1:].isspace():
                fields.append("".join(current))
                current = []
                started = False
                continue
            started = True
        if current or started:
            fields.append("".join(current))
        return fields

    def lookup(self, name: str, line: int):
        if name in ("@", "*"):
            return list(self.positional)
        if name == "#":
            return str(len(self.positional))
        if name == "?":
            return str(self.status)
        if name == "0":
            return str(self.path)
        if name.isdigit():
            i = int(name)
            return self.positional[i - 1] if i <= len(self.positional) else ""
        if name in ("$", "!", "RANDOM"):
            return self.unknown(f"${name}")
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[(.*)\]", name)
        if m:
            value = self.vars.get(m.group(1))
            items = [] if value is None else ([value] if isinstance(value, str) else value)
            if m.group(2) in ("@", "*"):
                return list(items)
            idx = self.arith(m.group(2), line)
            return items[idx] if -len(items) <= idx < len(items) else ""
        if name == "PWD":
            return self.cwd
        value = self.vars.get(name)
        if isinstance(value, list):
            return value[0] if value else ""
        return value

    def parameter(self, expr: str, line: int):
        if expr.startswith("#") and len(expr) > 1:
            value = self.lookup(expr[1:], line)
            return str(len(value) if isinstance(value, list) else len(value or ""))
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?|[0-9]+|[@*#?$!])", expr)
        if not m:
            raise ShellError(line, f"`${{{expr}}}`: a parameter expansion mrl convert cannot read")
        name, rest = m.group(1), expr[m.end():]
        value = self.lookup(name, line)
        if not rest:
            if value is None:       # not set by the script nor the environment: asked for where it is used
                mark = self.unknown(f"${name}, which is not set (give it in the environment)")
                self.unset.add(mark)
                return mark
            return value
        for op in (":-", ":=", ":+", ":?", "-", "=", "+", "?"):
            if rest.startswith(op):
                word = rest[len(op):]
                empty = value is None or (op.startswith(":") and (value == "" or value == []))
                if op in (":-", "-"):
                    return self.operand(word, line) if empty else value
                if op in (":=", "="):
                    if empty:
                        value = self.operand(word, line)
                        self.vars[name] = value
                    return value
                if op in (":+", "+"):
                    return "" if empty else self.operand(word, line)
                if empty:      # `${X:?message}`: the script needs X; its value is asked for where it is used
                    return self.unknown(f"{name}, which the script requires ({self.what(self.operand(word, line))})")
                return value
        text = value if isinstance(value, str) else " ".join(value or [])
        for op in ("##", "#", "%%", "%", "//", "/", "^^", ",,", "^", ","):
            if rest.startswith(op):
                word = self.operand(rest[len(op):], line)
                if MARK in text:
                    return self.unknown(f"${{{expr}}} of {self.what(text)}")
                if op in ("^^", "^"):
                    return text.upper()
                if op in (",,", ","):
                    return text.lower()
                if op in ("//", "/"):
                    pat, _, rep = word.partition("/")
                    return text.replace(pat, rep) if op == "//" else text.replace(pat, rep, 1)
                return _trim(text, word, op)
        if rest.startswith(":"):
            bits = rest[1:].split(":")
            try:
                start = self.arith(bits[0], line)
                length = self.arith(bits[1], line) if len(bits) > 1 else None
            except Unknown as e:
                return self.unknown(f"${{{expr}}} with {e}")
            return text[start:] if length is None else text[start:start + length]
        raise ShellError(line, f"`${{{expr}}}`: a parameter expansion mrl convert cannot read")

    def operand(self, text: str, line: int) -> str:
        return self.expand_one(Word(tuple(_lex_operand(text, line)), line))


def _trim(text: str, pattern: str, op: str) -> str:
    """${x#p}, ${x##p}, ${x%p}, ${x%%p}: shortest / longest prefix or suffix matching a glob."""
    n = len(text)
    if op in ("#", "##"):
        ends = range(0, n + 1) if op == "#" else range(n, -1, -1)
        for k in ends:
            if fnmatch.fnmatchcase(text[:k], pattern):
                return text[k:]
        return text
    starts = range(n, -1, -1) if op == "%" else range(0, n + 1)
    for k in starts:
        if fnmatch.fnmatchcase(text[k:], pattern):
            return text[:k]
    return text


def _lex_operand(text: str, line: int) -> list[tuple]:
    """The parts of the word after `:-` (or of an arithmetic body): quotes and expansions, spaces kept."""
    lex = Lexer(text)
    lex.line = line
    parts: list[tuple] = []
    while lex.i < len(text):
        c = lex.peek()
        if c in " \t\n;&|()<>":
            parts.append(("lit", lex.advance(), True))
            continue
        parts.extend(lex.read_word().parts)
    return parts
