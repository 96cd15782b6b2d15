# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The lint's data: a rule, a rule's raw hit, and the finding that is reported."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: source.py imports nothing from here at run time either
    from .source import SourceFile

__all__ = ["Finding", "Hit", "Rule", "span"]


@dataclass(frozen=True)
class Hit:
    """What a rule reports: a node of a parsed file and the one-line message (which names the fix).

    `also`: other nodes whose statements' suppression comments silence the hit too (a seed reported where the
    rank is read can also be silenced where the window is drawn).
    """

    file: SourceFile
    node: ast.AST
    message: str
    also: tuple[ast.AST, ...] = ()

    def is_suppressed(self, rule: str) -> bool:
        return any(self.file.is_suppressed(node, rule) for node in (self.node, *self.also))


@dataclass(frozen=True)
class Rule:
    """One lint rule.

    Attributes:
        id: the stable id used in output, `--select`/`--ignore` and suppression comments.
        title: what it finds, in a few words.
        why: why it breaks rollout/trainer consistency (one sentence; SARIF's full description).
        fix: what to do instead (one sentence; SARIF's help text).
        needs: (file bytes lower-cased, path as reported lower-cased) -> whether the rule could report
            anything there; a cheap text test (words the rule cannot fire without, rarest first) that spares
            parsing most files of a large tree. It must never say no where `check` or `summarise` would find
            something.
        check: a parsed file -> hits (a rule that looks at one file at a time).
        summarise: for a rule that compares files (the rollout side against the trainer side): a parsed file ->
            its facts, plain data kept after the file's tree is dropped.
        compare: the facts of all files, and (path, path components) of every linted file -> findings.
    """

    id: str
    title: str
    why: str
    fix: str
    needs: Callable[[bytes, str], bool]
    check: Callable[[SourceFile], Iterable[Hit]]
    summarise: Callable[[SourceFile], object] | None = None
    compare: Callable[[Sequence[object], Sequence[tuple[str, tuple[str, ...]]]], Iterable[Finding]] | None = None

    @property
    def name(self) -> str:
        """The registry's key (`rules.RULES`): the id."""
        return self.id


def span(file: SourceFile, node: ast.AST) -> tuple[int, int, int, int]:
    """(line, col, end_line, end_col) of `node` as a `Finding` gives them: 1-based, columns in characters."""
    line = node.lineno
    end_line = getattr(node, "end_lineno", None) or line
    col = file.char_col(line, node.col_offset) + 1
    end_offset = getattr(node, "end_col_offset", None)
    end_col = file.char_col(end_line, end_offset) + 1 if end_offset is not None else col + 1
    return line, col, end_line, end_col


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
