"""Error types that decide how the `mrl` command exits.

A `UserError` is the user's to fix (a bad spec, data row, reward function or command line): the
CLI prints its one-line message, no traceback, and exits 2. Anything else is a bug in mrl: the CLI
prints the traceback and exits 1.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; its message is shown as is, one line per problem."""

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class SpecError(UserError):
    """One or more problems in a job spec, each naming the file, line and dotted key."""


class CollectiveTimeout(RuntimeError):
    """A collective (or process-group set-up) did not finish within its timeout."""
