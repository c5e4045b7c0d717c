"""The bash subset that verl's launch scripts are written in, read into words and commands
(never executed): quotes spanning lines, `\\` continuations, comments, `$VAR`, `${...}`, `$(...)`,
`$((...))`, backquotes, arrays `A=(...)`, `;`, `&&`, `||`, `|`, redirections, here-documents,
and the compound commands `if`, `case`, `for`, `while`, `{ }`, `( )` and functions.

A word is a tuple of parts: ("lit", text, quoted), ("var", expression, quoted) for `$X` / `${...}`,
("cmd", text, quoted) for `$(...)` and backquotes, ("arith", text, quoted) for `$((...))`.
`mrl/convert/shell.py` expands and interprets them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_SCRIPT_CHARS = 1_000_000
_OPERATORS = (";;", "&&", "||", ">>", "<<", "&>", ">&", "<&", ";", "&", "|", "(", ")", "<", ">", "\n")
_WORD_END = set(" \t\n;&|()<>")


class ShellError(Exception):
    """What cannot be read: the script line and why."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line, self.message = line, message


@dataclass
class Word:
    parts: tuple
    line: int
    array: list["Word"] | None = None      # NAME=(...) : the items
    notes: list[str] = field(default_factory=list)

    def literal(self) -> str | None:
        """The word's text when it has no expansion (quotes removed), else None."""
        if all(p[0] == "lit" for p in self.parts):
            return "".join(p[1] for p in self.parts)
        return None

    def unquoted_literal(self) -> str | None:
        """The text when the word is one bare (unquoted) literal: keywords such as `then`, `fi`."""
        if len(self.parts) == 1 and self.parts[0][0] == "lit" and not self.parts[0][2]:
            return self.parts[0][1]
        return None


@dataclass
class Token:
    kind: str          # "word" or "op"
    value: object      # Word, or the operator text
    line: int


class Lexer:
    def __init__(self, text: str):
        if len(text) > MAX_SCRIPT_CHARS:
            raise ShellError(1, f"the script is {len(text)} characters; mrl convert reads at most {MAX_SCRIPT_CHARS}")
        self.text, self.i, self.line = text, 0, 1
        self.notes: list[str] = []
        self.pending_heredocs: list[tuple[str, bool]] = []
        self.continued = False     # the last line ended with `\`

    # -- characters --
    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def advance(self, n: int = 1) -> str:
        s = self.text[self.i:self.i + n]
        self.line += s.count("\n")
        self.i += n
        return s

    # -- tokens --
    def tokens(self) -> list[Token]:
        out: list[Token] = []
        while True:
            tok = self.next_token(out)
            if tok is None:
                return out
            out.append(tok)

    def next_token(self, before: list[Token]) -> Token | None:
        while True:
            c = self.peek()
            if c == "":
                return None
            if c in " \t\r":
                self.advance()
            elif c == "\\" and self.peek(1) == "\n":
                self.advance(2)
                self.continued = True
            elif c == "#":
                start_line = self.line
                j = self.text.find("\n", self.i)
                j = len(self.text) if j < 0 else j
                comment = self.text[self.i:j]
                self.advance(j - self.i)
                if self.continued and comment.rstrip().endswith("\\") and self.peek() == "\n":
                    # A commented-out line inside a `\`-continued command: bash would end the command
                    # here; the script's author means the lines after it to continue it.
                    self.advance()
                    self.notes.append(f"line {start_line}: a commented-out line inside a continued command "
                                      "(bash would end the command there); read as the lines after it continuing it")
            else:
                break
        line = self.line
        if c == "\n":
            self.advance()
            self.continued = False
            if self.pending_heredocs:
                self.read_heredocs()
            return Token("op", "\n", line)
        self.continued = False
        if self.text.startswith("((", self.i) and (not before or before[-1].kind == "op" or (
                before[-1].value.unquoted_literal() in ("if", "then", "else", "elif", "do", "while", "until", "!"))):
            self.advance(2)     # an arithmetic command `(( ... ))`
            body = self.balanced("(", ")", line, "((")
            if self.peek() != ")":
                raise ShellError(line, "`((` is not closed by `))`")
            self.advance()
            return Token("word", Word((("arithcmd", body, False),), line), line)
        for op in _OPERATORS:
            if self.text.startswith(op, self.i) and op != "\n":
                if op == "<<":
                    return self.heredoc_start(line)
                self.advance(len(op))
                return Token("op", op, line)
        word = self.read_word()
        return Token("word", word, line)

    def heredoc_start(self, line: int) -> Token:
        self.advance(2)
        if self.peek() == "<":        # here-string <<<: the next word is its text
            self.advance()
            return Token("op", "<<<", line)
        if self.peek() == "-":
            self.advance()
        while self.peek() in " \t":
            self.advance()
        word = self.read_word()
        delim = "".join(p[1] for p in word.parts if p[0] == "lit")
        self.pending_heredocs.append((delim, True))
        return Token("op", "<<", line)

    def read_heredocs(self) -> None:
        for delim, _ in self.pending_heredocs:
            while self.i < len(self.text):
                j = self.text.find("\n", self.i)
                j = len(self.text) if j < 0 else j
                body_line = self.text[self.i:j]
                self.advance(j - self.i + (1 if j < len(self.text) else 0))
                if body_line.strip() == delim:
                    break
        self.pending_heredocs = []

    def read_word(self) -> Word:
        line = self.line
        parts: list[tuple] = []
        buf: list[str] = []

        def flush(quoted: bool = False):
            if buf:
                parts.append(("lit", "".join(buf), quoted))
                buf.clear()

        while True:
            c = self.peek()
            if c == "" or c in _WORD_END:
                break
            if c == "\\":
                nxt = self.peek(1)
                if nxt == "\n":
                    self.advance(2)
                    continue
                self.advance(2)
                flush()
                parts.append(("lit", nxt, True))
            elif c == "'":
                flush()
                self.advance()
                j = self.text.find("'", self.i)
                if j < 0:
                    raise ShellError(line, "a single quote is never closed")
                parts.append(("lit", self.advance(j - self.i), True))
                self.advance()
            elif c == '"':
                flush()
                self.advance()
                parts.extend(self.read_double_quoted(line))
            elif c == "$" or c == "`":
                exp = self.read_dollar(quoted=False)
                if exp is None:
                    buf.append(self.advance())
                else:
                    flush()
                    parts.append(exp)
            elif c == "=" and not parts and buf and self.peek(1) == "(" and _is_name("".join(buf).rstrip("+")):
                buf.append(self.advance())
                flush()
                self.advance()
                return Word(tuple(parts), line, array=self.read_array(line))
            else:
                buf.append(self.advance())
        flush()
        return Word(tuple(parts), line)

    def read_array(self, line: int) -> list[Word]:
        items: list[Word] = []
        while True:
            c = self.peek()
            if c == "":
                raise ShellError(line, "an array `(` is never closed")
            if c in " \t\r\n":
                self.advance()
            elif c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c == "#":
                j = self.text.find("\n", self.i)
                self.advance((len(self.text) if j < 0 else j) - self.i)
            elif c == ")":
                self.advance()
                return items
            else:
                w = self.read_word()
                if not w.parts:
                    raise ShellError(self.line, f"unexpected {c!r} in an array")
                items.append(w)

    def read_double_quoted(self, line: int) -> list[tuple]:
        parts: list[tuple] = []
        buf: list[str] = []
        while True:
            c = self.peek()
            if c == "":
                raise ShellError(line, "a double quote is never closed")
            if c == '"':
                self.advance()
                break
            if c == "\\" and self.peek(1) in '"\\$`\n':
                nxt = self.peek(1)
                self.advance(2)
                if nxt != "\n":
                    buf.append(nxt)
            elif c in "$`":
                exp = self.read_dollar(quoted=True)
                if exp is None:
                    buf.append(self.advance())
                else:
                    if buf:
                        parts.append(("lit", "".join(buf), True))
                        buf = []
                    parts.append(exp)
            else:
                buf.append(self.advance())
        if buf or not parts:
            parts.append(("lit", "".join(buf), True))
        return parts

    def read_dollar(self, quoted: bool) -> tuple | None:
        line = self.line
        if self.peek() == "`":
            self.advance()
            j = self.text.find("`", self.i)
            if j < 0:
                raise ShellError(line, "a backquote is never closed")
            body = self.advance(j - self.i)
            self.advance()
            return ("cmd", body, quoted)
        nxt = self.peek(1)
        if nxt == "(" and self.peek(2) == "(":
            self.advance(3)
            body = self.balanced("(", ")", line, "$((")
            if self.peek() != ")":
                raise ShellError(line, "`$((` is not closed by `))`")
            self.advance()
            return ("arith", body, quoted)
        if nxt == "(":
            self.advance(2)
            return ("cmd", self.balanced("(", ")", line, "$("), quoted)
        if nxt == "{":
            self.advance(2)
            return ("var", self.balanced("{", "}", line, "${"), quoted)
        if nxt and (nxt.isalnum() or nxt == "_"):
            self.advance()
            if nxt.isdigit():
                return ("var", self.advance(), quoted)
            j = self.i
            while j < len(self.text) and (self.text[j].isalnum() or self.text[j] == "_"):
                j += 1
            return ("var", self.advance(j - self.i), quoted)
        if nxt and nxt in "@*#?$!-":
            self.advance(2)
            return ("var", nxt, quoted)
        return None

    def balanced(self, open_: str, close: str, line: int, what: str) -> str:
        """Text up to the matching `close` (quotes and nested pairs respected); the close is consumed."""
        depth, start = 1, self.i
        while True:
            c = self.peek()
            if c == "":
                raise ShellError(line, f"`{what}` is never closed")
            if c == "\\":
                self.advance(2)
                continue
            if c == "'" and open_ == "(":
                j = self.text.find("'", self.i + 1)
                if j < 0:
                    raise ShellError(line, "a single quote is never closed")
                self.advance(j - self.i + 1)
                continue
            if c == '"':
                self.advance()
                self.read_double_quoted(line)
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    body = self.text[start:self.i]
                    self.advance()
                    return body
            self.advance()


def _is_name(text: str) -> bool:
    return bool(text) and (text[0].isalpha() or text[0] == "_") and all(ch.isalnum() or ch == "_" for ch in text)


def is_name(text: str) -> bool:
    return _is_name(text)
