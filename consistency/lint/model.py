# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The lint's data: a rule, a rule's raw hit, and the finding that is reported."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: source.py imports nothing from here at run time either
    from .source import SourceFile

__all__ = ["Finding", "Hit", "Rule"]


@dataclass(frozen=True)
class Hit:
    """What a rule reports: a node of a parsed file and the one-line message (which names the fix)."""

    file: SourceFile
    node: ast.AST
    message: str


@dataclass(frozen=True)
class Rule:
    """One lint rule.

    Attributes:
        id: the stable id used in output, `--select`/`--ignore` and suppression comments.
        title: what it finds, in a few words.
        why: why it breaks rollout/trainer consistency (one sentence; SARIF's full description).
        fix: what to do instead (one sentence; SARIF's help text).
        check: all linted files -> hits. Most rules look at one file at a time; a rule that compares
            files (the rollout side against the trainer side) sees them all at once.
    """

    id: str
    title: str
    why: str
    fix: str
    check: Callable[[Sequence[SourceFile]], Iterable[Hit]]


@dataclass(frozen=True, order=True)
class Finding:
    """One reported problem. `line`/`col` are 1-based (`col` counts characters), as editors show them.

    `end_line`/`end_col` close the flagged expression (`end_col` exclusive, 1-based).
    """

    path: str
    line: int
    col: int
    rule: str
    message: str
    end_line: int
    end_col: int

    def format(self) -> str:
        """`path:line:col rule-id message` (the text output, one line)."""
        return f"{self.path}:{self.line}:{self.col} {self.rule} {self.message}"

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "end_line": self.end_line,
            "end_col": self.end_col,
            "rule": self.rule,
            "message": self.message,
        }
