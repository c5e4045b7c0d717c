"""Where a job-spec value was set (`Origin`: a file and line, or the command line) and what
loading found (`Report`: every problem and warning, each located at a dotted key)."""
from __future__ import annotations

from dataclasses import dataclass, field


COMMAND_LINE = "command line"


@dataclass(frozen=True)
class Origin:
    """Where a value was set: a file and line, or the command line."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass
class Report:
    """Problems and warnings found while loading, each located at a dotted key."""

    main_file: str
    origins: dict[str, Origin] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bad_keys: set[str] = field(default_factory=set)

    def where(self, key: str) -> Origin:
        parts = key.split(".")
        while parts:
            origin = self.origins.get(".".join(parts))
            if origin is not None:
                return origin
            parts.pop()
        return Origin(self.main_file)

    def error(self, key: str, message: str, origin: Origin | None = None) -> None:
        self.problems.append(f"{origin or self.where(key)}: {key}: {message}")

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(f"{self.where(key)}: {key}: {message}")
