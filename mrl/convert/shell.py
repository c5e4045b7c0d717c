"""Read a verl launch script as bash would run it, without running anything: variables, arrays,
`${VAR:-default}` and the other parameter expansions, `$((...))`, `if`/`case`/`for`, functions,
`export`, environment prefixes, then the trainer command (`python3 -m verl.trainer.main_ppo ...`,
a recipe's entry point, under `torchrun` or `ray job submit` too) and its arguments.

Nothing is executed. A command's output (`$(date)`, `$(nproc)`) is unknown: it is carried as a
marker and `mrl convert` asks for the value where it reaches a setting. A test (`if`, `case`) that
depends on an unknown value is refused with the script line, since either branch would be a guess.
The few commands whose answer mrl knows are answered (`python3 -c 'import torch_npu'` fails: mrl
runs on CUDA or CPU, never on Ascend NPUs), and `dirname`, `basename`, `pwd`, `echo`, `printf`.
"""
from __future__ import annotations

import ast
import fnmatch
import operator
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mrl.convert.shell_lex import Lexer, ShellError, Word, is_name
from mrl.convert.shell_parse import AndOr, Case, For, Function, Group, If, Parser, Simple, While

MAX_STEPS = 200_000          # commands and expansions interpreted: loops cannot run for ever
MAX_VALUE_CHARS = 1_000_000  # no variable grows past this
MAX_CALL_DEPTH = 50
MARK = "\x00"                # an unknown value: MARK + index + MARK

# Trainer entry points: module -> the named config it composes by default (None: refused, with why).
ENTRY_POINTS: dict[str, str] = {
    "verl.trainer.main_ppo": "ppo_trainer",
    "verl.trainer.main_ppo_sync": "ppo_trainer",
    "recipe.dapo.main_dapo": "dapo_trainer",
    "recipe.entropy.main_entropy": "entropy_trainer",
}
REFUSED_ENTRY_POINTS: dict[str, str] = {
    "verl.trainer.sft_trainer": "verl's SFT trainer: mrl convert reads RL jobs; write an `mrl sft` job (docs/sft.md)",
    "verl.trainer.fsdp_sft_trainer": "verl's SFT trainer: mrl convert reads RL jobs; write an `mrl sft` job (docs/sft.md)",
    "verl.trainer.main_generation": "verl's offline generation: use `mrl generate`",
    "verl.trainer.main_generation_server": "verl's offline generation: use `mrl generate`",
    "verl.trainer.main_eval": "verl's offline evaluation: use `mrl eval`",
    "verl.experimental.fully_async_policy.fully_async_main": "verl's fully asynchronous trainer: mrl generates and trains in lock-step (off-policy staleness is not modelled)",
    "recipe.dapo.dapo_transfer_queue.main_dapo": "verl's transfer-queue trainer: mrl has no transfer queue",
    "verl_mlite.launch": "verl's Megatron-lite launcher (a separate project)",
}
_KNOWN_STATUS = {"import torch_npu": (1, "mrl runs on CUDA or CPU, never on Ascend NPUs: `import torch_npu` is taken to fail")}
_ARITH = re.compile(r"[0-9A-Za-z_+\-*/%()<>=!&|^~?: \t\n]*")


class _Exit(Exception):
    def __init__(self, line: int, status: int):
        self.line, self.status = line, status


class _Return(Exception):
    pass


class _Unknown(Exception):
    """A test or an arithmetic that depends on a value mrl convert cannot know."""


@dataclass
class TrainerCommand:
    module: str
    line: int
    args: list[str]                          # the words after the module (markers for unknown values)
    refused: str | None = None


@dataclass
class ScriptRead:
    command: TrainerCommand | None
    notes: list[str] = field(default_factory=list)
    unknowns: list[str] = field(default_factory=list)     # marker index -> what the value is
    exit_line: int | None = None

    def describe(self, text: str) -> str:
        """`text` with each unknown marker replaced by what it stands for."""
        return re.sub(f"{MARK}(\\d+){MARK}", lambda m: f"<{self.unknowns[int(m.group(1))]}>", text)


def read_script_text(text: str, path: Path, env: dict[str, str] | None = None) -> ScriptRead:
    try:
        body = Parser(text)
        interp = _Interp(path, dict(os.environ if env is None else env))
        interp.notes += body.notes
        tree = body.script()
        try:
            interp.run(tree)
        except _Exit as e:
            interp.exit_line = e.line if e.status != 0 else None
        except _Return:
            pass
    except RecursionError:
        raise ShellError(1, "the script nests commands too deep for mrl convert")
    return ScriptRead(interp.commands[0] if interp.commands else None, interp.notes, interp.unknowns,
                      interp.exit_line)


class _Interp:
    def __init__(self, path: Path, env: dict[str, str]):
        self.path = path
        self.vars: dict[str, str | list[str]] = dict(env)
        self.vars.setdefault("HOME", os.path.expanduser("~"))
        self.vars["BASH_SOURCE"] = [str(path)]
        self.positional: list[str] = []
        self.cwd = os.getcwd()          # `cd` moves it; `pwd` prints it
        self.functions: dict[str, list] = {}
        self.commands: list[TrainerCommand] = []
        self.notes: list[str] = []
        self.unknowns: list[str] = []
        self.unset: set[str] = set()       # markers of variables that are not set (bash reads them as "")
        self.steps = 0
        self.depth = 0
        self.output: list[str] | None = None     # inside $(...): what echo prints
        self.status = 0
        self.exit_line: int | None = None

    # ---- bookkeeping ----
    def step(self, line: int) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise ShellError(line, f"more than {MAX_STEPS} steps (a loop that does not end?)")

    def unknown(self, what: str) -> str:
        self.unknowns.append(what)
        return f"{MARK}{len(self.unknowns) - 1}{MARK}"

    def what(self, text: str) -> str:
        return re.sub(f"{MARK}(\\d+){MARK}", lambda m: self.unknowns[int(m.group(1))], text)

    # ---- commands ----
    def run(self, body: list) -> int:
        for node in body:
            self.status = self.exec(node)
        return self.status

    def exec(self, node) -> int:
        self.step(node.line)
        if isinstance(node, AndOr):
            status = self.exec(node.items[0][1])
            for op, cmd in node.items[1:]:
                if (op == "&&" and status == 0) or (op == "||" and status != 0):
                    status = self.exec(cmd)
            return status
        if isinstance(node, Simple):
            return self.simple(node)
        if isinstance(node, If):
            for cond, body in node.branches:
                if self.run(cond) == 0:
                    return self.run(body)
            return self.run(node.otherwise) if node.otherwise is not None else 0
        if isinstance(node, Case):
            value = self.blank_unset(self.expand_one(node.word))
            for patterns, body in node.arms:
                for p in patterns:
                    pat = self.expand_one(p, pattern=True)
                    if MARK in value and pat != "*":
                        raise ShellError(node.line, f"`case` on {self.what(value)!r}, which mrl convert cannot "
                                                    "know: give the variable in the environment")
                    if fnmatch.fnmatchcase(value, pat):
                        return self.run(body)
            return 0
        if isinstance(node, For):
            words = self.positional if node.words is None else [f for w in node.words for f in self.expand(w)]
            for item in words:
                if MARK in item:
                    raise ShellError(node.line, f"a `for` loop over {self.what(item)!r}, which mrl convert cannot know")
                self.vars[node.name] = item
                self.run(node.body)
            return 0
        if isinstance(node, While):
            self.notes.append(f"line {node.line}: a while/until loop is not run by mrl convert")
            return 0
        if isinstance(node, Group):
            return self.run(node.body)
        if isinstance(node, Function):
            self.functions[node.name] = node.body
            return 0
        raise ShellError(getattr(node, "line", 0), "a command mrl convert cannot read")

    def assign(self, w: Word, local_vars: dict | None = None) -> None:
        text = w.parts[0][1]
        name, _, first = text.partition("=")
        append = name.endswith("+")
        name = name.rstrip("+")
        if w.array is not None:
            items = [f for item in w.array for f in self.expand(item)]
            old = self.vars.get(name, [])
            old = [old] if isinstance(old, str) else list(old)
            self.vars[name] = (old + items) if append else items
            return
        value = self.expand_one(Word((("lit", first, False), *w.parts[1:]), w.line))
        if append:
            old = self.vars.get(name, "")
            if isinstance(old, list):
                self.vars[name] = old + [value]
                return
            value = old + value
        if len(value) > MAX_VALUE_CHARS:
            raise ShellError(w.line, f"{name} grows past {MAX_VALUE_CHARS} characters")
        self.vars[name] = value

    def simple(self, node: Simple) -> int:
        if len(node.words) == 1 and node.words[0].parts and node.words[0].parts[0][0] == "arithcmd":
            try:
                return 0 if self.arith(node.words[0].parts[0][1], node.line) != 0 else 1
            except _Unknown as e:
                raise ShellError(node.line, f"`(( ... ))` depends on {e}, which mrl convert cannot know")
        if not node.words:
            for a in node.assignments:
                self.assign(a)
            return 0
        words = [f for w in node.words for f in self.expand(w)]
        prefix = {}
        for a in node.assignments:       # `A=1 python3 ...`: the environment of that one command
            name = a.parts[0][1].split("=", 1)[0]
            prefix[name] = self.vars.get(name)
            self.assign(a)
        try:
            return self.command(words, node.line) if words else 0
        finally:
            for name, old in prefix.items():
                if old is None:
                    self.vars.pop(name, None)
                else:
                    self.vars[name] = old

    def command(self, words: list[str], line: int) -> int:
        name = words[0]
        args = words[1:]
        if name in ("export", "declare", "local", "readonly", "typeset"):
            for a in args:
                if "=" in a and is_name(a.split("=", 1)[0].rstrip("+")):
                    k, _, v = a.partition("=")
                    self.vars[k] = v
            return 0
        if name == "unset":
            for a in args:
                self.vars.pop(a, None)
            return 0
        if name == "shift":
            n = int(args[0]) if args and args[0].isdigit() else 1
            self.positional = self.positional[n:]
            return 0
        if name == "set":
            if "--" in args:
                self.positional = args[args.index("--") + 1:]
            return 0
        if name in ("exit", "return"):
            status = int(args[0]) if args and args[0].lstrip("-").isdigit() else self.status
            if name == "return" and self.output is not None:
                raise _Return()
            raise _Exit(line, status)
        if name in ("true", ":"):
            return 0
        if name == "false":
            return 1
        if name in ("[", "[[", "test"):
            if name != "test":
                args = args[:-1]
            try:
                return 0 if self.test(args) else 1
            except _Unknown as e:
                raise ShellError(line, f"the test `{name} {' '.join(self.what(a) for a in args)}` depends on {e}, "
                                       "which mrl convert cannot know: give it in the environment")
        if name in ("echo", "printf"):
            if self.output is not None:
                if name == "echo":
                    self.output.append(" ".join(a for a in args if a not in ("-n", "-e")) + "\n")
                elif args:
                    fmt, rest = args[0], args[1:]
                    self.output.append(fmt.replace("%s", rest[0] if rest else "").replace("\\n", "\n")
                                       if "%" not in fmt.replace("%s", "") else self.unknown(f"printf {fmt}"))
            return 0
        if name in ("source", "."):
            self.notes.append(f"line {line}: `{name} {' '.join(args)}` is not read (its variables are not known here)")
            return 0
        if name in self.functions:
            if self.depth >= MAX_CALL_DEPTH:
                raise ShellError(line, f"functions call each other more than {MAX_CALL_DEPTH} deep")
            saved = self.positional
            self.positional = args
            self.depth += 1
            try:
                self.run(self.functions[name])
            except _Return:
                pass
            finally:
                self.positional = saved
                self.depth -= 1
            return 0
        if name == "cd" or (name in ("dirname", "basename", "realpath", "pwd", "readlink") and self.output is not None):
            return self.path_command(name, args)
        trainer = self.trainer(words, line)
        if trainer is not None:
            self.commands.append(trainer)
            if len(self.commands) == 2:
                self.notes.append(f"line {line}: a second trainer command ({trainer.module}); the first "
                                  f"(line {self.commands[0].line}) is converted")
            return 0
        if name.startswith("python") and "-c" in args:
            code = args[args.index("-c") + 1].strip() if args.index("-c") + 1 < len(args) else ""
            if code in _KNOWN_STATUS:
                status, why = _KNOWN_STATUS[code]
                self.notes.append(f"line {line}: {why}")
                return status
        if self.output is not None:   # a command whose output is wanted but not known
            self.output.append(self.unknown("$(" + " ".join(self.what(w) for w in words) + ")"))
        return 0       # other programs (mkdir, pip, ray start, wget ...) are taken to succeed

    def path_command(self, name: str, args: list[str]) -> int:
        args = [a for a in args if not a.startswith("-")]
        if name == "cd":
            self.cwd = os.path.normpath(os.path.join(self.cwd, args[0])) if args and MARK not in args[0] \
                else self.unknown("a directory")
            return 0
        if name == "pwd":
            self.output.append((self.cwd if MARK not in self.cwd else self.unknown("$(pwd)")) + "\n")
        elif args and MARK not in args[0]:
            f = {"dirname": os.path.dirname, "basename": os.path.basename,
                 "realpath": os.path.abspath, "readlink": os.path.abspath}[name]
            self.output.append((f(args[0]) or ".") + "\n")
        else:
            self.output.append(self.unknown(f"$({name} {' '.join(self.what(a) for a in args)})"))
        return 0

    def trainer(self, words: list[str], line: int) -> TrainerCommand | None:
        for i, w in enumerate(words):
            module = None
            if w == "-m" and i + 1 < len(words):
                module = words[i + 1]
                rest = words[i + 2:]
            elif w.endswith(".py") and (os.path.basename(w)[:-3] in ("main_ppo", "main_dapo", "main_entropy")):
                module = {"main_ppo": "verl.trainer.main_ppo", "main_dapo": "recipe.dapo.main_dapo",
                          "main_entropy": "recipe.entropy.main_entropy"}[os.path.basename(w)[:-3]]
                rest = words[i + 1:]
            if module is None:
                continue
            if module in ENTRY_POINTS:
                return TrainerCommand(module, line, rest)
            if module in REFUSED_ENTRY_POINTS:
                return TrainerCommand(module, line, rest, REFUSED_ENTRY_POINTS[module])
            if module.startswith(("verl.", "recipe.")):
                return TrainerCommand(module, line, rest, f"{module}: a verl entry point whose configuration mrl "
                                                          "convert does not know (it reads verl.trainer.main_ppo, "
                                                          "recipe.dapo.main_dapo and recipe.entropy.main_entropy)")
        return None

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
                raise _Unknown(f"whether the file {self.what(a)!r} exists")
            raise _Unknown(f"`{op} {a}`")
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
        raise _Unknown(f"`{' '.join(self.what(a) for a in args)}`")

    def blank_unset(self, value: str) -> str:
        """`value` with the markers of unset variables read as bash reads them: empty."""
        for mark in self.unset:
            value = value.replace(mark, "")
        return value

    def known(self, value: str) -> str:
        value = self.blank_unset(value)
        if MARK in value:
            raise _Unknown(repr(self.what(value)))
        return value

    def integer(self, value: str) -> int:
        value = self.known(value).strip()
        try:
            return int(value or "0")
        except ValueError:
            raise _Unknown(f"{value!r} (not a number)")

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
                raise _Unknown(repr(self.what(value)))
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
                except _Unknown as e:
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

    def substitute(self, body: str, line: int) -> str:
        saved_out, saved_vars, saved_pos = self.output, dict(self.vars), self.positional
        self.output = []
        try:
            try:
                self.run(Parser(body).script())
            except (_Exit, _Return):
                pass
            out = "".join(self.output)
        except ShellError as e:
            raise ShellError(line + e.line - 1, f"in `$({body.strip()[:60]})`: {e.message}")
        finally:
            self.output, self.vars, self.positional = saved_out, saved_vars, saved_pos
        return out.rstrip("\n")

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
            except _Unknown as e:
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
