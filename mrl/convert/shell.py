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

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mrl.convert.shell_expand import MARK, MAX_VALUE_CHARS, Expansion, Unknown
from mrl.convert.shell_lex import ShellError, Word, is_name
from mrl.convert.shell_parse import AndOr, Case, For, Function, Group, If, Parser, Simple, While

MAX_STEPS = 200_000          # commands and expansions interpreted: loops cannot run for ever
MAX_CALL_DEPTH = 50

# Trainer entry points: module -> the named config it composes by default (None: refused, with why).
ENTRY_POINTS: dict[str, str] = {
    "verl.trainer.main_ppo": "ppo_trainer",
    "verl.trainer.main_ppo_sync": "ppo_trainer",
    "recipe.dapo.main_dapo": "dapo_trainer",
    "recipe.entropy.main_entropy": "entropy_trainer",
}
REFUSED_ENTRY_POINTS: dict[str, str] = {
    "verl.trainer.sft_trainer": "verl's SFT trainer: mrl convert reads RL jobs; write an `mrl sft` job (jobs/sft_cpu.toml, docs/guide.md)",
    "verl.trainer.fsdp_sft_trainer": "verl's SFT trainer: mrl convert reads RL jobs; write an `mrl sft` job (jobs/sft_cpu.toml, docs/guide.md)",
    "verl.trainer.main_generation": "verl's offline generation: use `mrl generate`",
    "verl.trainer.main_generation_server": "verl's offline generation: use `mrl generate`",
    "verl.trainer.main_eval": "verl's offline evaluation: use `mrl eval`",
    "verl.experimental.fully_async_policy.fully_async_main": "verl's fully asynchronous trainer: mrl generates and trains in lock-step (off-policy staleness is not modelled)",
    "recipe.dapo.dapo_transfer_queue.main_dapo": "verl's transfer-queue trainer: mrl has no transfer queue",
    "verl_mlite.launch": "verl's Megatron-lite launcher (a separate project)",
}
_KNOWN_STATUS = {"import torch_npu": (1, "mrl runs on CUDA or CPU, never on Ascend NPUs: `import torch_npu` is taken to fail")}


class _Exit(Exception):
    def __init__(self, line: int, status: int):
        self.line, self.status = line, status


class _Return(Exception):
    pass


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


class _Interp(Expansion):
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
            except Unknown as e:
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
            except Unknown as e:
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
