"""Commands of a bash script from its tokens (`shell_lex.py`): simple commands, `&&`/`||` lists,
pipelines, `if`, `case`, `for`, `while`/`until`, `{ }`, `( )` and function definitions."""
from __future__ import annotations

from dataclasses import dataclass, field

from mrl.convert.shell_lex import Lexer, ShellError, Token, Word

MAX_TOKENS = 200_000


@dataclass
class Simple:
    line: int
    words: list[Word]
    assignments: list[Word] = field(default_factory=list)


@dataclass
class AndOr:
    line: int
    items: list[tuple[str, object]]      # ("", first), ("&&", next), ("||", next); a pipeline is its last command


@dataclass
class If:
    line: int
    branches: list[tuple[list, list]]    # (condition, body)
    otherwise: list | None


@dataclass
class Case:
    line: int
    word: Word
    arms: list[tuple[list[Word], list]]


@dataclass
class For:
    line: int
    name: str
    words: list[Word] | None
    body: list


@dataclass
class While:
    line: int
    body: list


@dataclass
class Group:
    line: int
    body: list


@dataclass
class Function:
    line: int
    name: str
    body: list


_STOP_WORDS = {"then", "fi", "else", "elif", "do", "done", "esac", "}"}


class Parser:
    def __init__(self, text: str):
        lexer = Lexer(text)
        self.tokens: list[Token] = lexer.tokens()
        if len(self.tokens) > MAX_TOKENS:
            raise ShellError(1, f"the script has {len(self.tokens)} tokens; mrl convert reads at most {MAX_TOKENS}")
        self.notes = lexer.notes
        self.k = 0

    def peek(self) -> Token | None:
        return self.tokens[self.k] if self.k < len(self.tokens) else None

    def at_word(self, *names: str) -> bool:
        t = self.peek()
        return t is not None and t.kind == "word" and t.value.unquoted_literal() in names

    def at_op(self, *ops: str) -> bool:
        t = self.peek()
        return t is not None and t.kind == "op" and t.value in ops

    def take(self) -> Token:
        if self.k >= len(self.tokens):
            raise ShellError(self.tokens[-1].line if self.tokens else 1, "the script ends in the middle of a command")
        t = self.tokens[self.k]
        self.k += 1
        return t

    def take_word(self, what: str, line: int) -> Word:
        t = self.take()
        if t.kind != "word":
            raise ShellError(t.line, f"{what} needs a word, not `{t.value!r}`")
        return t.value

    def expect_word(self, name: str, line: int) -> None:
        self.skip_newlines()
        if not self.at_word(name):
            t = self.peek()
            if t is None:
                raise ShellError(line, f"the command of this line is never closed: expected `{name}`")
            raise ShellError(t.line, f"expected `{name}`")
        self.take()

    def skip_newlines(self) -> None:
        while self.at_op("\n", ";"):
            self.take()

    def script(self) -> list:
        body = self.list_until()
        t = self.peek()
        if t is not None:
            what = t.value.literal() if t.kind == "word" else t.value
            raise ShellError(t.line, f"unexpected `{what}`")
        return body

    def list_until(self, ops: tuple[str, ...] = ()) -> list:
        out = []
        while True:
            self.skip_newlines()
            t = self.peek()
            if t is None or (t.kind == "word" and t.value.unquoted_literal() in _STOP_WORDS) \
                    or (t.kind == "op" and (t.value in ops or t.value in (")", ";;"))):
                return out
            out.append(self.and_or())
            if self.at_op("&"):
                self.take()

    def and_or(self) -> AndOr:
        line = self.peek().line
        items = [("", self.pipeline())]
        while self.at_op("&&", "||"):
            op = self.take().value
            while self.at_op("\n"):
                self.take()
            items.append((op, self.pipeline()))
        return AndOr(line, items)

    def pipeline(self):
        if self.at_word("!"):
            self.take()
        line = self.peek().line if self.peek() else 0
        cmds = [self.command()]
        while self.at_op("|"):
            self.take()
            while self.at_op("\n"):
                self.take()
            cmds.append(self.command())
        return cmds[0] if len(cmds) == 1 else Group(line, cmds)   # every command runs; the status is the last one's

    def command(self):
        t = self.peek()
        if t is None:
            raise ShellError(self.tokens[-1].line if self.tokens else 1, "the script ends in the middle of a command")
        line = t.line
        if t.kind == "op":
            if t.value == "(":
                self.take()
                body = self.list_until()
                if not self.at_op(")"):
                    raise ShellError(line, "a `(` subshell is never closed")
                self.take()
                self.redirections()
                return Group(line, body)
            raise ShellError(line, f"unexpected `{t.value}`")
        name = t.value.unquoted_literal()
        if name == "if":
            return self.if_(line)
        if name == "case":
            return self.case(line)
        if name in ("for", "select"):
            return self.for_(line)
        if name in ("while", "until"):
            self.take()
            cond = self.list_until()
            self.expect_word("do", line)
            body = self.list_until()
            self.expect_word("done", line)
            self.redirections()
            return While(line, cond + body)
        if name == "{":
            self.take()
            body = self.list_until()
            self.expect_word("}", line)
            self.redirections()
            return Group(line, body)
        if name == "function":
            self.take()
            fname = self.take_word("`function`", line).literal() or "?"
            if self.at_op("("):
                self.take()
                self.take()
            return self.function_body(line, fname)
        if name and self.k + 2 < len(self.tokens) and self.tokens[self.k + 1].kind == "op" \
                and self.tokens[self.k + 1].value == "(" and self.tokens[self.k + 2].value == ")":
            self.k += 3
            return self.function_body(line, name)
        return self.simple(line)

    def function_body(self, line: int, name: str) -> Function:
        self.skip_newlines()
        body = self.command()
        return Function(line, name, [AndOr(line, [("", body)])])

    def if_(self, line: int) -> If:
        self.take()
        branches = []
        otherwise = None
        while True:
            cond = self.list_until()
            self.expect_word("then", line)
            body = self.list_until()
            branches.append((cond, body))
            self.skip_newlines()
            if self.at_word("elif"):
                self.take()
                continue
            if self.at_word("else"):
                self.take()
                otherwise = self.list_until()
            self.expect_word("fi", line)
            self.redirections()
            return If(line, branches, otherwise)

    def case(self, line: int) -> Case:
        self.take()
        word = self.take_word("`case`", line)
        self.expect_word("in", line)
        arms = []
        while True:
            self.skip_newlines()
            if self.at_word("esac"):
                self.take()
                self.redirections()
                return Case(line, word, arms)
            if self.at_op("("):
                self.take()
            patterns = []
            while True:
                t = self.peek()
                if t is None:
                    raise ShellError(line, "`case` is never closed by `esac`")
                if t.kind != "word":
                    raise ShellError(t.line, f"unexpected `{t.value}` in a case pattern")
                patterns.append(self.take().value)
                if self.at_op("|"):
                    self.take()
                    continue
                break
            if not self.at_op(")"):
                raise ShellError(self.peek().line if self.peek() else line, "a case pattern ends with `)`")
            self.take()
            body = self.list_until()
            arms.append((patterns, body))
            if self.at_op(";;"):
                self.take()

    def for_(self, line: int) -> For:
        self.take()
        if self.at_op("(") :
            raise ShellError(line, "arithmetic `for ((...))` loops are not read by mrl convert")
        name = self.take_word("`for`", line).literal() or "?"
        words = None
        while self.at_op("\n"):
            self.take()
        if self.at_word("in"):
            self.take()
            words = []
            while self.peek() is not None and self.peek().kind == "word":
                words.append(self.take().value)
        self.expect_word("do", line)
        body = self.list_until()
        self.expect_word("done", line)
        self.redirections()
        return For(line, name, words, body)

    def redirections(self) -> None:
        while self.at_op(">", ">>", "<", "&>", ">&", "<&", "<<", "<<<"):
            op = self.take().value
            if op != "<<" and self.peek() is not None and self.peek().kind == "word":
                self.take()

    def simple(self, line: int) -> Simple:
        words: list[Word] = []
        assignments: list[Word] = []
        while True:
            t = self.peek()
            if t is None:
                break
            if t.kind == "op":
                if t.value in (">", ">>", "<", "&>", ">&", "<&", "<<", "<<<"):
                    self.redirections()
                    if words and words[-1].unquoted_literal() is not None and words[-1].unquoted_literal().isdigit():
                        words.pop()        # `2>/dev/null`: the 2 belongs to the redirection
                    continue
                break
            w = t.value
            if not words and (w.array is not None or _assignment(w)):
                assignments.append(self.take().value)
                continue
            words.append(self.take().value)
        return Simple(line, words, assignments)


def _assignment(w: Word) -> bool:
    from mrl.convert.shell_lex import is_name

    first = w.parts[0] if w.parts else None
    if first is None or first[0] != "lit" or first[2] or "=" not in first[1]:
        return False
    return is_name(first[1].split("=", 1)[0].rstrip("+"))
